"""One Transformer block (Flax NNX): pre-norm attention and MLP branches, each added to the residual
stream; the families' variants are settings of it (``model.qkv_bias``, ``qk_norm``,
``norm_plus_one``, ``post_norms``, ``mlp_activation``).

Parameters are plain ``nnx.Param`` arrays with descriptive names and an
``axes`` metadata tuple of logical axis names, so sharding rules can match
either. Shapes (V vocab, D d_model, H heads, K kv heads, Dh head_dim, F d_ff):

==========================  ==============  ===========================
path                        shape           axes
==========================  ==============  ===========================
embed.embedding             [V, D]          (vocab, embed)
blocks.i.attn_norm.scale    [D]             (embed,)
blocks.i.attn.wq            [D, H, Dh]      (embed, heads, head_dim)
blocks.i.attn.wk, .wv       [D, K, Dh]      (embed, kv_heads, head_dim)
blocks.i.attn.wo            [H, Dh, D]      (heads, head_dim, embed)
blocks.i.mlp_norm.scale     [D]             (embed,)
blocks.i.mlp.w_gate, w_up   [D, F]          (embed, ff)
blocks.i.mlp.w_down         [F, D]          (ff, embed)
final_norm.scale            [D]             (embed,)
lm_head.kernel (untied)     [D, V]          (embed, vocab)
==========================  ==============  ===========================

Dropout (``model.dropout`` on the embeddings and on each residual branch,
``model.token_dropout`` on whole token embeddings, ``model.attention_dropout``
on the attention probabilities) happens only when the caller passes a
``dropout_key``: the train step does, from (run.seed, step); evaluation and
generation do not, so they are deterministic. Each layer takes its own key
from it with ``jax.random.split``, and every mask is drawn for the whole
global batch, so the bits do not depend on the mesh.

Initialization follows GPT-2 / CS336: every matrix ~ N(0, init_std); the two
projections that write into the residual stream (``wo``, ``w_down``) use
init_std / sqrt(2 * n_layers) so the residual's variance does not grow with
depth; norm scales start at 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from seqjax.config.model import ModelConfig
from seqjax.model.attention import attention, resolve_backend
from seqjax.model.cache import LayerView
from seqjax.model.deltanet import DeltaNet
from seqjax.model.lora import Adapters
from seqjax.model.mask import FULL
from seqjax.model.mlp import MLPS, drop, normal_param
from seqjax.model.quant import weight
from seqjax.model.rope import rope, rope_attention_factor


def split_keys(key: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """``n`` independent dropout keys from ``key``, or ``n`` Nones when there is none (no
    dropout)."""
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 whatever the compute dtype (bf16 squares lose too
    much).

    ``plus_one`` (Gemma): x / rms(x) * (1 + scale), the scale starting at 0. ``axes``: the logical
    axis of the normed dimension (``embed``; ``head_dim`` for the per-head q/k norms).
    """

    def __init__(self, dim: int, *, dtype, eps: float = 1e-6, plus_one: bool = False,
                 axis: str = "embed"):
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), dtype), axes=(axis,))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.plus_one + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head attention with grouped-query option; RoPE on q and k; backend from
    ``model.attention``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        # Qwen3.5's output gate: each head's query projection is [query | gate], 2 Dh wide
        self.wq = normal_param(rngs, (d, h, dh * (1 + cfg.attention_gate)), cfg.init_std, pdt,
                               ("embed", "heads", "head_dim"))
        self.wk = normal_param(rngs, (d, kv, dh), cfg.init_std, pdt, ("embed", "kv_heads", "head_dim"))
        self.wv = normal_param(rngs, (d, kv, dh), cfg.init_std, pdt, ("embed", "kv_heads", "head_dim"))
        self.wo = normal_param(rngs, (h, dh, d), out_std, pdt, ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:  # Qwen2
            self.bq = nnx.Param(jnp.zeros((h, dh), pdt), axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((kv, dh), pdt), axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((kv, dh), pdt), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's q and k normed over head_dim, before RoPE
            self.q_norm = RMSNorm(dh, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one,
                                  axis="head_dim")
            self.k_norm = RMSNorm(dh, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one,
                                  axis="head_dim")
        if cfg.attention_sinks:  # gpt-oss: a logit per head in every query's softmax, attending to nothing
            self.sinks = nnx.Param(jnp.zeros((h,), pdt), axes=("heads",))
        if cfg.attn_out_bias:  # gpt-oss
            self.bo = nnx.Param(jnp.zeros((d,), pdt), axes=("embed",))
        self.qkv_bias, self.qk_norm, self.gated = cfg.qkv_bias, cfg.qk_norm, cfg.attention_gate
        self.has_sinks, self.out_bias = cfg.attention_sinks, cfg.attn_out_bias
        self.rope_scale = rope_attention_factor(cfg.rope_scaling)  # (YaRN's; 1 otherwise)
        self.lora = Adapters(
            cfg, {"q": (self.wq, 1), "k": (self.wk, 1), "v": (self.wv, 1), "o": (self.wo, 2)},
            rngs=rngs)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        self.backend = cfg.attention
        self.sliding_window = cfg.sliding_window
        self.attention_dropout = cfg.attention_dropout
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rope_freq: jax.Array,
                 window=None, metadata=None, dropout_key: jax.Array | None = None,
                 prefix_ids: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] -> [B, T, D], attending within each segment (contract 2) on the configured
        backend; ``prefix_ids``: the shared prompt a segment also attends to (preference pairs).

        ``rope_freq``: this layer's RoPE frequencies; ``window``: its sliding window (None: the
        whole segment). ``metadata``: the pallas kernel's block ranges, computed once per forward
        and shared by all layers. ``dropout_key``: drop attention probabilities and the branch's
        output (training); None: no dropout.
        """
        probs_key, out_key = split_keys(dropout_key, 2)
        lora_key = self.lora.key(dropout_key)
        q, k, v, gate = self._qkv(x, positions, rope_freq, lora_key)

        def attend(window):
            return attention(q, k, v, segment_ids, backend=self.backend, scale=self.scale,
                             metadata=metadata, dropout_rate=self.attention_dropout,
                             dropout_key=probs_key, window=window, prefix_ids=prefix_ids, positions=positions,
                             sinks=self._sinks())

        if (isinstance(window, jax.core.Tracer) and self.sliding_window
                and resolve_backend(self.backend, q.dtype, windows=True) == "splash"):
            # Splash's mask is static: a scanned body serving sliding and global layers runs one of
            # two kernels.
            o = jax.lax.cond(window >= FULL, lambda: attend(None), lambda: attend(self.sliding_window))
        else:
            o = attend(window)
        return drop(self.dropout, checkpoint_name(self._out(o, gate, lora_key), "attn_out"), out_key)

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: LayerView,
               rope_freq: jax.Array, window=None) -> tuple[jax.Array, LayerView]:
        """x [B, T, D] through this layer's cache view (seqjax.model.cache): its keys and values
        written, then attended over what the view holds; (out, the view after the write)."""
        q, k, v, gate = self._qkv(x, positions, rope_freq)
        o, cache = cache.attend(q, k, v, segment_ids=segment_ids, window=window, scale=self.scale,
                                sinks=self._sinks())
        return self._out(o, gate), cache

    def _sinks(self) -> jax.Array | None:
        return self.sinks[...] if self.has_sinks else None

    def _qkv(self, x: jax.Array, positions: jax.Array, rope_freq: jax.Array,
             lora_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Queries [B, T, H, Dh] and keys [B, T, K, Dh] rotated to ``positions``, values [B, T, K,
        Dh], and the output gate's logits [B, T, H, Dh] (None without ``model.attention_gate``)."""
        dt = x.dtype
        q = self._adapted("q", x, weight(self.wq, dt), lora_key)
        q, gate = jnp.split(q, 2, axis=-1) if self.gated else (q, None)
        k = self._adapted("k", x, weight(self.wk, dt), lora_key)
        v = self._adapted("v", x, weight(self.wv, dt), lora_key)
        if self.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[
                ...].astype(dt)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, rope_freq, self.rope_scale), rope(k, positions, rope_freq, self.rope_scale)
        # Named for model.remat=names: the backward pass may keep these instead of recomputing them.
        return checkpoint_name(q, "q"), checkpoint_name(k, "k"), checkpoint_name(v, "v"), gate

    def _out(self, o: jax.Array, gate: jax.Array | None, lora_key: jax.Array | None = None) -> jax.Array:
        if gate is not None:  # (Qwen3.5: in the compute dtype, as transformers gates)
            o = o * jax.nn.sigmoid(gate).astype(o.dtype)
        w = weight(self.wo, o.dtype)
        out = self.lora.apply("o", o.reshape(*o.shape[:2], -1), jnp.einsum("bthk,hkd->btd", o, w), w, lora_key)
        return out + self.bo[...].astype(out.dtype) if self.out_bias else out

    def _adapted(self, name: str, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
        """x [B, T, D] through a head projection w [D, n, Dh] -> [B, T, n, Dh], with its adapter (on
        the heads flattened)."""
        projected = jnp.einsum("btd,dhk->bthk", x, w)
        if name not in self.lora.names:
            return projected
        flat = self.lora.apply(name, x, projected.reshape(*projected.shape[:2], -1), w, key)
        return flat.reshape(projected.shape)


# model.mixer_of(layer) -> the module a block builds to mix its tokens (the attention, or a Gated DeltaNet)
MIXERS: dict[str, type] = {"attention": Attention, "deltanet": DeltaNet}


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); each branch ends in its
    dropout.

    With ``model.post_norms`` (Gemma 3) each branch's output is normed too before it is added: four
    norms.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, mlp: str = "gated", mixer: str = "attention"):
        norm = functools.partial(RMSNorm, cfg.d_model, dtype=jnp.dtype(cfg.param_dtype),
                                 eps=cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.attn_norm = norm()
        self.attn = MIXERS[mixer](cfg, rngs=rngs)  # (the layer's row: model.mixer_of)
        self.mlp_norm = norm()
        self.mlp = MLPS[mlp](cfg, rngs=rngs)  # (the layer's row: model.mlp_of)
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.post_norms = cfg.post_norms

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rope_freq: jax.Array,
                 window=None, metadata=None, dropout_key: jax.Array | None = None,
                 prefix_ids: jax.Array | None = None):
        """(x after the block, the MLP's side terms: its router's, or None for the gated MLP)."""
        attn_key, mlp_key = split_keys(dropout_key, 2)
        x = x + self._post(
            self.attn(self.attn_norm(x), positions, segment_ids, rope_freq, window, metadata,
                      dropout_key=attn_key, prefix_ids=prefix_ids), "attn")
        out, terms = self.mlp(self.mlp_norm(x), segment_ids, dropout_key=mlp_key)
        return x + self._post(out, "mlp"), terms

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: LayerView,
               rope_freq: jax.Array, window=None) -> tuple[jax.Array, LayerView]:
        """The same block over a cache view (see :meth:`Attention.decode`); returns (x, the layer's
        view after the write)."""
        attended, cache = self.attn.decode(self.attn_norm(x), positions, segment_ids, cache,
                                           rope_freq, window)
        x = x + self._post(attended, "attn")
        return x + self._post(self.mlp(self.mlp_norm(x), segment_ids)[0], "mlp"), cache

    def _post(self, branch: jax.Array, which: str) -> jax.Array:
        return getattr(self, f"post_{which}_norm")(branch) if self.post_norms else branch


def unrolled_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.List:
    """``n_layers`` blocks, one module each (``model.scan_layers: false``), each initialized from the key
    :func:`stacked_blocks` gives its layer: the same seed gives the same starting weights in either
    layout, so switching a compile option never changes a run's curve (tests/test_scan.py)."""
    keys = jax.random.split(rngs.params(), cfg.n_layers)  # what nnx.split_rngs hands the stacked layers
    return nnx.List([Block(cfg, rngs=nnx.Rngs(params=key), mlp=cfg.mlp_of(i), mixer=cfg.mixer_of(i))
                     for i, key in enumerate(keys)])


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """``n_layers`` blocks as one Block whose parameters carry a leading layer axis
    (``model.scan_layers``).

    Each layer gets its own initialization keys (``nnx.split_rngs``), and each
    parameter's ``axes`` gains a leading ``layers`` name, which no mesh axis
    shards (seqjax.model.sharding), so a layer's slice shards as an unrolled block does.
    """

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs, mlp=cfg.mlp_of(0), mixer=cfg.mixer_of(0))  # (one kind: ModelConfig.check)

    blocks = make(rngs)  # (split_rngs: layer i draws from split(fold_in(key, count), n_layers)[i])
    for _, variable in nnx.iter_graph(blocks):
        if isinstance(variable, nnx.Param):
            variable.set_metadata(axes=("layers", *getattr(variable, "axes", ())))
    return blocks
