"""``model.lora``: the low-rank adapters of a block's projections, and the split of a model's state
into what trains and what stays frozen.

Flax's ``nnx.LoRA`` holds each adapter (A [in, r] from its default init, B [r, out] zeros), so a new
adapter adds 0 and a LoRA model starts as its base, bit for bit. Its parameters are
``nnx.LoRAParam``, a subclass of ``nnx.Param``: one filter tells the adapters (what trains) from the
base (what is frozen), and checkpoints hold only the adapters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.config.model import ModelConfig


def _drop(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """``x`` through a dropout layer: masked with ``key`` (training), unchanged without one."""
    return layer(x, deterministic=key is None, rngs=key)


LORA_STREAM = 0x6C6F7261  # "lora"
# The base model's parameters: every nnx.Param but the adapters (nnx.LoRAParam, a Param subclass).
BASE_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State | None, nnx.State]:
    """(graphdef, the parameters that train, the frozen base or None, the rest of the state).

    Without adapters every parameter trains (no frozen part); with ``model.lora`` only the adapters
    do, and the base rides along frozen. ``nnx.merge(graphdef, trained, *([frozen] if frozen else
    []), rest)`` rebuilds it.
    """
    if model.cfg.lora.rank:
        return nnx.split(model, nnx.LoRAParam, BASE_PARAMS, ...)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, None, rest


class Adapters(nnx.Module):
    """``model.lora``'s low-rank adapters of one module's projections: flax's ``nnx.LoRA`` each (A
    [in, r] from its default init, B [r, out] zeros: a new adapter adds 0), scaled by alpha / r,
    with dropout on their input.

    ``delta(name, x)`` is what adapter ``name`` adds to its projection's output: x [..., in] ->
    [..., out] (0 when the projection has none). Their parameters are ``nnx.LoRAParam``: the train
    step differentiates those alone, and checkpoints hold only them.

    ``projections[name]`` is ``(weight, n)``: the projection's weight, whose first ``n`` dimensions
    are its input (wo's [heads, head_dim]; the others' one). A reads the input flattened, B writes
    the output flattened, and each takes the logical axis that leads its side of the weight beside
    ``lora_rank``: the mesh lays an adapter out as its projection (B of q split over heads where wq
    is), so its output adds to the projection's in place.
    """

    def __init__(self, cfg: ModelConfig, projections: dict[str, tuple[nnx.Param, int]], *,
                 rngs: nnx.Rngs):
        lora = cfg.lora
        self.names = tuple(name for name in projections if lora.rank and name in lora.targets)
        self.scale = lora.scale
        self.dropout = nnx.Dropout(lora.dropout)
        for name in self.names:
            weight, n = projections[name]
            module = nnx.LoRA(math.prod(weight.shape[:n]), lora.rank, math.prod(weight.shape[n:]),
                              param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
            module.lora_a.set_metadata(axes=(weight.axes[0], "lora_rank"))
            module.lora_b.set_metadata(axes=("lora_rank", weight.axes[n]))
            setattr(self, name, module)

    def key(self, dropout_key: jax.Array | None) -> jax.Array | None:
        """The adapters' dropout key from the module's (None: no adapter dropout, or not training).
        A tag folded in keeps the model's own dropout masks what they are without adapters."""
        return None if dropout_key is None or not self.dropout.rate else jax.random.fold_in(
            dropout_key, LORA_STREAM)

    def delta(self, name: str, x: jax.Array, key: jax.Array | None = None) -> jax.Array | None:
        if name not in self.names:
            return None
        module = getattr(self, name)
        dt = x.dtype
        if key is not None:  # each adapter its own mask, as PEFT gives each target its own dropout
            x = _drop(self.dropout, x, jax.random.fold_in(key, self.names.index(name)))
        return (x @ module.lora_a[...].astype(dt)) @ (self.scale * module.lora_b[...]).astype(dt)
