"""The decoder-only Transformer LM (Flax NNX): pre-norm blocks, RMSNorm, RoPE, grouped-query
attention, SwiGLU.

Packing is what this model is careful about: RoPE reads the batch's
``positions`` (0 at each segment's first token) and every attention call gets
``segment_ids``, so a token in a packed row sees exactly what it would see if
its document ran alone (tests/test_model.py proves it).

The blocks, their parameters (names, shapes, logical axes), dropout and
initialization are :mod:`seqjax.model.block`; this module puts them together:
embeddings, ``n_layers`` blocks (unrolled, or stacked under ``jax.lax.scan``
with ``model.scan_layers``), the final norm and the LM head.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.fields import hashable
from seqjax.config.tree import Config, ModelConfig
from seqjax.model.attention import TILED, resolve_backend
from seqjax.model.block import Block, RMSNorm, drop, normal_param, split_keys, stacked_blocks, unrolled_blocks
from seqjax.model.cache import Cache
from seqjax.model.context import split_row
from seqjax.model.experts import RouterTerms
from seqjax.model.head import head_logits
from seqjax.model.kernels.block_ranges import MOSAIC_BLOCKS, BlockSizes, block_metadata  # plain JAX
from seqjax.model.mask import FULL
from seqjax.model.multimodal import IMAGE_FIELDS, with_images
from seqjax.model.remat import remat_block, remat_policy
from seqjax.model.rope import mrope_axes, mrope_positions, rope_frequencies
from seqjax.model.vision import VisionTower


class _HashableModelConfig(ModelConfig):
    """The model's config, hashable so it can sit in the static graph definition that jit keys
    on."""

    def __hash__(self) -> int:
        return hash(hashable(dataclasses.astuple(self)))

    @classmethod
    def of(cls, cfg: ModelConfig) -> "_HashableModelConfig":
        """A copy of ``cfg`` (field by field, so the rope_scaling section stays a dataclass)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


class TransformerLM(nnx.Module):
    """Decoder-only LM. ``model(inputs, positions=..., segment_ids=...)`` -> float32 logits [B, T,
    V].

    inputs, positions, segment_ids: int [B, T] (contract 1). Shape errors
    (mismatched fields, T > max_seq_len) raise at trace time. Token ids outside
    [0, vocab_size) raise ValueError when ``inputs`` is concrete (an eager
    call); under jit they cannot be checked for free, so the embedding lookup
    turns them into NaN instead of a silently clamped row.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size is null: pass vocab_size (the tokenizer's) to build_model")
        if cfg.max_seq_len is None:
            raise ValueError(
                "model.max_seq_len is null: build the model with build_model(config), which resolves it"
            )
        cfg = _HashableModelConfig.of(cfg)
        cfg.check()
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=pdt,
                               embedding_init=nnx.initializers.normal(cfg.init_std), rngs=rngs)
        self.embed.embedding.set_metadata(axes=("vocab", "embed"))
        self.embed_dropout = nnx.Dropout(cfg.dropout)
        # one draw per token: [B, T, 1]
        self.token_dropout = nnx.Dropout(cfg.token_dropout, broadcast_dims=(-1,))
        self.blocks = stacked_blocks(cfg, rngs) if cfg.scan_layers else unrolled_blocks(cfg, rngs)
        self.final_norm = RMSNorm(cfg.d_model, dtype=pdt, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one)
        self.lm_head = None if cfg.tie_embeddings else normal_param(
            rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, pdt, ("embed", "vocab"))
        # Qwen3-VL: the tower (float32 parameters whatever param_dtype) and which rotary frequencies
        # turn with the time, row and column positions
        self.vision = VisionTower(cfg.vision, rngs) if cfg.vision.depth else None
        self.mrope_axes = tuple(int(a) for a in mrope_axes(
            cfg.rotary_dim // 2, tuple(cfg.mrope_section), cfg.mrope_interleaved)) if cfg.mrope_section else None

    def __call__(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                 dropout_key: jax.Array | None = None, prefix_ids: jax.Array | None = None,
                 **images: jax.Array) -> jax.Array:
        """Logits [B, T, V] float32 for a batch (contract 1): the training and evaluation forward
        pass.

        ``dropout_key``: the training step's key, which turns dropout on; None (evaluation) is
        deterministic. ``prefix_ids``: the batch's optional field of that name (a shared prompt that
        preference completions also attend to; :mod:`seqjax.model.mask`). ``images``: the batch's
        image fields, for a model with a vision tower (:meth:`features_and_head`).
        """
        return head_logits(*self.features_and_head(inputs, positions=positions, segment_ids=segment_ids,
                                                   dropout_key=dropout_key, prefix_ids=prefix_ids, **images))

    def features_and_head(self, inputs: jax.Array, **kwargs) -> tuple[jax.Array, jax.Array]:
        """:meth:`forward` without its side terms: (features [B, T, D], head [D, V])."""
        features, head, _ = self.forward(inputs, **kwargs)
        return features, head

    def forward(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                dropout_key: jax.Array | None = None, prefix_ids: jax.Array | None = None,
                positions_3d: jax.Array | None = None, **images: jax.Array):
        """The forward pass up to the LM head: (final-normed features [B, T, D], head [D, V], both
        compute dtype; the side terms: the routers' statistics per layer, a
        :class:`~seqjax.model.experts.RouterTerms` of [n_layers, ...] arrays for a model with experts, else
        None). The objectives take the side terms from this one forward (the router's losses).

        ``model.loss_chunk_tokens`` takes the loss from here (seqjax.model.loss.chunked_lm_loss), so
        the whole logits are never built. With a vision tower, ``positions_3d`` [B, T, 3] rotate the
        rows (a text-only batch, without them, turns every axis with ``positions``, as Qwen3-VL
        does) and ``images`` (:data:`seqjax.model.multimodal.IMAGE_FIELDS`) put the images in
        (:func:`seqjax.model.multimodal.with_images`).
        """
        self.check_batch(inputs, positions, segment_ids)
        token_key, embed_key, blocks_key = split_keys(dropout_key, 3)
        x = drop(self.embed_dropout, drop(self.token_dropout, self.embed_tokens(inputs), token_key),
                 embed_key)
        x, rotary, injections = self.with_images(x, positions, positions_3d, images, prefix_ids)
        x, terms = self.hidden(x, positions=rotary, segment_ids=segment_ids, dropout_key=blocks_key,
                               prefix_ids=prefix_ids, injections=injections, terms=True)
        x = self.final_norm(x)
        return x, self.head().astype(x.dtype), terms

    def with_images(self, x: jax.Array, positions: jax.Array, positions_3d: jax.Array | None,
                    images: dict[str, jax.Array], prefix_ids: jax.Array | None = None):
        """(embeddings x with the images in, the positions the blocks rotate by, DeepStack's
        additions or None). Without image fields: (x, ``positions``, None). Image fields without a
        tower, without their 3-D positions, with a shared prompt or missing one are refused (trace
        time, one line)."""
        if images and self.vision is None:
            raise ValueError(f"the batch has image fields ({', '.join(sorted(images))}) but the model has no "
                             "vision tower (model.vision.depth 0)")
        if bool(images) != (positions_3d is not None):
            raise ValueError("positions_3d and the image fields go together: expected both or neither")
        if not images:
            return x, positions, None
        if prefix_ids is not None:
            raise ValueError("prefix_ids (a shared prompt) with images: expected data.shared_prompt=false")
        if sorted(images) != sorted(IMAGE_FIELDS):
            raise ValueError(f"image fields: got {sorted(images)}, expected {sorted(IMAGE_FIELDS)} (and positions_3d)")
        x, injections = with_images(self.vision, x, **images)
        return x, mrope_positions(positions_3d, self.mrope_axes), injections

    def decode(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array, cache: Cache,
               positions_3d: jax.Array | None = None, **images: jax.Array) -> tuple[jax.Array, Cache]:
        """The last block's output [B, T, D] (before the final norm: :meth:`logits` maps the rows a
        caller needs) for ``inputs`` run through ``cache``, and the cache after them
        (seqjax.model.cache: each layer's keys and values written, then attended over).

        A packed prefill passes the prompts, a decode step one token per row (T = 1); seqjax.engine
        drives both. A prompt with images passes ``positions_3d`` and the image fields as
        :meth:`features_and_head` takes them; the tokens after it rotate by one position on every
        axis, as Qwen3-VL's text does.
        """
        self.check_batch(inputs, positions, segment_ids)
        x, rotary, injections = self.with_images(self.embed_tokens(inputs), positions, positions_3d, images)
        if self.cfg.scan_layers and injections is None and cache.scannable:
            x, cache = self._scanned_decode(x, rotary, segment_ids, cache)
        else:
            freqs = self.rope_freqs()
            for i in range(self.cfg.n_layers):
                view = cache.view(i, segment_ids)
                x, view = self.layer(i).decode(x, rotary, segment_ids, view, freqs[i],
                                               self.cfg.window_of(i))
                if injections is not None and i < len(injections):
                    x = x + injections[i].astype(x.dtype)
                cache = cache.put(i, view)
        return x, cache.advanced(segment_ids)

    def _scanned_decode(self, x, rotary, segment_ids, cache: Cache) -> tuple[jax.Array, Cache]:
        """:meth:`decode`'s blocks as one ``lax.scan`` over the stacked blocks
        (``model.scan_layers``), the cache in its carry: one block's body traced and compiled
        whatever the depth, each layer's window and RoPE frequencies scanned inputs as in training
        (:meth:`_scanned`)."""
        graphdef, state = nnx.split(self.blocks)

        def layer(carry, xs):
            x, cache = carry
            layer_state, rope_freq, window, i = xs
            block = nnx.merge(graphdef, layer_state)
            view = cache.view(i, segment_ids)
            x, view = block.decode(x, rotary, segment_ids, view, rope_freq, window)
            return (x, cache.put(i, view)), None

        layers = jnp.arange(self.cfg.n_layers, dtype=jnp.int32)
        xs = (state, self.rope_freqs(), self.windows(), layers)
        (x, cache), _ = jax.lax.scan(layer, (x, cache), xs)
        return x, cache

    def embed_tokens(self, inputs) -> jax.Array:
        """Token ids [B, T] -> embeddings [B, T, D] in the compute dtype; out-of-range ids give NaN
        rows."""
        v = self.cfg.vocab_size
        # v is out of bounds -> filled with NaN
        ids = jnp.where((inputs >= 0) & (inputs < v), inputs, v)
        table = self.embed.embedding[...]
        x = jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
        # Gemma: sqrt(d_model), rounded to the table's dtype as transformers does
        if self.cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), table.dtype)
        return x.astype(self.cfg.compute_dtype)

    def from_embeddings(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                        dropout_key: jax.Array | None = None) -> jax.Array:
        """The blocks and head applied to embeddings x [B, T, D] (the input of the first block);
        logits [B, T, V]."""
        return self.logits(
            self.hidden(x, positions=positions, segment_ids=segment_ids, dropout_key=dropout_key))

    def hidden(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
               dropout_key: jax.Array | None = None, prefix_ids: jax.Array | None = None,
               injections: jax.Array | None = None, terms: bool = False):
        """The blocks on embeddings x [B, T, D]: the last block's output [B, T, D], before the final
        norm.

        Under ``model.remat`` each block is one rematerialized unit: its backward pass recomputes
        what the policy does not keep (:func:`seqjax.model.remat.remat_policy`), trading compute for
        activation memory. ``injections`` [k, B, T, D]: added to the output of the first k blocks
        (Qwen3-VL's DeepStack features, zero away from image tokens). ``terms``: (x, the side terms
        :meth:`forward` returns).
        """
        split = split_row(x, self.cfg.context_attention, self.split_row_kernel(prefix_ids))
        if split is not None:  # a row over the context axis: one order change in, one out
            x, positions, segment_ids, prefix_ids, injections = split.balance(x, positions, segment_ids,
                                                                              prefix_ids, injections)
            x, side = self._blocks(x, positions, segment_ids, [split] * self.cfg.n_layers, dropout_key, prefix_ids,
                                   injections)
            x = split.restore(x)
        else:
            x, side = self._blocks(x, positions, segment_ids, self.attention_metadata(segment_ids, prefix_ids),
                                   dropout_key, prefix_ids, injections)
        return (x, side) if terms else x

    def _blocks(self, x, positions, segment_ids, metadata, dropout_key, prefix_ids, injections) -> jax.Array:
        """Every block in turn, unrolled or scanned; ``metadata``: each layer's (see :meth:`hidden`)."""
        if self.cfg.scan_layers:
            return self._scanned(x, positions, segment_ids, metadata, dropout_key, prefix_ids, injections)
        run = remat_block(self.cfg.remat, tuple(self.cfg.remat_names))
        freqs = self.rope_freqs()
        sides = []
        for i, (block, key) in enumerate(zip(self.blocks, split_keys(dropout_key, len(self.blocks)))):
            layer_metadata = metadata and metadata[i]
            x, side = run(block, x, positions, segment_ids, freqs[i], self.cfg.window_of(i), layer_metadata, key,
                          prefix_ids)
            sides.append(side)
            if injections is not None and i < len(injections):
                x = x + injections[i].astype(x.dtype)
        return x, self._stacked_terms(sides)

    def _stacked_terms(self, sides: list) -> RouterTerms | None:
        """The layers' router terms stacked [n_layers, ...] (a gated layer's zero), or None without experts."""
        if not self.cfg.experts.enabled:
            return None
        zero = RouterTerms.zeros(self.cfg.experts.count)
        return jax.tree.map(lambda *layers: jnp.stack(layers), *[zero if s is None else s for s in sides])

    def rope_freqs(self) -> jax.Array:
        """Each layer's RoPE frequencies [n_layers, rotary_dim / 2] (Gemma 3's sliding layers have
        their own base)."""
        return jnp.stack([
            rope_frequencies(self.cfg.rotary_dim, *self.cfg.rope_of(i))
            for i in range(self.cfg.n_layers)
        ])

    def windows(self) -> jax.Array | None:
        """Each layer's window [n_layers] (FULL: the whole segment), or None when no layer
        slides."""
        if not self.cfg.has_windows:
            return None
        return jnp.asarray([self.cfg.window_of(i) or FULL for i in range(self.cfg.n_layers)], jnp.int32)

    def _scanned(self, x, positions, segment_ids, metadata, dropout_key, prefix_ids=None, injections=None):
        """The stacked blocks under ``jax.lax.scan``: one block's body traced and compiled, whatever
        the depth.

        Each step merges layer ``i``'s slice of the stacked state into a Block and runs it
        (rematerialized as ``model.remat`` says); its dropout key is the ``i``-th of the same split
        the unrolled loop uses, so both give the same numbers. With ``injections`` [k, B, T, D] the
        first k layers are one scan that adds layer i's after it, the rest another: two bodies,
        nothing added to the layers that take none.
        """
        graphdef, state = nnx.split(self.blocks)

        def layer(carry, xs):
            layer_state, key, rope_freq, window, metadata, extra = xs
            block = nnx.merge(graphdef, layer_state)
            out, side = block(carry, positions, segment_ids, rope_freq, window, metadata=metadata, dropout_key=key,
                              prefix_ids=prefix_ids)
            return (out if extra is None else out + extra.astype(out.dtype)), side

        if self.cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=remat_policy(self.cfg.remat,
                                                              tuple(self.cfg.remat_names)))
        keys = None if dropout_key is None else jax.random.split(dropout_key, self.cfg.n_layers)
        # Per-layer settings ride along as scanned inputs: one body serves sliding and full layers
        # alike.
        stacked = None if metadata is None else jax.tree.map(lambda *layers: jnp.stack(layers), *
                                                             metadata)
        xs = (state, keys, self.rope_freqs(), self.windows(), stacked)
        k = 0 if injections is None else len(injections)
        sides = []
        if k:
            x, side = jax.lax.scan(layer, x, (*jax.tree.map(lambda a: a[:k], xs), injections))
            sides.append(side)
        if k < self.cfg.n_layers:
            x, side = jax.lax.scan(layer, x, (*jax.tree.map(lambda a: a[k:], xs), None))
            sides.append(side)
        if any(side is None for side in sides):
            return x, None
        return x, jax.tree.map(lambda *parts: jnp.concatenate(parts), *sides)

    def layer(self, i: int) -> "Block":
        """Block ``i`` as a module, in either layout (a slice of the stacked parameters when
        scanned)."""
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

    def split_row_kernel(self, prefix_ids=None) -> str:
        """What attends a row split over mesh.context: the backend ``model.attention`` resolves to,
        except that ``auto`` keeps to xla for a shared prompt (only the dense mask honours it)."""
        if prefix_ids is not None and self.cfg.attention == "auto":
            return "xla"
        return resolve_backend(self.cfg.attention, self.cfg.compute_dtype, windows=self.cfg.has_windows)

    def attention_metadata(self, segment_ids, prefix_ids=None) -> list | None:
        """The pallas kernel's block ranges for this batch, one per layer, or None for the other
        backends.

        They depend only on the segment ids and the layer's window, so they are computed once per
        forward for each distinct window (at most two: Gemma 3's sliding and global layers) and
        handed to every layer (explicitly, rather than trusting XLA to merge per-layer copies across
        remat or scan boundaries). Under a shared prompt (``prefix_ids``) only the flash kernel
        without windows has ranges for it (a prompt's range beside each block's own); the other
        cases run the dense mask (:func:`seqjax.model.attention.attention`).
        """
        backend = resolve_backend(self.cfg.attention, self.cfg.compute_dtype,
                                  windows=self.cfg.has_windows)
        if prefix_ids is not None:
            if backend != "pallas" or self.cfg.has_windows:
                return None
            shared = block_metadata(segment_ids, BlockSizes.for_head_dim(self.cfg.head_dim),
                                    prefix_ids=prefix_ids)
            return [shared] * self.cfg.n_layers
        if backend not in TILED:
            return None
        blocks = MOSAIC_BLOCKS if backend == "pallas_mosaic" else BlockSizes.for_head_dim(
            self.cfg.head_dim)
        windows = [self.cfg.window_of(i) for i in range(self.cfg.n_layers)]
        by_window = {w: block_metadata(segment_ids, blocks, w) for w in dict.fromkeys(windows)}
        return [by_window[w] for w in windows]

    def check_batch(self, inputs, positions, segment_ids) -> None:
        """Shape checks at trace time; value checks only when the inputs are concrete (no device
        sync under jit)."""
        shape = jnp.shape(inputs)
        if len(shape) != 2:
            raise ValueError(f"inputs has shape {shape}, expected [batch, seq_len]")
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if jnp.shape(arr) != shape:
                raise ValueError(
                    f"{name} has shape {jnp.shape(arr)}, expected {shape} (the shape of inputs)")
        for name, arr in (("inputs", inputs), ("positions", positions), ("segment_ids", segment_ids)):
            if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
                raise ValueError(f"{name} has dtype {jnp.result_type(arr)}, expected an integer type")
        if shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if not isinstance(inputs, jax.core.Tracer):
            ids = np.asarray(inputs)
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
            if bad.size:
                raise ValueError(
                    f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})"
                    f" ({bad.size} such ids in inputs)")


def build_model(config: Config | ModelConfig, vocab_size: int | None = None, *,
                rngs: nnx.Rngs) -> TransformerLM:
    """A TransformerLM from a loaded Config (or its ModelConfig) in one call.

    ``vocab_size`` (usually the tokenizer's) fills ``model.vocab_size`` when that
    is null and overrides it otherwise.
    """
    cfg = config.model if isinstance(config, Config) else config
    # null: follows the sequences the config feeds it
    if isinstance(config, Config) and cfg.max_seq_len is None:
        cfg = dataclasses.replace(cfg, max_seq_len=config.max_seq_len)
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    use_matmul_precision(cfg)
    return TransformerLM(cfg, rngs=rngs)


def use_matmul_precision(cfg: ModelConfig) -> None:
    """``model.matmul_precision`` for every matmul this process traces from now on (the model's, the loss
    head's, their gradients', decoding's): JAX's default precision, set process-wide where a model
    is built. ``default`` leaves JAX's own setting as it is (``JAX_DEFAULT_MATMUL_PRECISION``, if
    set, still wins)."""
    if cfg.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", cfg.matmul_precision)


def param_count(model: TransformerLM) -> dict[str, int]:
    """Parameters: total, embedding (token table, plus the LM head when untied) and
    non_embedding."""
    sizes = {
        ".".join(map(str, path)): int(np.prod(v.shape))
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    embedding = sum(n for name, n in sizes.items() if name.startswith(("embed.", "lm_head")))
    total = sum(sizes.values())
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}
