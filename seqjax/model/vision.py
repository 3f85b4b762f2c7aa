"""The vision encoder of Qwen3-VL and Qwen2.5-VL (Flax NNX) over a packed stream of patches: every
image of a batch row in one sequence, each its own segment. The two are settings of this one tower
(:class:`seqjax.config.vision.VisionConfig`):

    setting          Qwen3-VL                       Qwen2.5-VL
    norm             layer_norm                     rms_norm
    gated_mlp        no: fc2(act(fc1(x)))           yes: down(act(gate(x)) * up(x)), act silu
    patch_bias       yes                            no
    positions        learned table + 2-D rotary     2-D rotary only (num_position_embeddings 0)
    window_size      0                              windows of window_size pixels, except fullatt_block_indexes
    deepstack        deepstack_visual_indexes       none

Shapes (P patches in the stream, D hidden_size, F intermediate_size, m spatial merge size, O
out_hidden_size)::

    patches [P, 3 * t * p * p]  --patch_embed-->  [P, D]  + learned positions (bilinear from a square table)
    depth x block:  x + attn(norm1(x)),  x + mlp(norm2(x))        2-D rotary positions (row, column)
    merger:         norm, then m * m neighbours as one [P / m^2, m^2 D] row -> fc1 -> gelu -> fc2 -> [P / m^2, O]
    deepstack:      after the blocks in ``deepstack_visual_indexes``, a merger (norm after the regrouping) each

Qwen2.5-VL's windows are segments too (:func:`window_segments`): a windowed block's mask is the same
non-causal mask over ids that give every (image, window) pair its own segment. transformers instead
reorders the patches window by window, runs variable-length attention over ``cu_window_seqlens`` and
restores the order after the merger; attention does not depend on the order of its keys, and the
merger's groups of m * m patches stay whole either way, so both compute the same thing, and here no
patch moves.

Attention is the one mask (:func:`seqjax.model.mask.segment_mask`) in its non-causal form: a patch
sees every patch of its image and none of another's; padding patches (segment 0) see nothing and
give zeros. transformers runs the same thing as variable-length attention over ``cu_seqlens``; here
the boundaries are the segment ids, so packing images changes nothing an image computes
(tests/test_vision_tower.py).

Host-side inputs (:func:`seqjax.store.images.patch_inputs`): each patch's image (segment id), its
row and column in its image's grid, and that grid's height and width. The learned position of a
patch is the square table resampled bilinearly to its image's grid, corners aligned
(:func:`table_taps`: transformers' ``fast_pos_embed_interpolate``, in float32 as it computes it). A
shortcut admitted on the default backend (``model.vision.attention: xla``): the dense [P, P] mask is
built in full, fine for the thousands of patches of a fine-tuning batch, not for video; ``pallas``
visits only each image's (or window's) tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.config.vision import VisionConfig
from seqjax.model.attention import attention, masked_attention
from seqjax.model.kernels.block_ranges import BlockMetadata, BlockSizes, block_metadata
from seqjax.model.mask import segment_mask

EPS = 1e-6  # every norm of the encoder
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False), "silu": jax.nn.silu}


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs, dtype, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=jnp.float32, dtype=dtype, rngs=rngs)


def _norm(cfg: VisionConfig, width: int, rngs: nnx.Rngs) -> nnx.LayerNorm | nnx.RMSNorm:
    kind = nnx.RMSNorm if cfg.norm == "rms_norm" else nnx.LayerNorm
    return kind(width, epsilon=EPS, param_dtype=jnp.float32, dtype=jnp.float32, rngs=rngs)


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
    """x [P, H, Dh] rotated by ``angles`` [P, Dh / 2] ("rotate half" layout), in float32."""
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def table_taps(rows: jax.Array, columns: jax.Array, heights: jax.Array, widths: jax.Array,
               side: int) -> tuple[jax.Array, jax.Array]:
    """The four entries of a ``side x side`` table that bilinear resampling (corners aligned) mixes
    for each patch, and their weights: ([P, 4] int32, [P, 4] float32)."""

    def axis(index, size):  # the two taps along one axis and their weights
        source = index.astype(jnp.float32) * jnp.float32(side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
        taps = jnp.floor(source)[:, None] + jnp.arange(2, dtype=jnp.float32)
        weights = jnp.maximum(1 - jnp.abs(source[:, None] - taps), 0)
        return jnp.clip(taps, 0, side - 1).astype(jnp.int32), weights

    r_taps, r_weights = axis(rows, heights)
    c_taps, c_weights = axis(columns, widths)
    index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(-1, 4)
    return index, (r_weights[:, :, None] * c_weights[:, None, :]).reshape(-1, 4)


def window_segments(segment_ids: jax.Array, rows: jax.Array, columns: jax.Array, widths: jax.Array,
                    side: int) -> jax.Array:
    """[P] ids that give every (image, window) pair its own segment, 0 on padding: Qwen2.5-VL's
    windows of ``side`` x ``side`` patches (window_size // patch_size), counted from each image's
    top-left corner, the last ones cut by its edges (transformers' ``get_vision_window_index``).

    An image's patches are contiguous in the stream; its windows are numbered from the index of its
    first patch, and an image has fewer windows than patches, so no two images share an id.
    """
    index = jnp.arange(segment_ids.shape[0])
    starts = segment_ids != jnp.concatenate([jnp.full((1,), -1, segment_ids.dtype), segment_ids[:-1]])
    first = jax.lax.cummax(jnp.where(starts, index, 0))  # each patch's image's first patch
    window = (rows // side) * -(-widths // side) + columns // side
    return jnp.where(segment_ids > 0, first + window + 1, 0)


@dataclasses.dataclass(frozen=True)
class Mask:
    """The non-causal mask of one set of segment ids [P] (images, or Qwen2.5-VL's windows), as the
    tower's backend (``model.vision.attention``) takes it, built once per forward for every block:
    xla the dense [1, P, P] mask; pallas the flash kernel's tile ranges (:func:`block_metadata` with
    ``causal=False``), so a block visits only its images' tiles."""

    ids: jax.Array
    dense: jax.Array | None
    metadata: BlockMetadata | None

    @classmethod
    def of(cls, ids: jax.Array, backend: str, head_dim: int) -> Mask:
        if backend == "pallas":
            return cls(ids, None, block_metadata(ids[None], BlockSizes.for_head_dim(head_dim), causal=False))
        return cls(ids, segment_mask(ids[None], causal=False), None)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """q, k, v [1, P, H, Dh] -> [1, P, H, Dh]."""
        if self.metadata is None:
            return masked_attention(q, k, v, self.dense)
        return attention(q, k, v, self.ids[None], backend="pallas", metadata=self.metadata, causal=False)


class VisionBlock(nnx.Module):

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.heads = cfg.num_heads
        self.act = cfg.hidden_act
        self.norm1, self.norm2 = _norm(cfg, d, rngs), _norm(cfg, d, rngs)
        self.qkv, self.proj = _linear(d, 3 * d, rngs, dtype), _linear(d, d, rngs, dtype)
        self.gated = cfg.gated_mlp
        if cfg.gated_mlp:  # Qwen2.5-VL
            self.gate, self.up, self.down = _linear(d, f, rngs, dtype), _linear(d, f, rngs, dtype), _linear(
                f, d, rngs, dtype)
        else:
            self.fc1, self.fc2 = _linear(d, f, rngs, dtype), _linear(f, d, rngs, dtype)

    def __call__(self, x: jax.Array, angles: jax.Array, mask: Mask) -> jax.Array:
        x = x + self.attend(self.norm1(x), angles, mask)
        return x + self.mlp(self.norm2(x))

    def mlp(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.act]
        if self.gated:
            return self.down(act(self.gate(x)) * self.up(x))
        return self.fc2(act(self.fc1(x)))

    def attend(self, x: jax.Array, angles: jax.Array, mask: Mask) -> jax.Array:
        p = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(p, 3, self.heads, -1), 1, 0)  # each [P, H, Dh]
        q, k = rotate(q, angles), rotate(k, angles)
        out = mask.attend(q[None], k[None], v[None])[0]  # [P, H, Dh]
        return self.proj(out.reshape(p, -1))


class Merger(nnx.Module):
    """``m * m`` neighbouring patches into one token of the language model's width. The final merger
    normalizes each patch first; DeepStack's normalize the regrouped row (``post_shuffle``)."""

    def __init__(self, cfg: VisionConfig, post_shuffle: bool, rngs: nnx.Rngs, dtype=jnp.float32):
        self.group = cfg.spatial_merge_size**2
        wide = cfg.hidden_size * self.group
        self.post_shuffle = post_shuffle
        self.norm = _norm(cfg, wide if post_shuffle else cfg.hidden_size, rngs)
        self.fc1, self.fc2 = _linear(wide, wide, rngs, dtype), _linear(wide, cfg.out_hidden_size, rngs, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = x.shape[0] // self.group
        x = self.norm(x.reshape(rows, -1)) if self.post_shuffle else self.norm(x).reshape(rows, -1)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """Patches in, the language model's image tokens out (and DeepStack's features for its first
    layers)."""

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.patch_embed = _linear(cfg.patch_dim, cfg.hidden_size, rngs, dtype, bias=cfg.patch_bias)
        if cfg.num_position_embeddings:  # Qwen3-VL's learned positions
            self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(),
                                                                (cfg.num_position_embeddings, cfg.hidden_size)))
        self.blocks = nnx.List([VisionBlock(cfg, rngs, dtype) for _ in range(cfg.depth)])
        self.merger = Merger(cfg, False, rngs, dtype)
        self.deepstack = nnx.List([Merger(cfg, True, rngs, dtype) for _ in cfg.deepstack_visual_indexes])

    def __call__(self, patches: jax.Array, segment_ids: jax.Array, rows: jax.Array, columns: jax.Array,
                 heights: jax.Array, widths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """patches [P, patch_dim]; segment_ids, rows, columns, heights, widths [P] int
        (:func:`seqjax.store.images.patch_inputs`).

        Returns (image tokens [P / m^2, O], DeepStack features [len(deepstack_visual_indexes), P /
        m^2, O]).
        """
        x = self.patch_embed(patches)
        if self.cfg.num_position_embeddings:
            table_index, table_weight = table_taps(rows, columns, heights, widths, self.cfg.grid_side)
            x = x + jnp.einsum("pk,pkd->pd", table_weight, self.pos_embed[...][table_index]).astype(x.dtype)
        # rows rotate the first half of each head's pairs, columns the second
        half = self.cfg.head_dim // 2
        inv_freq = 1.0 / (self.cfg.rope_theta**(jnp.arange(0, half, 2, dtype=jnp.float32) / half))
        angles = jnp.concatenate([rows[:, None] * inv_freq, columns[:, None] * inv_freq], axis=-1)
        mask = Mask.of(segment_ids, self.cfg.attention, self.cfg.head_dim)
        windowed = mask  # Qwen2.5-VL's windows: segments of their own
        if self.cfg.window_size:
            windows = window_segments(segment_ids, rows, columns, widths, self.cfg.window_patches)
            windowed = Mask.of(windows, self.cfg.attention, self.cfg.head_dim)
        features = []
        for layer, block in enumerate(self.blocks):
            x = block(x, angles, mask if layer in self.cfg.fullatt_block_indexes else windowed)
            if layer in self.cfg.deepstack_visual_indexes:
                features.append(self.deepstack[self.cfg.deepstack_visual_indexes.index(layer)](x))
        out = self.merger(x)
        stacked = jnp.stack(features) if features else jnp.zeros((0, *out.shape), out.dtype)
        return out, stacked
