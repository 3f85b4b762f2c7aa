"""Contract 2 (docs/design.md): which key each query may attend to, defined here once, and the input
checks every attention backend shares.

Query i may attend to key j iff ``segment_ids[i] == segment_ids[j] != 0`` and
``j <= i`` (index order inside a row), and, in a sliding-window layer of
window w, ``i - j < w`` (the query and the w - 1 keys before it: Mistral's and
Gemma 3's rule, transformers' ``sliding_window``). Everything that needs the
mask (the reference attention, the kernels and their tests, the loss tests,
the KV-cache decode) calls :func:`segment_mask` or its elementwise body
:func:`allowed`; nothing else spells it out.

This module sits below :mod:`seqjax.model.attention` and the kernels
(``seqjax.model.kernels``), which both import it: the dispatch loads the
kernels by name, and the kernels never import the dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array | None = None,
    q_index: jax.Array | None = None,
    kv_index: jax.Array | None = None,
    window: int | jax.Array | None = None,
    q_prefix_ids: jax.Array | None = None,
    causal: bool = True,
) -> jax.Array:
    """Boolean mask [B, Tq, Tk]: True where query i may attend to key j.

    ``q_index``/``kv_index`` are the row indices of queries and keys ([B, Tq]
    and [B, Tk], or broadcastable); by default queries and keys are the same
    row, indexed 0..T-1. A KV-cache decode step passes the query's row index
    so the same definition serves prefill and decode. ``window``: a sliding
    layer's window (None: the whole segment); it may be traced (one scanned
    layer body serving sliding and full layers, FULL standing for none).
    ``q_prefix_ids`` [B, Tq]: the shared prompt each query's segment also
    attends to (see :func:`allowed`). ``causal=False``: the patches of an
    image (a vision encoder's segments) see their whole segment.
    """
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    tq, tk = q_segment_ids.shape[-1], kv_segment_ids.shape[-1]
    if q_index is None:
        q_index = jnp.arange(tq)[None, :]
    if kv_index is None:
        kv_index = jnp.arange(tk)[None, :]
    return allowed(q_segment_ids[:, :, None], kv_segment_ids[:, None, :], q_index[:, :, None],
                   kv_index[:, None, :], window,
                   None if q_prefix_ids is None else q_prefix_ids[:, :, None], causal)


def allowed(q_segment, kv_segment, q_index, kv_index, window=None, q_prefix=None, causal=True):
    """Contract 2 elementwise, on operands already broadcast to one shape: the body of
    :func:`segment_mask`, which a kernel calls on its own tiles (a Mosaic GPU tile's rows and
    columns come broadcast in its register layout).

    The one extension, a **shared prompt** (preference pairs, ``data.shared_prompt``): a query
    whose segment continues prompt segment ``q_prefix`` (its ``prefix_ids``) may also attend to
    that segment's keys. The indices are then the tokens' *positions*, not their places in the row:
    a completion continues its prompt's positions, so ``kv_index <= q_index`` and the window count
    the distance each token has in its own, unpacked sequence (the chosen completion lies between
    the prompt and the rejected one in the row, and counts for neither).

    The non-causal form (``causal=False``): a query attends to every key of its segment, before or
    after it. A vision encoder's packed patch stream uses it: each image is a segment, and no patch
    sees another image's (Qwen2.5-VL's windows are segments too: its patches are reordered window by
    window, so no distance rule is needed).
    """
    if not causal and window is not None:
        raise ValueError("segment_mask: a window with causal=False; expected windows as segments")
    same = q_segment == kv_segment
    if q_prefix is not None:
        same = same | (q_prefix == kv_segment)
    ok = same & (kv_segment != 0) & (q_segment != 0)
    if not causal:
        return ok
    ok = ok & (kv_index <= q_index)
    return ok if window is None else ok & (q_index - kv_index < window)


def page_mask(q_index: jax.Array, q_real: jax.Array, kv_length: jax.Array, capacity: int,
              window: int | jax.Array | None = None, kv_start: int | jax.Array = 0) -> jax.Array:
    """Contract 2 for a paged cache, whose row holds one sequence: [B, Tq, capacity], True where
    query i (its place ``q_index`` [B, Tq] in its sequence, a real token where ``q_real``) may
    attend to the key at place j of the sequence's pages: j written (below ``kv_length`` [B],
    this call's tokens included), j <= i, and within the window. The same :func:`allowed` as
    every backend's mask, the sequence as one segment and its places as the row indices
    (seqjax.engine's decode). ``kv_start``: the place of the first of the ``capacity`` keys (a
    block of the pages)."""
    kv_index = kv_start + jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
    kv_real = (kv_index < kv_length[:, None, None]).astype(jnp.int32)
    return allowed(q_real.astype(jnp.int32)[:, :, None], kv_real, q_index[:, :, None], kv_index, window)


def state_carries(segment_ids: jax.Array, before: jax.Array | None = None) -> jax.Array:
    """Contract 2 for a layer with a recurrent state (Qwen3.5's Gated DeltaNet): [B, T], True
    where token t reads the state its row carried past token t - 1, which is :func:`allowed`
    between the two, so the same rule as attention's: the state resets to zero at every segment
    start, and padding (segment 0) neither reads nor writes it. ``before`` [B]: the segment of the
    token before the row (a decode step's sequence; default 0: none)."""
    b = segment_ids.shape[0]
    before = jnp.zeros((b,), segment_ids.dtype) if before is None else before.astype(segment_ids.dtype)
    previous = jnp.concatenate([before[:, None], segment_ids[:, :-1]], axis=1)
    return allowed(segment_ids, previous, 1, 0)


def run_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T]: the index of the first token of each token's run of equal segment ids (padding's
    runs too), where a recurrent state or a per-segment sum starts.

    >>> run_starts(jnp.array([[1, 1, 2, 2, 2, 0]]))
    Array([[0, 0, 2, 2, 2, 5]], dtype=int32)
    """
    t = segment_ids.shape[1]
    index = jnp.arange(t, dtype=jnp.int32)[None, :]
    previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    return jax.lax.cummax(jnp.where(segment_ids != previous, index, 0), axis=1)


def conv_taps(segment_ids: jax.Array, width: int) -> jax.Array:
    """[B, T, width]: True where a causal convolution of ``width`` taps may read, at token t,
    the token ``j`` places back (tap j; j = 0 is t itself): :func:`allowed` with the convolution's
    width as a window, so a document's first tokens see zeros, as when alone."""
    t = segment_ids.shape[1]
    taps = []
    for j in range(width):
        back = jnp.pad(segment_ids, ((0, 0), (j, 0)))[:, :t]
        taps.append(allowed(segment_ids, back, j, 0, window=width))
    return jnp.stack(taps, axis=-1)


# A window no row reaches: how a layer attending to its whole segment is told apart from a sliding
# one where the window is a traced per-layer value (under model.scan_layers).
FULL = 2**30




def check_attention_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> None:
    """Raise ValueError naming the argument and the expected shape/dtype, before any work."""
    if q.ndim != 4:
        raise ValueError(f"attention: q has shape {q.shape}, expected [batch, seq, heads, "
                         "head_dim]")
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"attention: k has shape {k.shape} but v has {v.shape}; expected the same [B, T, Hkv, "
            "D]"
        )
    if k.ndim != 4 or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(
            f"attention: k/v have shape {k.shape}, expected [{b}, {t}, kv_heads, {d}] to match q "
            f"{q.shape}"
        )
    if h % k.shape[2]:
        raise ValueError(
            f"attention: {h} query heads is not a multiple of {k.shape[2]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if segment_ids.shape != (b, t):
        raise ValueError(
            f"attention: segment_ids has shape {segment_ids.shape}, expected [{b}, {t}] to match q "
            f"{q.shape}"
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"attention: segment_ids dtype is {segment_ids.dtype}, expected an integer type")
