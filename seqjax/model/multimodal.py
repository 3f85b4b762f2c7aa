"""Qwen3-VL's images in a packed row: the vision tower's tokens in place of the text's image-pad
tokens, and DeepStack's features for the first blocks.
:class:`seqjax.model.transformer.TransformerLM` calls :func:`with_images` when its config has a
tower (``model.vision``); the rest of the forward pass is the text model's, so LoRA, scan, remat and
the chunked loss are its own.

One forward pass, for B rows of T tokens, each row with its own P patches (its images, packed in one
stream)::

    x = embed(inputs)                                   [B, T, D]
    tokens, deep = tower(patches) per row               [B, P / 4, D], [k, B, P / 4, D]
    x[b, t] = tokens[b, image_index[b, t]]              where image_index >= 0: the row's i-th image token
    blocks 0 .. n-1, rotary positions per frequency from positions_3d [B, T, 3]; after block i < k,
    add deep[i] at the image tokens
    logits = head(final_norm(x))                        [B, T, V]

Every image field has the rows as its leading axis (the batch contract's rule, docs/design.md), so
micro-batches, process slices and a mesh's data shards cut images with the rows that read them:
nothing crosses rows. ``positions_3d`` are each example's own
(:func:`seqjax.store.images.rope_index`, counted from 0 at its first token), so a packed example is
rotated as it is alone; the causal mask is the one mask over the text's segment ids, and the tower's
keeps each image to itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqjax.model.vision import VisionTower

# The batch fields a tower reads (seqjax.data.contract.OPTIONAL_FIELDS lists them with their
# shapes).
IMAGE_FIELDS = ("image_index", "patches", "patch_segment_ids", "patch_rows", "patch_columns", "patch_heights",
                "patch_widths")


def with_images(tower: VisionTower, x: jax.Array, image_index: jax.Array, patches: jax.Array,
                patch_segment_ids: jax.Array, patch_rows: jax.Array, patch_columns: jax.Array,
                patch_heights: jax.Array, patch_widths: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(x [B, T, D] with each image-pad token's embedding replaced by its image token, DeepStack's
    additions [k, B, T, D], zero on text, or None without DeepStack). ``image_index`` [B, T]: which
    of its row's image tokens each image-pad token takes, -1 on text; ``patches`` [B, P, patch_dim]
    and the patch fields [B, P] are :func:`seqjax.data.image_rows.image_batch`'s."""
    tokens, deep = jax.vmap(tower)(patches, patch_segment_ids, patch_rows, patch_columns, patch_heights,
                                   patch_widths)  # per row
    is_image = (image_index >= 0)[..., None]
    where = jnp.maximum(image_index, 0)[..., None]  # [B, T, 1]
    picked = jnp.take_along_axis(tokens, where, axis=1)  # [B, T, D]
    x = jnp.where(is_image, picked.astype(x.dtype), x)
    if not deep.shape[1]:
        return x, None
    deep = jnp.moveaxis(deep, 1, 0)  # [B, k, P / 4, D] -> [k, B, P / 4, D]
    return x, jnp.where(is_image[None], jnp.take_along_axis(deep, where[None], axis=2), 0.0)
