"""Context parallelism: one row's tokens split over the mesh's ``context`` axis, attention exact.

A row of T tokens is cut into 2n chunks for n devices on the axis; device i holds chunks i and
2n - 1 - i (head-tail balancing), so each holds as much of the causal triangle as any other. For
T = 8 and n = 2 the chunks are [0 1] [2 3] [4 5] [6 7] and::

    device 0: tokens 0 1 6 7        device 1: tokens 2 3 4 5

(:func:`balanced_order` gives that order, :func:`inverse_order` undoes it.) Nothing but attention
looks at a token's neighbours: embeddings, norms, MLPs, RoPE (positions are a batch field) and
the loss are per token, so :meth:`SplitRow.balance` permutes a forward's activations into that
order once at the first block, :meth:`SplitRow.restore` puts them back after the last, and only
attention needs to know. Attention keeps contract 2 unchanged: :func:`segment_mask` takes the
queries' and keys' own row indices (or, under a shared prompt, their positions), so a shard's
place in the row is a parameter and every key shard is one more block of the same mask.

Each device attends its queries to every key shard in turn and merges the partial results by
their log-sum-exp (one float32 softmax, as :func:`seqjax.model.attention.masked_attention`).
``mesh.context_attention`` picks how the keys and values travel:

- ``all_gather``: each device gathers all of K and V once per layer (simple; best while K/V fit,
  one collective the scheduler can start early);
- ``ring``: K, V and their segment ids pass around the ring, one shard a step, the next shard's
  transfer issued before this shard's compute so the two overlap; no device ever holds more than
  two shards of K/V.

Either way a (query shard, key shard) block with no allowed pair is skipped (``lax.cond`` on the
block's mask): a document lying within one shard costs the others nothing.

The dense XLA path runs per block as above. The flash kernel (``model.attention=pallas``) runs
each of a device's two chunks as one span of queries
(:func:`seqjax.model.kernels.flash.flash_attention_span`, with ``block_metadata``'s ranges for the
span, which carry its offsets): against the whole gathered row (``all_gather``; no merge), or
against each key chunk of the ring, merged by the log-sum-exp it returns. The Mosaic kernel, cuDNN
and splash take one whole row and are refused with ``mesh.context > 1`` (the config's check:
``SPLIT_ROW_BACKENDS``), as is attention dropout (its random bits are drawn per whole row).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from seqjax.config.model import SPLIT_ROW_BACKENDS
from seqjax.core.errors import ConfigError
from seqjax.model.kernels.block_ranges import BlockSizes, span_metadata
from seqjax.model.mask import segment_mask
from seqjax.model.sharding import CONTEXT_AXIS, HEAD_AXIS, shard_axes


def chunk_owners(n: int) -> list[int]:
    """The device holding each of a row's 2n chunks: chunks i and 2n - 1 - i on device i
    (``chunk_owners(2)`` is [0, 1, 1, 0])."""
    return [min(j, 2 * n - 1 - j) for j in range(2 * n)]


def balanced_order(t: int, n: int) -> np.ndarray:
    """The row's token indices in split order: device i's T / n tokens are its two chunks
    (:func:`chunk_owners`), in row order. ``balanced_order(8, 2)`` is [0 1 6 7 2 3 4 5]."""
    if t % (2 * n):
        raise ConfigError(
            f"mesh.context={n}: a row of {t} tokens does not cut into {2 * n} equal chunks "
            f"(expected data.seq_len a multiple of 2 x mesh.context = {2 * n})"
        )
    chunks, owners = np.arange(t).reshape(2 * n, t // (2 * n)), chunk_owners(n)
    return np.concatenate(
        [chunks[j] for device in range(n) for j in range(2 * n) if owners[j] == device]
    )


def inverse_order(order: np.ndarray) -> np.ndarray:
    """The permutation that puts split-order tokens back in row order."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse


@dataclasses.dataclass(frozen=True)
class SplitRow:
    """How one forward's rows lie over the context axis: handed to every layer's attention in
    place of a kernel's block metadata. Static (no arrays): a scan carries it as is."""

    mesh: object  # the (abstract) mesh
    n: int  # devices on the context axis
    t: int  # tokens a row
    rows: tuple | None  # the batch axes that split rows (None: rows whole)
    heads: str | None  # the axis that splits heads (None: heads whole)
    kv_path: str = (
        "all_gather"  # model.context_attention: how K/V reach each query shard (KV_PATHS)
    )
    kernel: str = "xla"  # what attends each block: xla (dense, chunked) or pallas (flash spans)

    def __hash__(self):
        return hash((self.n, self.t, self.rows, self.heads, self.kv_path, self.kernel))

    def _spec(self, *rest) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.rows, CONTEXT_AXIS, *rest))

    def balance(self, x, positions, segment_ids, prefix_ids=None, injections=None):
        """Row order -> split order, each [B, T, ...] array laid out along the context axis."""
        order = balanced_order(self.t, self.n)

        def permute(a, extra=0):
            if a is None:
                return None
            moved = jnp.take(a, order, axis=1 + extra)
            spec = P(*([None] * extra), self.rows, CONTEXT_AXIS, *([None] * (a.ndim - 2 - extra)))
            return jax.lax.with_sharding_constraint(moved, NamedSharding(self.mesh, spec))

        return (
            permute(x),
            permute(positions),
            permute(segment_ids),
            permute(prefix_ids),
            permute(injections, extra=1),
        )

    def restore(self, x):
        """Split order -> row order (the last block's output, before the head)."""
        moved = jnp.take(x, inverse_order(balanced_order(self.t, self.n)), axis=1)
        return jax.lax.with_sharding_constraint(moved, self._spec(*([None] * (x.ndim - 2))))


jax.tree_util.register_static(SplitRow)


def split_row(x: jax.Array, kv_path: str = "all_gather", kernel: str = "xla") -> SplitRow | None:
    """How the rows of activations x [B, T, ...] split over the mesh, or None when it has no context
    axis over one device. The mesh is the one ``jax.set_mesh`` made current, else the one x's
    sharding lives on (what ``jax.jit(..., in_shardings=...)`` gives). ``kernel``: the resolved
    attention backend, one of :data:`SPLIT_ROW_KERNELS`."""
    batch_rows, t = x.shape[:2]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = jax.typeof(x).sharding.mesh
    if mesh.empty or mesh.shape.get(CONTEXT_AXIS, 1) <= 1 or CONTEXT_AXIS in mesh.manual_axes:
        return None
    if kernel not in SPLIT_ROW_KERNELS:
        raise ConfigError(
            f"model.attention: got {kernel!r}, which attends over one whole row and cannot honour "
            f"mesh.context > 1; expected one of {', '.join(SPLIT_ROW_KERNELS)} (or auto)"
        )
    sizes = dict(mesh.shape)
    rows, _ = shard_axes(mesh, batch_rows)
    heads = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 else None
    return SplitRow(mesh, sizes[CONTEXT_AXIS], t, rows or None, heads, kv_path, kernel)


def row_spans(x: jax.Array) -> int:
    """How many devices hold a span each of the rows of x [B, T, ...]: mesh.context's size when
    the rows split over it (:func:`split_row`), else 1. The chunked loss cuts its chunks within
    these spans (seqjax.model.loss), so each device scores its own tokens."""
    split = split_row(x)
    return 1 if split is None else split.n


def split_row_attention(
    q, k, v, segment_ids, split: SplitRow, scale=None, window=None, prefix_ids=None, positions=None
) -> jax.Array:
    """Attention of split-order q [B, T, H, D], k/v [B, T, Hkv, D] over the context axis:
    contract 2 with each token's row index (its position under a shared prompt, as
    :func:`seqjax.model.mask.allowed` says), merged over key shards by log-sum-exp."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads = split.heads
    if heads is not None:
        size = dict(split.mesh.shape)[heads]
        heads = heads if q.shape[2] % size == 0 and k.shape[2] % size == 0 else None
    index = (
        positions
        if prefix_ids is not None
        else jnp.broadcast_to(
            jnp.asarray(balanced_order(split.t, split.n), jnp.int32), segment_ids.shape
        )
    )
    per_head, per_token = P(split.rows, CONTEXT_AXIS, heads, None), P(split.rows, CONTEXT_AXIS)
    window = None if window is None else jnp.asarray(window, jnp.int32)
    if split.kernel == "pallas":
        if prefix_ids is not None:
            raise ConfigError(
                "model.attention: got 'pallas', which cannot honour a shared prompt's mask "
                "(data.shared_prompt) on a row split over mesh.context; expected xla or auto"
            )
        blocks = span_blocks(q.shape[-1], split.t // (2 * split.n))

        def local(q, k, v, seg, idx, prefix, window):
            return FLASH_KV_PATHS[split.kv_path](q, k, v, seg, window, split.n, scale, blocks)
    else:
        fn = KV_PATHS[split.kv_path]

        def local(q, k, v, seg, idx, prefix, window):
            return fn(q, k, v, seg, idx, prefix, window, split.n, scale)

    # (an absent prefix or window is None: no leaves, no spec)
    prefix_spec = None if prefix_ids is None else per_token
    window_spec = None if window is None else P()
    return jax.shard_map(
        local,
        mesh=split.mesh,
        in_specs=(per_head, per_head, per_head, per_token, per_token, prefix_spec, window_spec),
        out_specs=per_head,
        check_vma=False,
    )(q, k, v, segment_ids, index, prefix_ids, window)


def _gathered(q, k, v, seg, idx, prefix, window, n, scale):
    """Every key shard gathered once; the blocks attended in turn."""
    keys = [jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True) for a in (k, v, seg, idx)]
    tl = k.shape[1]
    state = _empty(q)
    for j in range(n):
        state = _block(
            state, q, seg, idx, prefix, *(a[:, j * tl : (j + 1) * tl] for a in keys), window, scale
        )
    return _finish(state, seg, q.dtype)


def _ring(q, k, v, seg, idx, prefix, window, n, scale):
    """K/V passed around the ring: step s attends to the shard of device (i - s) mod n, the next
    shard already in flight."""
    shift = [(i, (i + 1) % n) for i in range(n)]
    kv = (k, v, seg, idx)
    state = _empty(q)
    for s in range(n):
        incoming = jax.lax.ppermute(kv, CONTEXT_AXIS, shift) if s < n - 1 else None
        state = _block(state, q, seg, idx, prefix, *kv, window, scale)
        kv = incoming
    return _finish(state, seg, q.dtype)


def _empty(q):
    """(running max, running sum) [b, t, h] and the unnormalized output [b, t, h, d], float32."""
    b, t, h, d = q.shape
    return (
        jnp.full((b, t, h), -jnp.inf, jnp.float32),
        jnp.zeros((b, t, h), jnp.float32),
        jnp.zeros((b, t, h, d), jnp.float32),
    )


# Queries a device attends at once: a block's scores are [rows, heads, this, keys a shard] float32,
# and each chunk is rematerialized in the backward pass, so that is all a block ever holds.
QUERY_CHUNK = 1024
MIN_QUERY_CHUNK, SCORES_PER_CHUNK = 128, 2**24


def _block(state, q, q_seg, q_idx, q_prefix, k, v, kv_seg, kv_idx, window, scale):
    """One key shard folded into the running (max, sum, output), QUERY_CHUNK queries at a time; a
    chunk with no allowed pair in the shard is skipped."""
    t = q.shape[1]
    # (a long shard's keys take fewer queries a chunk: at most SCORES_PER_CHUNK scores a head, so a
    # block at 128k tokens on 2 devices holds 256 queries' scores, not 1,024's)
    c = math.gcd(t, min(QUERY_CHUNK, max(MIN_QUERY_CHUNK, SCORES_PER_CHUNK // k.shape[1])))

    def attend_chunk(xs):
        q, q_seg, q_idx, q_prefix, state = xs
        mask = segment_mask(q_seg, kv_seg, q_idx, kv_idx, window=window, q_prefix_ids=q_prefix)
        return jax.lax.cond(
            jnp.any(mask), lambda s: _fold(s, q, k, v, mask, scale), lambda s: s, state
        )

    if c == t:
        return attend_chunk((q, q_seg, q_idx, q_prefix, state))
    # [b, t, ...] -> [t / c, b, c, ...]: one chunk a map step, recomputed in the backward pass
    chunks = jax.tree.map(
        lambda a: jnp.moveaxis(a.reshape(a.shape[0], t // c, c, *a.shape[2:]), 1, 0),
        (q, q_seg, q_idx, q_prefix, state),
    )
    out = jax.lax.map(jax.checkpoint(attend_chunk), chunks)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], t, *a.shape[3:]), out)


def _fold(state, q, k, v, mask, scale):
    """Queries q [b, c, h, d] against one shard's keys under ``mask`` [b, c, s], merged into
    ``state`` by log-sum-exp (the softmax of masked_attention, kept in pieces)."""
    m, total, acc = state
    b, c, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, c, hkv, h // hkv, d)
    logits = jnp.einsum("btkgd,bskd->btkgs", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, :, None, None], logits, -jnp.inf).reshape(b, c, h, -1)
    new_max = jnp.maximum(m, jnp.max(logits, axis=-1))
    safe = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    weights = jnp.exp(logits - safe[..., None])
    rescale = jnp.exp(m - safe)
    pv = jnp.einsum(
        "btkgs,bskd->btkgd",
        weights.reshape(b, c, hkv, h // hkv, -1).astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
    ).reshape(b, c, h, d)
    return new_max, total * rescale + jnp.sum(weights, axis=-1), acc * rescale[..., None] + pv


# model.context_attention -> how each device's queries meet every key shard
KV_PATHS = {"all_gather": _gathered, "ring": _ring}


def _finish(state, seg, dtype):
    _, total, acc = state
    out = acc / jnp.where(total == 0, 1.0, total)[..., None]
    return jnp.where((seg != 0)[:, :, None, None], out, 0).astype(dtype)


# ----------------------------------------------------------------------------------------------
# The flash kernel's spans (model.attention=pallas): each of a device's two chunks is one span of
# queries, attended by seqjax.model.kernels.flash.flash_attention_span with block_metadata's ranges
# for that span, so the kernel skips every tile with no allowed pair, across shards too.

# (the backends the config lets through with mesh.context > 1, auto resolved to one of them)
SPLIT_ROW_KERNELS = tuple(b for b in SPLIT_ROW_BACKENDS if b != "auto")


def span_blocks(head_dim: int, chunk: int) -> BlockSizes:
    """The flash kernel's tiles for chunks of ``chunk`` tokens: its usual tiles for this head_dim
    (``BlockSizes.for_head_dim``), each cut to the largest power of two dividing the chunk, so a
    chunk is whole blocks."""
    base = BlockSizes.for_head_dim(head_dim)
    largest = chunk & -chunk
    if largest < 16:
        raise ConfigError(
            f"model.attention=pallas with a split row: chunks of {chunk} tokens (data.seq_len / "
            f"(2 x mesh.context)); expected a multiple of 16, the kernel's smallest tile"
        )
    names = ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "block_q_dq", "block_k_dq")
    return dataclasses.replace(base, **{f: min(getattr(base, f), largest) for f in names})


def _flash_kernel():
    # (loaded here, as the dispatch loads kernels: the model imports without Pallas's Triton backend)
    from seqjax.model.kernels.flash import flash_attention_span

    return flash_attention_span


def _row_order(a, n):
    """A device's gathered split-order shards [b, T, ...] back in row order."""
    return jnp.take(a, jnp.asarray(inverse_order(balanced_order(a.shape[1], n))), axis=1)


def _flash_gathered(q, k, v, seg, window, n, scale, blocks):
    """Every key gathered once, in row order; each of the device's chunks one span of queries
    against the whole row (no merge: the kernel's ranges stop at the chunk's last query)."""
    keys = [
        _row_order(jax.lax.all_gather(a, CONTEXT_AXIS, axis=1, tiled=True), n) for a in (k, v, seg)
    ]
    c, attend = q.shape[1] // 2, _flash_kernel()
    spans = span_metadata(keys[2], blocks, [((chunk * c, c), None) for chunk in _chunks(n)], window)
    outs = []
    for slot, md in enumerate(spans):
        piece = slice(slot * c, (slot + 1) * c)
        outs.append(
            attend(q[:, piece], keys[0], keys[1], seg[:, piece], keys[2], md, scale=scale)[0]
        )
    return jnp.concatenate(outs, axis=1)


def _flash_ring(q, k, v, seg, window, n, scale, blocks):
    """K/V passed around the ring as on the XLA path; each (query chunk, key chunk) pair one span
    call, merged by log-sum-exp. Only the segment ids of the whole row are gathered (4 bytes a
    token): a span's ranges depend on where its documents start and end."""
    row_seg = _row_order(jax.lax.all_gather(seg, CONTEXT_AXIS, axis=1, tiled=True), n)
    shift = [(i, (i + 1) % n) for i in range(n)]
    c, attend = q.shape[1] // 2, _flash_kernel()
    halves = lambda a, slot: a[:, slot * c : (slot + 1) * c]  # noqa: E731
    mine, kv, merged = _chunks(n), (k, v, seg), [None, None]
    # every (step, query chunk, key chunk) span's ranges, from one pass over the row's ids
    pairs = [
        ((mine[qs] * c, c), (theirs * c, c))
        for s in range(n)
        for qs in range(2)
        for theirs in _chunks(n, (jax.lax.axis_index(CONTEXT_AXIS) - s) % n)
    ]
    spans = iter(span_metadata(row_seg, blocks, pairs, window))
    for s in range(n):
        incoming = jax.lax.ppermute(kv, CONTEXT_AXIS, shift) if s < n - 1 else None
        for qs in range(2):
            for ks in range(2):
                md = next(spans)
                out, lse = attend(
                    halves(q, qs),
                    *(halves(a, ks) for a in kv[:2]),
                    halves(seg, qs),
                    halves(kv[2], ks),
                    md,
                    scale=scale,
                )
                merged[qs] = _merge(merged[qs], out, lse)
        kv = incoming
    return jnp.concatenate([m[0] for m in merged], axis=1).astype(q.dtype)


def _chunks(n, device=None):
    """The row chunks a device holds, in its order: (i, 2n - 1 - i); this device's by default."""
    i = jax.lax.axis_index(CONTEXT_AXIS) if device is None else device
    return i, 2 * n - 1 - i


def _merge(state, out, lse):
    """Two partial attentions of the same queries over disjoint keys, as one: (output [b, c, h, d]
    float32, log-sum-exp [b, c, h]); ``state`` None is the first."""
    out, lse = out.astype(jnp.float32), jnp.moveaxis(lse, 1, 2)
    if state is None:
        return out, lse
    prev, prev_lse = state
    total = jnp.logaddexp(prev_lse, lse)
    return prev * jnp.exp(prev_lse - total)[..., None] + out * jnp.exp(lse - total)[
        ..., None
    ], total


# model.context_attention -> the flash kernel's path
FLASH_KV_PATHS = {"all_gather": _flash_gathered, "ring": _flash_ring}


def work_per_shard(
    segment_ids: np.ndarray, n: int, tile: int = 128, window: int | None = None, order=None
) -> np.ndarray:
    """Attention work each device does on split-order rows: the (query tile, key tile) pairs with
    at least one allowed pair, per device [n] (host numpy; what the balance test and
    scripts/bench_context.py count). ``order``: the row's tokens in device order (default
    :func:`balanced_order`; ``np.arange(T)`` is a contiguous split)."""
    b, t = segment_ids.shape
    order = balanced_order(t, n) if order is None else np.asarray(order)
    seg = np.asarray(segment_ids)[:, order]
    tl = t // n
    work = np.zeros(n, np.int64)
    for i in range(n):
        qs = slice(i * tl, (i + 1) * tl)
        allowed = np.asarray(
            segment_mask(
                jnp.asarray(seg[:, qs]),
                jnp.asarray(seg),
                jnp.asarray(order[qs])[None],
                jnp.asarray(order)[None],
                window=window,
            )
        )
        tiles = allowed.reshape(b, tl // tile, tile, t // tile, tile).any(axis=(2, 4))
        work[i] = tiles.sum()
    return work
