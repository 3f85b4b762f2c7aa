"""The MLP a block takes, as a table (:data:`MLPS`): the gated MLP (SwiGLU with silu, GeGLU with
gelu_tanh: ``model.mlp_activation``) or a mixture of experts (``model.experts``,
:mod:`seqjax.model.experts`). A layer's row is ``ModelConfig.mlp_of(layer)``; every row is called
``mlp(x, segment_ids, dropout_key) -> (y, router terms or None)``, the terms being the forward's
side terms (the router's statistics, for its losses)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from seqjax.config.model import LoraConfig, ModelConfig
from seqjax.model.experts import Experts
from seqjax.model.lora import Adapters
from seqjax.model.quant import weight


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype,
                 axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def drop(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """``x`` through a dropout layer: masked with ``key`` (training), unchanged without one."""
    return layer(x, deterministic=key is None, rngs=key)


class SwiGLU(nnx.Module):
    """w_down(act(x w_gate) * (x w_up)): SwiGLU with silu, GeGLU with gelu_tanh
    (``model.mlp_activation``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pdt = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.param_dtype)
        self.w_gate = normal_param(rngs, (d, f), cfg.init_std, pdt, ("embed", "ff"))
        self.w_up = normal_param(rngs, (d, f), cfg.init_std, pdt, ("embed", "ff"))
        self.w_down = normal_param(rngs, (f, d), cfg.init_std / math.sqrt(2 * cfg.n_layers), pdt,
                                   ("ff", "embed"))
        self.dropout = nnx.Dropout(cfg.dropout)
        self.gelu = cfg.mlp_activation == "gelu_tanh"
        self.lora = Adapters(
            cfg, {"gate": (self.w_gate, 1), "up": (self.w_up, 1), "down": (self.w_down, 1)},
            rngs=rngs)

    def __call__(self, x, segment_ids: jax.Array | None = None, dropout_key: jax.Array | None = None):
        dt = x.dtype
        x = checkpoint_name(x, "mlp_in")
        key = self.lora.key(dropout_key)
        gate = self._linear("gate", x, weight(self.w_gate, dt), key)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        out = self._linear("down", gate * self._linear("up", x, weight(self.w_up, dt), key),
                           weight(self.w_down, dt), key)
        return drop(self.dropout, checkpoint_name(out, "mlp_out"), dropout_key), None

    def _linear(self, name: str, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
        return self.lora.apply(name, x, x @ w, w, key)




class ExpertsMLP(nnx.Module):
    """:class:`~seqjax.model.experts.Experts` as a block's MLP: its input and output tagged for
    remat, and the branch's dropout. With ``model.experts.shared_d_ff`` (Qwen3.5-MoE) a shared
    expert (a gated MLP that wide, without adapters) joins every token's output, times
    sigmoid(x w_shared_gate)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.experts = Experts(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout)
        width = cfg.experts.shared_d_ff
        if width:
            plain = dataclasses.replace(cfg, d_ff=width, dropout=0.0, lora=LoraConfig())
            self.shared = SwiGLU(plain, rngs=rngs)
            pdt = jnp.dtype(cfg.param_dtype)
            self.shared_gate = normal_param(rngs, (cfg.d_model, 1), cfg.init_std, pdt, ("embed", None))
        self.has_shared = bool(width)

    def __call__(self, x, segment_ids: jax.Array | None = None, dropout_key: jax.Array | None = None):
        x = checkpoint_name(x, "mlp_in")
        out, terms = self.experts(x, segment_ids)
        if self.has_shared:
            gate = jax.nn.sigmoid(x @ weight(self.shared_gate, x.dtype))
            out = out + gate * self.shared(x)[0]
        return drop(self.dropout, checkpoint_name(out, "mlp_out"), dropout_key), terms


# model.mlp_of(layer) -> the module a block builds for its MLP
MLPS: dict[str, type] = {"gated": SwiGLU, "experts": ExpertsMLP}
