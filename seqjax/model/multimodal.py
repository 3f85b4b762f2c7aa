"""Qwen3-VL: the vision tower's image tokens in place of the text's image-pad tokens, multimodal RoPE, and
DeepStack's features added after the first blocks, over rows packed with segment ids.

One forward pass, for rows of B x T tokens and a stream of P patches (every image of the batch)::

    x = embed(inputs)                                   [B, T, D]
    tokens, deep = tower(patches, ...)                  [P / 4, D], [k, P / 4, D]
    x[image_index >= 0] = tokens[image_index]           the i-th image token of the batch (row-major) is tokens[i]
    blocks 0 .. n-1, rotary positions per frequency from positions_3d [B, T, 3]; after block i < k, add deep[i]
    at the image tokens
    logits = head(final_norm(x))                        [B, T, V]

``positions_3d`` are each example's own (:func:`seqjax.store.images.rope_index`, counted from 0 at its first
token), so a packed example is rotated as it is alone; the causal mask is the one mask over the text's segment
ids, and the tower's mask keeps each image to itself. The text model is a :class:`TransformerLM` as it is (a
Qwen3 row of the family table), not a copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.model.rope import mrope_axes, mrope_positions
from seqjax.model.transformer import TransformerLM
from seqjax.model.vision import VisionTower


class VisionLanguageModel(nnx.Module):

    def __init__(self, lm: TransformerLM, tower: VisionTower, mrope_section: tuple[int, int, int],
                 interleaved: bool = True):
        self.lm, self.tower = lm, tower
        self.axes = tuple(int(a) for a in mrope_axes(lm.cfg.head_dim // 2, tuple(mrope_section), interleaved))

    def __call__(self, inputs: jax.Array, *, segment_ids: jax.Array, positions_3d: jax.Array,
                 image_index: jax.Array, patches: jax.Array, patch_segment_ids: jax.Array, rows: jax.Array,
                 columns: jax.Array, table_index: jax.Array, table_weight: jax.Array) -> jax.Array:
        """float32 logits [B, T, V]. ``image_index`` [B, T]: which image token (of the tower's output) each
        image-pad token takes, -1 on text; the patch fields are :func:`seqjax.store.images.patch_inputs`'."""
        tokens, deep = self.tower(patches, patch_segment_ids, rows, columns, table_index, table_weight)
        x = self.lm.embed_tokens(inputs)
        is_image = (image_index >= 0)[..., None]
        where = jnp.maximum(image_index, 0)
        x = jnp.where(is_image, tokens[where].astype(x.dtype), x)
        injections = jnp.where(is_image[None], deep[:, where], 0.0) if deep.shape[0] else None
        positions = mrope_positions(positions_3d, self.axes)
        return self.lm.logits(self.lm.hidden(x, positions=positions, segment_ids=segment_ids,
                                             injections=injections))
