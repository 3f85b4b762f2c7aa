"""Qwen3-VL: the vision tower's image tokens in place of the text's image-pad tokens, multimodal
RoPE, and DeepStack's features added after the first blocks, over rows packed with segment ids.

One forward pass, for B rows of T tokens, each row with its own P patches (its images, packed in one
stream)::

    x = embed(inputs)                                   [B, T, D]
    tokens, deep = tower(patches) per row               [B, P / 4, D], [k, B, P / 4, D]
    x[b, t] = tokens[b, image_index[b, t]]              where image_index >= 0: the row's i-th image token
    blocks 0 .. n-1, rotary positions per frequency from positions_3d [B, T, 3]; after block i < k, add
    deep[i] at the image tokens
    logits = head(final_norm(x))                        [B, T, V]

Every image field has the rows as its leading axis (the batch contract's rule, docs/design.md), so
micro-batches, process slices and a mesh's data shards cut images with the rows that read them:
nothing crosses rows. ``positions_3d`` are each example's own
(:func:`seqjax.store.images.rope_index`, counted from 0 at its first token), so a packed example is
rotated as it is alone; the causal mask is the one mask over the text's segment ids, and the tower's
keeps each image to itself. The text model is a :class:`TransformerLM` as it is (a Qwen3 row of the
family table), not a copy: LoRA, scan, remat and the chunked loss are its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.model.head import head_logits
from seqjax.model.rope import mrope_axes, mrope_positions
from seqjax.model.transformer import TransformerLM
from seqjax.model.vision import VisionTower


class VisionLanguageModel(nnx.Module):

    def __init__(self, lm: TransformerLM, tower: VisionTower, mrope_section: tuple[int, int, int],
                 interleaved: bool = True):
        if lm.cfg.dropout or lm.cfg.token_dropout:
            raise ValueError(f"model.dropout={lm.cfg.dropout}, model.token_dropout={lm.cfg.token_dropout}: "
                             "a vision-language model trains without dropout here; expected 0")
        self.lm, self.tower = lm, tower
        self.axes = tuple(int(a) for a in mrope_axes(lm.cfg.head_dim // 2, tuple(mrope_section), interleaved))

    @property
    def cfg(self):
        """The language model's config (what the objectives read: ``loss_chunk_tokens``)."""
        return self.lm.cfg

    def __call__(self, inputs: jax.Array, **fields) -> jax.Array:
        """float32 logits [B, T, V]; ``fields`` as :meth:`features_and_head`'s."""
        return head_logits(*self.features_and_head(inputs, **fields))

    def features_and_head(self, inputs: jax.Array, *, positions: jax.Array, segment_ids: jax.Array,
                          positions_3d: jax.Array, image_index: jax.Array, patches: jax.Array,
                          patch_segment_ids: jax.Array, patch_rows: jax.Array, patch_columns: jax.Array,
                          patch_heights: jax.Array, patch_widths: jax.Array,
                          dropout_key: jax.Array | None = None,
                          prefix_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(final-normed features [B, T, D], head [D, V]). ``image_index`` [B, T]: which of its
        row's image tokens each image-pad token takes, -1 on text; ``patches`` [B, P, patch_dim] and
        the patch fields [B, P] are :func:`seqjax.data.image_rows.image_batch`'s. ``positions``
        (1-D) are unused: the rows rotate by ``positions_3d``."""
        del positions, dropout_key  # no dropout (refused at construction)
        if prefix_ids is not None:
            raise ValueError("prefix_ids (a shared prompt) with images: expected data.shared_prompt=false")
        self.lm.check_batch(inputs, positions_3d[..., 0], segment_ids)
        tokens, deep = jax.vmap(self.tower)(patches, patch_segment_ids, patch_rows, patch_columns,
                                            patch_heights, patch_widths)  # per row
        x = self.lm.embed_tokens(inputs)
        is_image = (image_index >= 0)[..., None]
        where = jnp.maximum(image_index, 0)[..., None]  # [B, T, 1]
        picked = jnp.take_along_axis(tokens, where, axis=1)  # [B, T, D]
        x = jnp.where(is_image, picked.astype(x.dtype), x)
        injections = None
        if deep.shape[1]:  # deep [B, k, P / 4, D] -> [k, B, T, D], zero on text
            deep = jnp.moveaxis(deep, 1, 0)
            injections = jnp.where(is_image[None], jnp.take_along_axis(deep, where[None], axis=2), 0.0)
        x = self.lm.hidden(x, positions=mrope_positions(positions_3d, self.axes), segment_ids=segment_ids,
                           injections=injections)
        x = self.lm.final_norm(x)
        return x, self.lm.head().astype(x.dtype)
