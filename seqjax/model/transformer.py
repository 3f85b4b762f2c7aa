"""The decoder-only Transformer LM (Flax NNX): pre-norm blocks, RMSNorm, RoPE, grouped-query attention, SwiGLU.

Packing is what this model is careful about: RoPE reads the batch's
``positions`` (0 at each segment's first token) and every attention call gets
``segment_ids``, so a token in a packed row sees exactly what it would see if
its document ran alone (tests/test_model.py proves it).

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

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from seqjax.config.tree import Config, ModelConfig
from seqjax.model.attention import TILED, attention, masked_attention, resolve_backend
from seqjax.model.cache import KVCache, LayerCache
from seqjax.model.head import head_logits
from seqjax.model.kernels.block_ranges import MOSAIC_BLOCKS, BlockSizes, block_metadata  # plain JAX; kernels lazy
from seqjax.model.lora import Adapters
from seqjax.model.mask import FULL, segment_mask
from seqjax.model.quant import weight
from seqjax.model.remat import remat_block, remat_policy
from seqjax.model.rope import rope, rope_frequencies


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


def _keys(key: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """``n`` independent dropout keys from ``key``, or ``n`` Nones when there is none (no dropout)."""
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def _drop(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """``x`` through a dropout layer: masked with ``key`` (training), unchanged without one."""
    return layer(x, deterministic=key is None, rngs=key)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in float32 whatever the compute dtype (bf16 squares lose too much).

    ``plus_one`` (Gemma): x / rms(x) * (1 + scale), the scale starting at 0. ``axes``: the logical axis of
    the normed dimension (``embed``; ``head_dim`` for the per-head q/k norms).
    """

    def __init__(self, dim: int, *, dtype, eps: float = 1e-6, plus_one: bool = False, axis: str = "embed"):
        self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), dtype), axes=(axis,))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.plus_one + self.scale[...].astype(jnp.float32))).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head attention with grouped-query option; RoPE on q and k; backend from ``model.attention``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = _param(rngs, (d, h, dh), cfg.init_std, pdt, ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, (d, kv, dh), cfg.init_std, pdt, ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, (d, kv, dh), cfg.init_std, pdt, ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, (h, dh, d), out_std, pdt, ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:  # Qwen2
            self.bq = nnx.Param(jnp.zeros((h, dh), pdt), axes=("heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((kv, dh), pdt), axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((kv, dh), pdt), axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's q and k normed over head_dim, before RoPE
            self.q_norm = RMSNorm(dh, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one, axis="head_dim")
            self.k_norm = RMSNorm(dh, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one, axis="head_dim")
        self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.lora = Adapters(cfg, {"q": (self.wq, 1), "k": (self.wk, 1), "v": (self.wv, 1), "o": (self.wo, 2)},
                             rngs=rngs)
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        self.backend = cfg.attention
        self.sliding_window = cfg.sliding_window
        self.attention_dropout = cfg.attention_dropout
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rope_freq: jax.Array,
                 window=None, metadata=None, dropout_key: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] -> [B, T, D], attending within each segment (contract 2) on the configured backend.

        ``rope_freq``: this layer's RoPE frequencies; ``window``: its sliding window (None: the whole segment).
        ``metadata``: the pallas kernel's block ranges, computed once per forward and shared by all layers.
        ``dropout_key``: drop attention probabilities and the branch's output (training); None: no dropout.
        """
        probs_key, out_key = _keys(dropout_key, 2)
        lora_key = self.lora.key(dropout_key)
        q, k, v = self._qkv(x, positions, rope_freq, lora_key)

        def attend(window):
            return attention(q, k, v, segment_ids, backend=self.backend, scale=self.scale, metadata=metadata,
                             dropout_rate=self.attention_dropout, dropout_key=probs_key, window=window)

        if (isinstance(window, jax.core.Tracer) and self.sliding_window
                and resolve_backend(self.backend, q.dtype, windows=True) == "splash"):
            # Splash's mask is static: a scanned body serving sliding and global layers runs one of two kernels.
            o = jax.lax.cond(window >= FULL, lambda: attend(None), lambda: attend(self.sliding_window))
        else:
            o = attend(window)
        return _drop(self.dropout, checkpoint_name(self._out(o, lora_key), "attn_out"), out_key)

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: LayerCache,
               rope_freq: jax.Array, window=None) -> tuple[jax.Array, LayerCache]:
        """Write this call's keys/values at slots ``cache.start..`` and attend over the whole cache; (out, cache).

        Always the XLA path (:func:`masked_attention`): a decode step has one query per row, where the
        training kernels have nothing to skip. A sliding layer's window applies to the cache's slots.
        """
        q, k, v = self._qkv(x, positions, rope_freq)
        keys = jax.lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), cache.start, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache.values, v.astype(cache.values.dtype), cache.start, axis=1)
        q_index = cache.start + jnp.arange(x.shape[1])[None, :]
        kv_index = jnp.arange(keys.shape[1])[None, :]
        mask = segment_mask(segment_ids, cache.segment_ids, q_index, kv_index, window=window)
        o = masked_attention(q, keys.astype(x.dtype), values.astype(x.dtype), mask, scale=self.scale)
        return self._out(o), dataclasses.replace(cache, keys=keys, values=values)

    def _qkv(self, x: jax.Array, positions: jax.Array, rope_freq: jax.Array,
             lora_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [B, T, H, Dh] and keys [B, T, K, Dh] rotated to ``positions``, values [B, T, K, Dh]."""
        dt = x.dtype
        q = self._adapted("q", x, jnp.einsum("btd,dhk->bthk", x, weight(self.wq, dt)), lora_key)
        k = self._adapted("k", x, jnp.einsum("btd,dhk->bthk", x, weight(self.wk, dt)), lora_key)
        v = self._adapted("v", x, jnp.einsum("btd,dhk->bthk", x, weight(self.wv, dt)), lora_key)
        if self.qkv_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, rope_freq), rope(k, positions, rope_freq)
        # Named for model.remat=names: the backward pass may keep these instead of recomputing them.
        return checkpoint_name(q, "q"), checkpoint_name(k, "k"), checkpoint_name(v, "v")

    def _out(self, o: jax.Array, lora_key: jax.Array | None = None) -> jax.Array:
        out = jnp.einsum("bthk,hkd->btd", o, weight(self.wo, o.dtype))
        delta = self.lora.delta("o", o.reshape(*o.shape[:2], -1), lora_key)
        return out if delta is None else out + delta

    def _adapted(self, name: str, x: jax.Array, projected: jax.Array, key: jax.Array | None) -> jax.Array:
        """A head projection [B, T, n, Dh] plus its adapter's output (reshaped to the heads), if it has one."""
        delta = self.lora.delta(name, x, key)
        return projected if delta is None else projected + delta.reshape(projected.shape)


class SwiGLU(nnx.Module):
    """w_down(act(x w_gate) * (x w_up)): SwiGLU with silu, GeGLU with gelu_tanh (``model.mlp_activation``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pdt = cfg.d_model, cfg.d_ff, jnp.dtype(cfg.param_dtype)
        self.w_gate = _param(rngs, (d, f), cfg.init_std, pdt, ("embed", "ff"))
        self.w_up = _param(rngs, (d, f), cfg.init_std, pdt, ("embed", "ff"))
        self.w_down = _param(rngs, (f, d), cfg.init_std / math.sqrt(2 * cfg.n_layers), pdt, ("ff", "embed"))
        self.dropout = nnx.Dropout(cfg.dropout)
        self.gelu = cfg.mlp_activation == "gelu_tanh"
        self.lora = Adapters(cfg, {"gate": (self.w_gate, 1), "up": (self.w_up, 1), "down": (self.w_down, 1)},
                             rngs=rngs)

    def __call__(self, x, dropout_key: jax.Array | None = None):
        dt = x.dtype
        x = checkpoint_name(x, "mlp_in")
        key = self.lora.key(dropout_key)
        gate = self._linear("gate", x, weight(self.w_gate, dt), key)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        out = self._linear("down", gate * self._linear("up", x, weight(self.w_up, dt), key), weight(self.w_down, dt),
                           key)
        return _drop(self.dropout, checkpoint_name(out, "mlp_out"), dropout_key)

    def _linear(self, name: str, x: jax.Array, w: jax.Array, key: jax.Array | None) -> jax.Array:
        delta = self.lora.delta(name, x, key)
        return x @ w if delta is None else x @ w + delta


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); each branch ends in its dropout.

    With ``model.post_norms`` (Gemma 3) each branch's output is normed too before it is added: four norms.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, cfg.d_model, dtype=jnp.dtype(cfg.param_dtype), eps=cfg.norm_eps,
                                 plus_one=cfg.norm_plus_one)
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = SwiGLU(cfg, rngs=rngs)
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.post_norms = cfg.post_norms

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rope_freq: jax.Array,
                 window=None, metadata=None, dropout_key: jax.Array | None = None) -> jax.Array:
        attn_key, mlp_key = _keys(dropout_key, 2)
        x = x + self._post(self.attn(self.attn_norm(x), positions, segment_ids, rope_freq, window, metadata,
                                     dropout_key=attn_key), "attn")
        return x + self._post(self.mlp(self.mlp_norm(x), dropout_key=mlp_key), "mlp")

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: LayerCache,
               rope_freq: jax.Array, window=None) -> tuple[jax.Array, LayerCache]:
        """The same block over the KV cache (see :meth:`Attention.decode`); returns (x, the layer's updated cache)."""
        attended, cache = self.attn.decode(self.attn_norm(x), positions, segment_ids, cache, rope_freq, window)
        x = x + self._post(attended, "attn")
        return x + self._post(self.mlp(self.mlp_norm(x)), "mlp"), cache

    def _post(self, branch: jax.Array, which: str) -> jax.Array:
        return getattr(self, f"post_{which}_norm")(branch) if self.post_norms else branch


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """``n_layers`` blocks as one Block whose parameters carry a leading layer axis (``model.scan_layers``).

    Each layer gets its own initialization keys (``nnx.split_rngs``), and each
    parameter's ``axes`` gains a leading ``layers`` name, which no mesh axis
    shards (seqjax.model.sharding), so a layer's slice shards as an unrolled block does.
    """

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    blocks = make(rngs)
    for _, variable in nnx.iter_graph(blocks):
        if isinstance(variable, nnx.Param):
            variable.set_metadata(axes=("layers", *getattr(variable, "axes", ())))
    return blocks


def _frozen(value: Any) -> Any:
    """Lists (model.remat_names) as tuples, at any depth, so the config hashes."""
    return tuple(map(_frozen, value)) if isinstance(value, (list, tuple)) else value


class _HashableModelConfig(ModelConfig):
    """The model's config, hashable so it can sit in the static graph definition that jit keys on."""

    def __hash__(self) -> int:
        return hash(_frozen(dataclasses.astuple(self)))

    @classmethod
    def of(cls, cfg: ModelConfig) -> "_HashableModelConfig":
        """A copy of ``cfg`` (field by field, so the rope_scaling section stays a dataclass)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


class TransformerLM(nnx.Module):
    """Decoder-only LM. ``model(inputs, positions=..., segment_ids=...)`` -> float32 logits [B, T, V].

    inputs, positions, segment_ids: int [B, T] (contract 1). Shape errors
    (mismatched fields, T > max_seq_len) raise at trace time. Token ids outside
    [0, vocab_size) raise ValueError when ``inputs`` is concrete (an eager
    call); under jit they cannot be checked for free, so the embedding lookup
    turns them into NaN instead of a silently clamped row.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is null: pass vocab_size (the tokenizer's) to build_model")
        if cfg.max_seq_len is None:
            raise ValueError("model.max_seq_len is null: build the model with build_model(config), which resolves it")
        cfg = _HashableModelConfig.of(cfg)
        cfg.check()
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=pdt,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.embed.embedding.set_metadata(axes=("vocab", "embed"))
        self.embed_dropout = nnx.Dropout(cfg.dropout)
        self.token_dropout = nnx.Dropout(cfg.token_dropout, broadcast_dims=(-1,))  # one draw per token: [B, T, 1]
        self.blocks = stacked_blocks(cfg, rngs) if cfg.scan_layers else nnx.List(
            [Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_embeddings else _param(
            rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, pdt, ("embed", "vocab"))

    def __call__(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] float32 for a batch (contract 1): the training and evaluation forward pass.

        ``dropout_key``: the training step's key, which turns dropout on; None (evaluation) is deterministic.
        """
        return head_logits(*self.features_and_head(inputs, positions=positions, segment_ids=segment_ids,
                                                   dropout_key=dropout_key))

    def features_and_head(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                          dropout_key: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The forward pass up to the LM head: (final-normed features [B, T, D], head [D, V]), both compute dtype.

        ``model.loss_chunk_tokens`` takes the loss from here (seqjax.model.loss.chunked_lm_loss), so the whole
        logits are never built.
        """
        self.check_batch(inputs, positions, segment_ids)
        token_key, embed_key, blocks_key = _keys(dropout_key, 3)
        x = _drop(self.embed_dropout, _drop(self.token_dropout, self.embed_tokens(inputs), token_key), embed_key)
        x = self.final_norm(self.hidden(x, positions=positions, segment_ids=segment_ids, dropout_key=blocks_key))
        return x, self.head().astype(x.dtype)

    def decode(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
               cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Logits [B, T, V] float32 for ``inputs`` written into ``cache`` at slots ``cache.length..``; (logits, cache).

        A prefill passes the prompts (T tokens), a decode step one token per row (T = 1);
        seqjax.model.decode wraps both.
        """
        self.check_batch(inputs, positions, segment_ids)
        x = self.embed_tokens(inputs)
        start = cache.length
        seg = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids, segment_ids.astype(jnp.int32), start, axis=1)
        layers = []
        freqs = self.rope_freqs()
        for i, (keys, values) in enumerate(zip(cache.keys, cache.values)):
            x, layer = self.layer(i).decode(x, positions, segment_ids, LayerCache(keys, values, seg, start), freqs[i],
                                            self.cfg.window_of(i))
            layers.append(layer)
        cache = KVCache(tuple(c.keys for c in layers), tuple(c.values for c in layers), seg, start + inputs.shape[1])
        return self.logits(x), cache

    def embed_tokens(self, inputs) -> jax.Array:
        """Token ids [B, T] -> embeddings [B, T, D] in the compute dtype; out-of-range ids give NaN rows."""
        v = self.cfg.vocab_size
        ids = jnp.where((inputs >= 0) & (inputs < v), inputs, v)  # v is out of bounds -> filled with NaN
        table = self.embed.embedding[...]
        x = jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
        if self.cfg.embed_scale:  # Gemma: sqrt(d_model), rounded to the table's dtype as transformers does
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), table.dtype)
        return x.astype(self.cfg.compute_dtype)

    def from_embeddings(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                        dropout_key: jax.Array | None = None) -> jax.Array:
        """The blocks and head applied to embeddings x [B, T, D] (the input of the first block); logits [B, T, V]."""
        return self.logits(self.hidden(x, positions=positions, segment_ids=segment_ids, dropout_key=dropout_key))

    def hidden(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
               dropout_key: jax.Array | None = None) -> jax.Array:
        """The blocks on embeddings x [B, T, D]: the last block's output [B, T, D], before the final norm.

        Under ``model.remat`` each block is one rematerialized unit: its backward pass recomputes what the
        policy does not keep (:func:`seqjax.model.remat.remat_policy`), trading compute for activation memory.
        """
        metadata = self.attention_metadata(segment_ids)
        if self.cfg.scan_layers:
            return self._scanned(x, positions, segment_ids, metadata, dropout_key)
        run = remat_block(self.cfg.remat, tuple(self.cfg.remat_names))
        freqs = self.rope_freqs()
        for i, (block, key) in enumerate(zip(self.blocks, _keys(dropout_key, len(self.blocks)))):
            x = run(block, x, positions, segment_ids, freqs[i], self.cfg.window_of(i), metadata and metadata[i], key)
        return x

    def rope_freqs(self) -> jax.Array:
        """Each layer's RoPE frequencies [n_layers, head_dim / 2] (Gemma 3's sliding layers have their own base)."""
        return jnp.stack([rope_frequencies(self.cfg.head_dim, *self.cfg.rope_of(i)) for i in range(self.cfg.n_layers)])

    def windows(self) -> jax.Array | None:
        """Each layer's window [n_layers] (FULL: the whole segment), or None when no layer slides."""
        if not self.cfg.has_windows:
            return None
        return jnp.asarray([self.cfg.window_of(i) or FULL for i in range(self.cfg.n_layers)], jnp.int32)

    def _scanned(self, x, positions, segment_ids, metadata, dropout_key):
        """The stacked blocks under ``jax.lax.scan``: one block's body traced and compiled, whatever the depth.

        Each step merges layer ``i``'s slice of the stacked state into a Block and
        runs it (rematerialized as ``model.remat`` says); its dropout key is the
        ``i``-th of the same split the unrolled loop uses, so both give the same numbers.
        """
        graphdef, state = nnx.split(self.blocks)

        def layer(carry, xs):
            layer_state, key, rope_freq, window, metadata = xs
            block = nnx.merge(graphdef, layer_state)
            return block(carry, positions, segment_ids, rope_freq, window, metadata=metadata, dropout_key=key), None

        if self.cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=remat_policy(self.cfg.remat, tuple(self.cfg.remat_names)))
        keys = None if dropout_key is None else jax.random.split(dropout_key, self.cfg.n_layers)
        # Per-layer settings ride along as scanned inputs: one body serves sliding and full layers alike.
        stacked = None if metadata is None else jax.tree.map(lambda *layers: jnp.stack(layers), *metadata)
        x, _ = jax.lax.scan(layer, x, (state, keys, self.rope_freqs(), self.windows(), stacked))
        return x

    def layer(self, i: int) -> "Block":
        """Block ``i`` as a module, in either layout (a slice of the stacked parameters when scanned)."""
        if not self.cfg.scan_layers:
            return self.blocks[i]
        graphdef, state = nnx.split(self.blocks)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def head(self) -> jax.Array:
        """The LM head [D, V] (the embedding table, transposed, when tied), in its storage dtype."""
        return self.embed.embedding[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head: the last block's output [B, T, D] -> float32 logits [B, T, V]."""
        x = self.final_norm(x)
        return head_logits(x, self.head().astype(x.dtype))

    def attention_metadata(self, segment_ids) -> list | None:
        """The pallas kernel's block ranges for this batch, one per layer, or None for the other backends.

        They depend only on the segment ids and the layer's window, so they are computed once per forward for
        each distinct window (at most two: Gemma 3's sliding and global layers) and handed to every layer
        (explicitly, rather than trusting XLA to merge per-layer copies across remat or scan boundaries).
        """
        backend = resolve_backend(self.cfg.attention, self.cfg.compute_dtype, windows=self.cfg.has_windows)
        if backend not in TILED:
            return None
        blocks = MOSAIC_BLOCKS if backend == "pallas_mosaic" else BlockSizes.for_head_dim(self.cfg.head_dim)
        windows = [self.cfg.window_of(i) for i in range(self.cfg.n_layers)]
        by_window = {w: block_metadata(segment_ids, blocks, w) for w in dict.fromkeys(windows)}
        return [by_window[w] for w in windows]

    def check_batch(self, inputs, positions, segment_ids) -> None:
        """Shape checks at trace time; value checks only when the inputs are concrete (no device sync under jit)."""
        shape = jnp.shape(inputs)
        if len(shape) != 2:
            raise ValueError(f"inputs has shape {shape}, expected [batch, seq_len]")
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if jnp.shape(arr) != shape:
                raise ValueError(f"{name} has shape {jnp.shape(arr)}, expected {shape} (the shape of inputs)")
        for name, arr in (("inputs", inputs), ("positions", positions), ("segment_ids", segment_ids)):
            if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
                raise ValueError(f"{name} has dtype {jnp.result_type(arr)}, expected an integer type")
        if shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if not isinstance(inputs, jax.core.Tracer):
            ids = np.asarray(inputs)
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})"
                                 f" ({bad.size} such ids in inputs)")


def build_model(config: Config | ModelConfig, vocab_size: int | None = None, *, rngs: nnx.Rngs) -> TransformerLM:
    """A TransformerLM from a loaded Config (or its ModelConfig) in one call.

    ``vocab_size`` (usually the tokenizer's) fills ``model.vocab_size`` when that
    is null and overrides it otherwise.
    """
    cfg = config.model if isinstance(config, Config) else config
    if isinstance(config, Config) and cfg.max_seq_len is None:  # null: follows the sequences the config feeds it
        cfg = dataclasses.replace(cfg, max_seq_len=config.max_seq_len)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return TransformerLM(cfg, rngs=rngs)


def param_count(model: TransformerLM) -> dict[str, int]:
    """Parameters: total, embedding (token table, plus the LM head when untied) and non_embedding."""
    sizes = {
        ".".join(map(str, path)): int(np.prod(v.shape)) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    embedding = sum(n for name, n in sizes.items() if name.startswith(("embed.", "lm_head")))
    total = sum(sizes.values())
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}
