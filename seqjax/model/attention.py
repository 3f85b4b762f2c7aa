"""Segment-masked causal attention: the one mask definition (DESIGN.md contract 2) and the reference path.

Query i may attend to key j iff ``segment_ids[i] == segment_ids[j] != 0`` and
``j <= i`` (index order inside a row). Everything that needs the mask (the
reference attention, the kernels' tests, the loss tests) calls
:func:`segment_mask`; nothing else spells it out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array | None = None,
    q_index: jax.Array | None = None,
    kv_index: jax.Array | None = None,
) -> jax.Array:
    """Boolean mask [B, Tq, Tk]: True where query i may attend to key j.

    ``q_index``/``kv_index`` are the row indices of queries and keys ([B, Tq]
    and [B, Tk], or broadcastable); by default queries and keys are the same
    row, indexed 0..T-1. A KV-cache decode step passes the query's row index
    so the same definition serves prefill and decode.
    """
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    tq, tk = q_segment_ids.shape[-1], kv_segment_ids.shape[-1]
    if q_index is None:
        q_index = jnp.arange(tq)[None, :]
    if kv_index is None:
        kv_index = jnp.arange(tk)[None, :]
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    real = q_segment_ids[:, :, None] != 0
    causal = kv_index[:, None, :] <= q_index[:, :, None]
    return same & real & causal


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Plain XLA attention, softmax in float32. q: [B, T, H, D]; k, v: [B, T, Hkv, D]; Hkv divides H.

    Fully masked rows (padding queries) give zeros, never NaN.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {hkv}")
    scale = d**-0.5 if scale is None else scale
    group = h // hkv
    qg = q.reshape(b, t, hkv, group, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = segment_mask(segment_ids)[:, None, None, :, :]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)
