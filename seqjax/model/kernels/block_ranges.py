"""Which (query block, key block) tiles of a packed row can hold an allowed pair, computed once per
forward.

Under contract 2 (docs/design.md) query i sees key j iff ``segment_ids[i] == segment_ids[j] != 0``
and ``j <= i``, and, in a sliding layer of window w, ``i - j < w``. So a real query i sees only keys
in ``[max(first(i), i - w + 1), i]``, where ``first(i)`` is the first index of i's segment, and a
real key j is seen only by queries in ``[j, min(last(j), j + w - 1)]`` (w = FULL, a length no row
reaches, in a global layer). Reducing those intervals over a tile gives a contiguous range of tiles
per block: for each query block the key blocks ``[kv_lo, kv_hi)`` its loop visits, and for each key
block the query blocks ``[q_lo, q_hi)`` the dK/dV loop visits. Blocks outside the ranges hold no
allowed pair, so packing leaves them empty and the kernel never loads them; an all-padding block
gets the empty range and costs nothing.

The ranges depend only on ``segment_ids``, the block sizes and the window, not on the layer's
weights, so a model computes one :class:`BlockMetadata` per distinct window per forward
(``block_metadata(segment_ids, block_sizes, window)``) and passes it to every layer's
``flash_attention(..., metadata=...)``; it is a pytree, so it crosses ``jit``/``scan``/``remat``
boundaries, and a scanned model stacks one per layer. A sliding window narrows every range to a band
around the diagonal: tiles outside the band are skipped like tiles outside the segment.

Both tiled kernels (``flash.py`` on Triton, ``mosaic.py`` on Mosaic GPU) also share what sits around
their passes here: the metadata check (:func:`kernel_metadata`), the window operand and the custom
VJP (:func:`tiled_vjp`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from seqjax.model.mask import FULL

LN_2 = math.log(2.0)  # a base-2 log-sum-exp in natural units


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile shapes and Triton launch settings of the three passes; each block a power of two >= 16.

    - forward: ``block_q`` queries per program, streaming ``block_k`` keys per step;
    - dK/dV: ``block_k_bwd`` keys per program, streaming ``block_q_bwd`` queries per step;
    - dQ: ``block_q_dq`` queries per program, streaming ``block_k_dq`` keys per step (default: the
      dK/dV pass's ``block_q_bwd`` x ``block_k_bwd``).

    ``num_warps``/``num_stages`` go to Triton for the forward pass,
    ``num_warps_bwd``/``num_stages_bwd`` for the two backward passes (default: the forward's); all
    four are ignored in interpret mode.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int = 4
    num_stages: int = 2
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None

    def __post_init__(self) -> None:
        for name, default in (("block_q_dq", self.block_q_bwd), ("block_k_dq", self.block_k_bwd),
                              ("num_warps_bwd", self.num_warps), ("num_stages_bwd", self.num_stages)):
            if getattr(self, name) is None:
                # frozen: resolved once, so equal settings compare equal
                object.__setattr__(self, name, default)
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "block_q_dq", "block_k_dq"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"BlockSizes.{name}: got {size}, expected a power of two >= 16")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> BlockSizes:
        """Tiles per head_dim, from the block-size sweep on an H100 (BENCHMARKS.md,
        scripts/gpu_suite.py sweep).

        The float32 accumulators (block_q x head_dim) must fit in registers, and the backward passes
        keep more tiles live than the forward, so they use smaller tiles with 4 warps.
        """
        if head_dim <= 64:
            return cls(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=4, num_stages=3,
                       num_warps_bwd=4, num_stages_bwd=3)
        if head_dim <= 128:
            return cls(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64, num_warps=8, num_stages=3,
                       num_warps_bwd=4, num_stages_bwd=3)
        return cls(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=8, num_stages=1)

    @property
    def multiple(self) -> int:
        """The padded sequence length is a multiple of this (every block size divides it)."""
        return max(self.block_q, self.block_k, self.block_q_bwd, self.block_k_bwd, self.block_q_dq, self.block_k_dq)

    def padded_length(self, seq_len: int) -> int:
        return -(-seq_len // self.multiple) * self.multiple


# The Mosaic GPU kernel's tiles (seqjax.model.kernels.mosaic): 64 x 64 in every pass, one
# warpgroup's wgmma M.
MOSAIC_BLOCKS = BlockSizes(block_q=64, block_k=64, block_q_bwd=64, block_k_bwd=64)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMetadata:
    """Per-block visiting ranges for one batch of segment ids: int32 [B, n_blocks, 4], column
    blocks.

    Each row is ``(lo, full_lo, full_hi, hi)`` with ``lo <= full_lo <= full_hi <= hi``: the loop
    visits ``[lo, hi)``; tiles in ``[full_lo, full_hi)`` have every pair allowed (one segment,
    wholly below the diagonal), so the kernel skips building the mask there; the tiles either side
    are masked.

    ``fwd_kv``: for each forward query block (``block_q``), key blocks (``block_k``). ``dq_kv``: the
    same for the dQ pass's tiles (``block_q_dq`` x ``block_k_dq``). ``dkv_q``: for each backward key
    block (``block_k_bwd``), query blocks (``block_q_bwd``). ``window``: int32 scalar, the sliding
    window they were computed for (FULL: none); the kernel's edge tiles mask with it. ``seq_len`` is
    the padded length they were computed for. ``causal=False``: the non-causal mask (a vision
    encoder's images, contract 2's ``causal=False``): a position sees its whole segment.

    Spans (``block_metadata(..., queries=, keys=)``): ``offsets`` int32 [2] holds the row index of
    the first query and of the first key, ``seq_len`` the queries' length and ``kv_len`` the keys';
    the column blocks count from the first key. Whole rows leave ``offsets`` None (both spans start
    at 0 and ``kv_len`` is ``seq_len``).

    A shared prompt (``block_metadata(..., prefix_ids=)``): ``fwd_prefix`` / ``dq_prefix`` hold each
    query block's second range, the key blocks of the prompts its queries continue, cut off where
    ``fwd_kv`` / ``dq_kv`` start (no tile is visited twice); ``dkv_q`` reaches, for a prompt's key
    blocks, to the last query that continues the prompt. Without one they are None.
    """

    fwd_kv: jax.Array
    dq_kv: jax.Array
    dkv_q: jax.Array
    window: jax.Array
    seq_len: int = dataclasses.field(metadata=dict(static=True))
    block_sizes: BlockSizes = dataclasses.field(metadata=dict(static=True))
    causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
    offsets: jax.Array | None = None
    kv_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    fwd_prefix: jax.Array | None = None
    dq_prefix: jax.Array | None = None

    @property
    def shared_prompt(self) -> bool:
        """Whether these ranges honour a shared prompt (``block_metadata``'s ``prefix_ids``)."""
        return self.fwd_prefix is not None

    @property
    def spans(self) -> bool:
        """Whether these ranges are for a span of queries against a span of keys (a row split over
        mesh.context) rather than one whole row against itself."""
        return self.offsets is not None


def segment_extents(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, last) [B, T]: the first and last index in the row holding the same segment id as each
    position.

    Computed by a stable sort, so it is right even if an id recurs non-contiguously (the contract
    says segments are contiguous runs; then these are simply each segment's start and end).
    """
    t = segment_ids.shape[-1]
    order = jnp.argsort(segment_ids, axis=-1, stable=True)
    sorted_ids = jnp.take_along_axis(segment_ids, order, axis=-1)
    index = jnp.broadcast_to(jnp.arange(t), sorted_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(sorted_ids[:, :1], bool), sorted_ids[:, 1:] != sorted_ids[:, :-1]], -1)
    ends = jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], -1)
    group_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    group_end = jax.lax.cummin(jnp.where(ends, index, t - 1), axis=1, reverse=True)
    first_sorted = jnp.take_along_axis(order, group_start, axis=-1)
    last_sorted = jnp.take_along_axis(order, group_end, axis=-1)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(first_sorted, inverse, -1), jnp.take_along_axis(last_sorted, inverse, -1)


def run_extents(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(start, end) [B, T]: the first and last index of the contiguous run of equal ids holding each
    position."""
    t = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.concatenate([jnp.ones_like(change[:, :1]), change], -1)
    ends = jnp.concatenate([change, jnp.ones_like(change[:, :1])], -1)
    return (jax.lax.cummax(jnp.where(starts, index, 0), axis=1),
            jax.lax.cummin(jnp.where(ends, index, t - 1), axis=1, reverse=True))


def _ranges(real, lo, hi, full, full_lo, full_hi, block_rows: int, block_cols: int) -> jax.Array:
    """(lo, full_lo, full_hi, hi) per row block, in column blocks.

    ``lo``/``hi`` [B, T]: the inclusive column interval each real position needs; the visited range
    covers them all. ``full`` [B, n_rows]: whether the row block lies in one real run;
    ``full_lo``/``full_hi`` [B, n_rows]: the inclusive column interval every row of the block may
    see; the full tiles lie inside it.
    """
    b, t = real.shape
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.where(real, lo, big).reshape(b, t // block_rows, block_rows).min(-1) // block_cols
    hi = jnp.where(real, hi, -1).reshape(b, t // block_rows, block_rows).max(-1)
    empty = hi < 0
    lo, hi = jnp.where(empty, 0, lo), jnp.where(empty, 0, hi // block_cols + 1)
    first_full = jnp.clip(-(-full_lo // block_cols), lo, hi)
    end_full = jnp.clip((full_hi + 1) // block_cols, first_full, hi)
    none = ~full | (end_full <= first_full)
    first_full, end_full = jnp.where(none, hi, first_full), jnp.where(none, hi, end_full)
    return jnp.stack([lo, first_full, end_full, hi], axis=-1).astype(jnp.int32)


def block_metadata(segment_ids: jax.Array, block_sizes: BlockSizes, window=None, causal: bool = True,
                   queries: tuple | None = None, keys: tuple | None = None,
                   prefix_ids: jax.Array | None = None) -> BlockMetadata:
    """Visiting ranges for ``segment_ids`` [B, T] (T any length: padded here as the kernel pads it).

    Use the block sizes the kernel will use: ``BlockSizes.for_head_dim(head_dim)`` unless you pass
    your own. ``window``: the layer's sliding window (None or FULL: the whole segment); an int or a
    traced int32 scalar. ``causal=False``: every position of a segment sees all of it (no window
    then), so a block visits its segments' whole extents, and a block inside one run is full against
    that run's every block.

    ``queries`` / ``keys``: ``(offset, length)`` spans of the row (default: all of it) when a kernel
    call attends only those queries to only those keys, as one device of a row split over
    mesh.context does (seqjax.model.context). ``segment_ids`` is still the whole row: a span's ranges
    depend on where its documents start and end outside it. Each length is a multiple of
    ``block_sizes.multiple`` and each offset (an int or a traced int32 scalar) a multiple of the
    length's blocks. A tile that would reach outside the other span is cut off: the ranges are the
    whole row's, shifted to count from the span's first block and clipped to its blocks. Example:
    a row of 64 tokens in one document, blocks of 16, ``queries=(32, 16)``, ``keys=(0, 32)``: the
    one query block visits key blocks [0, 2), both full (every pair allowed); with
    ``keys=(32, 32)`` it visits only that span's block 0, masked (the diagonal).

    ``prefix_ids`` [B, T]: a shared prompt (contract 2's extension,
    :func:`seqjax.model.mask.allowed`): a query also sees the keys of segment ``prefix_ids[i]`` (0:
    none). Each query block gets a second range over its prompts' key blocks (``fwd_prefix``,
    ``dq_prefix``), so the completions between a prompt and a later completion of its group are
    never visited. The prompt must precede the completions that continue it, each segment one run,
    as ``data.shared_prompt`` and GRPO's ``prompt_once`` lay rows out: row order is then position
    order for every allowed pair. No window, no spans, causal only. Example, blocks of 16: a prompt
    of 16 tokens (segment 1), completions of 32 (segment 2) and 16 (segment 3), each with prefix 1:
    the last query block visits the prompt's block [0, 1) (full) and its own [3, 4) (masked), never
    segment 2's blocks 1 and 2.
    """
    if prefix_ids is not None:
        if window is not None or not causal or queries is not None or keys is not None:
            raise ValueError("block_metadata: a shared prompt (prefix_ids) with a window, "
                             "causal=False or spans; expected whole causal rows without a window")
        return _shared_prompt_ranges(_padded(segment_ids, block_sizes), _padded(prefix_ids, block_sizes),
                                     block_sizes)
    return span_metadata(segment_ids, block_sizes, [(queries, keys)], window, causal)[0]


def _shared_prompt_ranges(ids: jax.Array, prefix: jax.Array, bs: BlockSizes) -> BlockMetadata:
    """:func:`block_metadata` of a padded row whose queries may also see a prompt segment."""
    row = _positions(ids)
    index, first, last, _, _, real = row
    w = jnp.asarray(FULL, jnp.int32)
    p_first, p_last, continues = _prompt_extents(ids, jnp.where(real, prefix, 0))

    def group_end(p_first, index, continues):
        """At each prompt's first index: the last query continuing it."""
        return jnp.full_like(index, -1).at[p_first].max(jnp.where(continues, index, -1))

    # a prompt's keys are seen up to the last query that continues it
    ends = jax.vmap(group_end)(p_first, index, continues)
    reach = jnp.maximum(last, jnp.take_along_axis(ends, first, -1))
    fwd_kv = _by_queries(row, bs.block_q, bs.block_k, w, True)
    dq_kv = _by_queries(row, bs.block_q_dq, bs.block_k_dq, w, True)
    return BlockMetadata(
        fwd_kv=fwd_kv, dq_kv=dq_kv,
        dkv_q=_by_keys((index, first, reach, *row[3:]), bs.block_k_bwd, bs.block_q_bwd, w, True),
        window=w, seq_len=ids.shape[-1], block_sizes=bs,
        fwd_prefix=_prompt_blocks(fwd_kv, (p_first, p_last, continues), bs.block_q, bs.block_k),
        dq_prefix=_prompt_blocks(dq_kv, (p_first, p_last, continues), bs.block_q_dq, bs.block_k_dq),
    )


def _prompt_extents(ids: jax.Array, prefix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per position: the first and last index of the prompt segment it continues, and whether it
    continues one (a real position whose prefix id names a segment of the row)."""
    def one_row(ids, prefix):
        order = jnp.argsort(ids, stable=True)
        sorted_ids = ids[order]
        at = jnp.clip(jnp.searchsorted(sorted_ids, prefix, side="left"), 0, ids.shape[-1] - 1)
        end = jnp.clip(jnp.searchsorted(sorted_ids, prefix, side="right") - 1, 0, ids.shape[-1] - 1)
        found = (prefix != 0) & (sorted_ids[at] == prefix)
        return order[at], order[end], found

    return jax.vmap(one_row)(ids, prefix)


def _prompt_blocks(own: jax.Array, prompts: tuple, bq: int, bk: int) -> jax.Array:
    """Each query block's range over the key blocks of the prompts its queries continue, cut off
    where its own range ``own`` starts; a block whose queries all continue one prompt sees that
    prompt's whole tiles in full."""
    p_first, p_last, continues = prompts
    b, t = continues.shape

    def blocks(a):
        return a.reshape(b, t // bq, bq)

    one = (blocks(continues).all(-1) & (blocks(p_first).min(-1) == blocks(p_first).max(-1)))
    ranges = _ranges(continues, p_first, p_last, one, p_first[:, ::bq], p_last[:, ::bq], bq, bk)
    ranges = jnp.minimum(ranges, own[..., :1])
    return jnp.where(ranges[..., 3:] > ranges[..., :1], ranges, 0).astype(jnp.int32)


def span_metadata(segment_ids: jax.Array, block_sizes: BlockSizes, spans: list, window=None,
                  causal: bool = True) -> list[BlockMetadata]:
    """:func:`block_metadata` for each ``(queries, keys)`` pair of ``spans`` over one row's ids,
    the row's per-position extents (a sort) computed once for all of them: a split row's ring
    attends 4 n (query chunk, key chunk) pairs a layer."""
    if not causal and window is not None:
        raise ValueError("block_metadata: a window with causal=False; expected windows as segments")
    w = jnp.asarray(FULL if window is None else window, jnp.int32)
    ids = _padded(segment_ids, block_sizes)
    row, padded = _positions(ids), ids.shape[-1]
    return [_span_ranges(row, padded, block_sizes, w, causal, queries, keys) for queries, keys in spans]


def _padded(ids: jax.Array, block_sizes: BlockSizes) -> jax.Array:
    """[B, T] ids as int32, padded with 0 to the length the kernels pad T to."""
    t = ids.shape[-1]
    return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, block_sizes.padded_length(t) - t)))


def _span_ranges(row: tuple, padded: int, bs: BlockSizes, w, causal: bool, queries, keys) -> BlockMetadata:
    """One span pair's metadata from the padded row's per-position arrays (:func:`_positions`)."""
    spans = queries is not None or keys is not None
    (q_at, q_len), (k_at, k_len) = _span(queries, padded, bs, "queries"), _span(keys, padded, bs, "keys")

    def side(at, length):  # a span's queries or keys: the row's per-position arrays, sliced
        return tuple(jax.lax.dynamic_slice_in_dim(a, at, length, axis=1) for a in row) if spans else row

    def within(ranges, at, block, length):
        return _within(ranges, at // block, length // block) if spans else ranges

    q_side, k_side = side(q_at, q_len), side(k_at, k_len)
    return BlockMetadata(
        fwd_kv=within(_by_queries(q_side, bs.block_q, bs.block_k, w, causal), k_at, bs.block_k, k_len),
        dq_kv=within(_by_queries(q_side, bs.block_q_dq, bs.block_k_dq, w, causal), k_at, bs.block_k_dq,
                     k_len),
        dkv_q=within(_by_keys(k_side, bs.block_k_bwd, bs.block_q_bwd, w, causal), q_at, bs.block_q_bwd,
                     q_len),
        window=w,
        seq_len=q_len,
        block_sizes=bs,
        causal=causal,
        offsets=jnp.stack([jnp.asarray(q_at, jnp.int32), jnp.asarray(k_at, jnp.int32)]) if spans else None,
        kv_len=k_len if spans else None,
    )


def _positions(segment_ids: jax.Array) -> tuple:
    """Per position of the padded row [B, T]: (index, first, last, run_start, run_end, real)."""
    first, last = segment_extents(segment_ids)
    run_start, run_end = run_extents(segment_ids)
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[-1], dtype=jnp.int32), segment_ids.shape)
    return index, first, last, run_start, run_end, segment_ids != 0


def _by_queries(side: tuple, bq: int, bk: int, w, causal: bool) -> jax.Array:
    """Each query block's key-block range (row coordinates) from the queries' per-position arrays.

    A query block in one run sees in full every key from the run's start (or its last query's window
    start) up to the block's first query."""
    index, first, last, run_start, run_end, real = side
    q_start, q_end = index[:, ::bq], index[:, bq - 1 :: bq]
    one_run = (run_start[:, bq - 1 :: bq] <= q_start) & real[:, ::bq]
    if not causal:
        return _ranges(real, first, last, one_run, run_start[:, ::bq], run_end[:, ::bq], bq, bk)
    full_lo = jnp.maximum(run_start[:, ::bq], q_end - w + 1)
    return _ranges(
        real, jnp.maximum(first, index - w + 1), index, one_run, full_lo, q_start, bq, bk
    )


def _by_keys(side: tuple, bk: int, bq: int, w, causal: bool) -> jax.Array:
    """Each key block's query-block range (row coordinates) from the keys' per-position arrays.

    A key block in one run is seen in full by every query from the block's last key to the run's end
    (or to the last query whose window still reaches the block's first key)."""
    index, first, last, run_start, run_end, real = side
    k_start, k_end = index[:, ::bk], index[:, bk - 1 :: bk]
    one_run = (run_end[:, ::bk] >= k_end) & real[:, ::bk]
    if not causal:
        return _ranges(real, first, last, one_run, run_start[:, ::bk], run_end[:, ::bk], bk, bq)
    full_hi = jnp.minimum(run_end[:, ::bk], k_start + w - 1)
    return _ranges(real, index, jnp.minimum(last, index + w - 1), one_run, k_end, full_hi, bk, bq)


def _span(span: tuple | None, padded: int, block_sizes: BlockSizes, name: str) -> tuple:
    """(offset, length) of a span of the padded row, its length checked (the offset may be
    traced)."""
    if span is None:
        return 0, padded
    offset, length = span
    if length % block_sizes.multiple or not 0 < length <= padded:
        raise ValueError(
            f"block_metadata: {name} span of length {length}; expected a multiple of "
            f"{block_sizes.multiple} (the largest block) within the row's {padded} tokens"
        )
    return offset, length


def _within(ranges: jax.Array, first: jax.Array, n: int) -> jax.Array:
    """Whole-row ranges [B, rows, 4] (column blocks from the row's start) as a span's: counted from
    its ``first`` block and clipped to its ``n`` blocks; a range left empty is (0, 0, 0, 0), as a whole
    row's empty ones are."""
    ranges = jnp.clip(ranges - first, 0, n)
    return jnp.where(ranges[..., 3:] > ranges[..., :1], ranges, 0).astype(jnp.int32)


def kernel_metadata(kernel: str, segment_ids: jax.Array, metadata: BlockMetadata | None, window,
                    block_sizes: BlockSizes | None, default: BlockSizes, causal: bool = True) -> BlockMetadata:
    """The metadata a kernel runs with: ``metadata`` as given (checked against ``block_sizes`` and
    ``causal`` when set and against these ids' batch and padded length), or computed here with
    ``block_sizes or default`` for ``window``. Both kernels (flash, mosaic) call this, so their
    refusals are one set of lines naming ``kernel``."""
    if metadata is None:
        metadata = block_metadata(segment_ids, block_sizes or default, window, causal)
    elif metadata.causal != causal:
        raise ValueError(f"{kernel}: metadata was computed with causal={metadata.causal}, not causal={causal}")
    elif window is not None:
        raise ValueError(f"{kernel}: pass the window to block_metadata, which the given metadata came from")
    elif block_sizes is not None and block_sizes != metadata.block_sizes:
        raise ValueError(f"{kernel}: metadata was computed for {metadata.block_sizes}, not block_sizes={block_sizes}")
    if metadata.spans:
        raise ValueError(f"{kernel}: metadata for spans of a row (block_metadata's queries/keys); this "
                         "kernel takes whole rows (a split row's spans go to flash_attention_span)")
    b, t = segment_ids.shape
    padded = metadata.block_sizes.padded_length(t)
    if metadata.seq_len != padded or metadata.fwd_kv.shape[0] != b:
        raise ValueError(f"{kernel}: metadata is for batch {metadata.fwd_kv.shape[0]} and padded length "
                         f"{metadata.seq_len}, but the inputs have batch {b} and padded length {padded} (T={t})")
    return metadata


def window_operand(metadata: BlockMetadata) -> jax.Array:
    """The metadata's window as the [1] int32 array a kernel pass reads (a scalar operand, traced
    under scan)."""
    return jnp.reshape(metadata.window, (1,)).astype(jnp.int32)


def visited_blocks(ranges: jax.Array, n_cols: int) -> jax.Array:
    """Boolean [B, n_rows, n_cols]: True for the tiles a kernel loop visits under ``ranges`` [B,
    n_rows, 4]."""
    col = jnp.arange(n_cols)
    return (col >= ranges[..., :1]) & (col < ranges[..., 3:])


def full_blocks(ranges: jax.Array, n_cols: int) -> jax.Array:
    """Boolean [B, n_rows, n_cols]: True for the visited tiles the kernel runs without a mask."""
    col = jnp.arange(n_cols)
    return (col >= ranges[..., 1:2]) & (col < ranges[..., 2:3])


def tiled_vjp(forward: Callable, backward: Callable, with_lse: bool = False) -> Callable:
    """The differentiable attention both tiled kernels (flash, mosaic) expose, from their passes:

    - ``forward(q, k, v, segment_ids, metadata, scale, interpret) -> (out [B, T, H, D], lse [B, H,
      T])``, the log-sum-exp in base 2 (of the logits times log2 e);
    - ``backward(q, k, v, segment_ids, metadata, scale, interpret, lse, delta, do) -> (dq, dk,
      dv)``.

    The forward saves its inputs, output and log-sum-exp; the backward computes the softmax row term
    once and hands it to the kernel's dQ and dK/dV passes. Segment ids and metadata get no
    cotangent.

    ``with_lse``: the attention returns ``(out, lse)``, the log-sum-exp in natural units, and both
    are differentiable: partial results over spans of keys merge by their log-sum-exp (a split
    row's ring, seqjax.model.context). The log-sum-exp's cotangent enters as a correction to the
    row term: d lse / d logit = p, so the logits' cotangent p (dp - delta) gains p dlse.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def attention(q, k, v, segment_ids, metadata, scale, interpret):
        return attention_fwd(q, k, v, segment_ids, metadata, scale, interpret)[0]

    def attention_fwd(q, k, v, segment_ids, metadata, scale, interpret):
        out, lse = forward(q, k, v, segment_ids, metadata, scale, interpret)
        result = (out, lse * LN_2) if with_lse else out
        return result, (q, k, v, segment_ids, metadata, out, lse)

    def attention_bwd(scale, interpret, residuals, cotangent):
        q, k, v, segment_ids, metadata, out, lse = residuals
        do, dlse = cotangent if with_lse else (cotangent, None)
        # delta_i = sum_d out_i * dout_i: the softmax-backward row term, one fused XLA reduction,
        # [B, H, T].
        delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
        if dlse is not None:
            delta = delta - dlse.astype(jnp.float32)
        dq, dk, dv = backward(q, k, v, segment_ids, metadata, scale, interpret, lse, delta, do)
        return dq, dk, dv, None, None

    attention.defvjp(attention_fwd, attention_bwd)
    return attention
