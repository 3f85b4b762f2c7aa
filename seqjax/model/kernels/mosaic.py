"""Flash attention on Pallas's Mosaic GPU backend for Hopper, skipping the tiles packing leaves empty
(``model.attention: pallas_mosaic``).

The same three passes and the same per-tile ranges as :mod:`seqjax.model.kernels.flash` (Triton),
written for the H100's own machinery instead of through Triton:

- each CTA runs two warpgroups: a producer that streams tiles from global memory into a ring of shared-memory
  slots with TMA copies (``copy_gmem_to_smem``, one mbarrier per slot and operand), and a consumer
  that waits on a slot's barrier, multiplies with ``wgmma`` (accumulators in registers), and hands
  the slot back through a "consumed" barrier, so the next loads overlap this tile's math;
- forward: one CTA per (query block, head, row), streaming key/value tiles through an online softmax in base 2;
- dQ: the same grid, streaming key/value tiles again;
- dK/dV: one CTA per (key block, kv head, row), streaming query, dO, log-sum-exp and delta tiles of every query
  head of its GQA group, so dK/dV are summed in registers with no atomics.

Every loop runs over :class:`~seqjax.model.kernels.block_ranges.BlockMetadata`'s ranges ``(lo,
full_lo, full_hi, hi)`` (per-tile metadata read as loop bounds): tiles outside a document (or a
sliding window's band) are never loaded; inside ``[full_lo, full_hi)`` no mask is built; edge tiles
apply :func:`seqjax.model.mask.allowed`, contract 2's rule. Tiles are 64 x 64 by default (one
warpgroup's wgmma M); D is 64 or 128.

Variants a GPU sweep weighs (:class:`Variant`; the interpreter checks each): the producer's ring has
``SLOTS`` = 2 stages by default, 3 or 4 as a deeper TMA pipeline (``slots=``); and the forward may run
two consumer warpgroups in ping-pong (``consumers=2``): a CTA takes two query blocks, the producer
streams the union of their ranges once for both, and the consumers take turns on a shared barrier so
that one's softmax overlaps the other's matmuls (FlashAttention-3's inter-warpgroup schedule). The
backward passes keep one consumer. The forward may also overlap each tile's softmax with the next
tile's QK^T inside one warpgroup (``overlap=True``, FlashAttention-3's intra-warpgroup pipelining):
a step carries S, issues the next wgmma before the softmax and waits for it after; the last step
re-issues its own tile (one QK^T of ``hi - lo`` a CTA is spent, so no wgmma sits under a branch).
The interpreter runs each wgmma to completion, so it checks the bookkeeping but not the overlap.
The tile shapes are a variant too: the forward's key tiles may be 128 rather than 64 (``key_block=``,
metadata from :func:`mosaic_blocks`); a query tile stays 64, one warpgroup's wgmma M.
Until a GPU measures it, ``auto`` does not pick this kernel.

Interpret mode (``interpret=True``, or ``None`` off a GPU) runs the same kernels on a CPU through
Pallas's Mosaic GPU interpreter, which is how CI checks their numbers; it also accepts float32
there, where a GPU's wgmma would round to TF32, so the tests can be tight. On a GPU the dtypes are
bfloat16 and float16.

The interpreter runs each warpgroup as a computation on XLA's CPU thread pool, inside a callback
that holds a pool thread itself, and a warpgroup waiting at a barrier holds its thread too. So it
needs ``1 + THREADS`` pool threads: with fewer, the producer can wait forever for a thread its
blocked consumer holds (seen on 2-core machines, at random). XLA sizes the pool from ``PJRT_NPROC``
(else ``NPROC``, else the CPUs this process may use), read once when JAX starts; interpret mode
refuses a smaller pool in one line instead of hanging (the tests set 4)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from seqjax.core.errors import ConfigError
from seqjax.model.kernels import mosaic_tiles as mt
from seqjax.model.kernels.block_ranges import (
    MOSAIC_BLOCKS,
    BlockMetadata,
    BlockSizes,
    kernel_metadata,
    tiled_vjp,
    window_operand,
)
from seqjax.model.mask import check_attention_inputs

BLOCK = mt.BLOCK  # query and key tile rows, every pass: one warpgroup's wgmma M
SLOTS = 2  # stages of the producer's shared-memory ring (the default; a variant takes more)
SLOT_CHOICES = (2, 3, 4)  # the deeper TMA pipelines a GPU sweep chooses among
THREADS = 2  # warpgroups per CTA: the TMA producer and the wgmma consumer (one more: the forward's ping-pong)
CONSUMER_CHOICES = (1, 2)  # the forward's consumer warpgroups a CTA (Variant.consumers)
KEY_BLOCK_CHOICES = (64, 128)  # the forward's key tile rows (Variant.key_block): S is [64, key_block]
LOG2_E = math.log2(math.e)
MASKED = -1e30  # a finite -inf: masked logits and the running max start here (no exp2(-inf - -inf) = NaN)
BLOCK_SIZES = MOSAIC_BLOCKS
HEAD_DIMS = (64, 128)
GPU_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How the kernel is built, a static argument of every pass: ``interpret`` (Pallas's Mosaic GPU interpreter),
    ``slots``, the stages of the producers' shared-memory rings (a deeper TMA pipeline keeps
    more tiles in flight, at ``slots x`` the ring's shared memory: 2 stages of k, v at D = 128 in
    bfloat16 take 64 KiB), and ``consumers``, the forward's consumer warpgroups a CTA: 1, or 2 in
    ping-pong (FlashAttention-3's schedule: two query blocks a CTA share each key tile the producer
    loads, and one consumer's softmax runs while the other's matmuls do), and ``overlap``: each consumer
    issues the next key tile's QK^T before this tile's softmax and waits for it after (FlashAttention-3's
    intra-warpgroup pipelining), and ``key_block``, the forward's key tile: 64, or 128 (a [64, 128] S tile,
    half the steps and barrier round trips, twice the registers for S and P)."""

    interpret: bool
    slots: int = SLOTS
    consumers: int = 1
    overlap: bool = False
    key_block: int = BLOCK


def mosaic_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float | None = None,
                     interpret: bool | None = None, metadata: BlockMetadata | None = None,
                     window=None, slots: int = SLOTS, consumers: int = 1, overlap: bool = False,
                     key_block: int = BLOCK) -> jax.Array:
    """Segment-masked causal attention. q: [B, T, H, D]; k, v: [B, T, Hkv, D], Hkv dividing H; D 64 or 128.

    ``segment_ids`` [B, T]: contract 2 (0 = padding). T is padded to a multiple of 64 with segment 0
    (no tile visits padding) and sliced back. ``metadata``: :func:`block_metadata` for these ids
    with :data:`BLOCK_SIZES` (and the layer's window), computed once per forward; computed here when
    omitted, from ``window``. ``slots``, ``consumers``, ``overlap`` and ``key_block``: the :class:`Variant` a GPU
    sweep picks among (``consumers=2`` needs T padded to a multiple of 128, two query blocks a CTA; ``key_block``
    128 needs metadata from :func:`mosaic_blocks` (128))."""
    check_attention_inputs(q, k, v, segment_ids)
    b, t, h, d = q.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    threads = THREADS + consumers - 1
    if interpret and (pool := mt.xla_cpu_threads()) < 1 + threads:
        # a SeqjaxError: the commands say it in one line (docs/gpu.md), not a traceback
        raise ConfigError(f"model.attention=pallas_mosaic: interpret mode (no GPU) needs {1 + threads} XLA CPU "
                          f"threads and this process has {pool} (it would hang); set PJRT_NPROC={2 + threads} "
                          "before JAX starts")
    if d not in HEAD_DIMS:
        raise ValueError(f"mosaic_attention: head_dim {d}, expected one of {HEAD_DIMS} (wgmma tiles)")
    allowed_dtypes = GPU_DTYPES + ((jnp.float32,) if interpret else ())
    if q.dtype not in map(jnp.dtype, allowed_dtypes):
        raise ValueError(f"mosaic_attention: dtype {q.dtype}, expected bfloat16 or float16"
                         + (" (float32 only in interpret mode)" if not interpret else " or float32"))
    if key_block not in KEY_BLOCK_CHOICES:
        raise ValueError(f"mosaic_attention: key_block {key_block}, expected one of {KEY_BLOCK_CHOICES}")
    sizes = mosaic_blocks(key_block)
    metadata = kernel_metadata("mosaic_attention", segment_ids, metadata, window, sizes, sizes)
    padded = metadata.seq_len
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - t)))
    scale = float(d**-0.5 if scale is None else scale)
    if slots not in SLOT_CHOICES:
        raise ValueError(f"mosaic_attention: slots {slots}, expected one of {SLOT_CHOICES}")
    if consumers not in CONSUMER_CHOICES or padded % (consumers * BLOCK):
        raise ValueError(f"mosaic_attention: consumers {consumers} with T padded to {padded}; expected one of "
                         f"{CONSUMER_CHOICES}, and T padded to a multiple of {consumers * BLOCK}")
    out = _attention(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), segment_ids, metadata, scale,
                     Variant(bool(interpret), slots, consumers, bool(overlap), key_block))
    return out[:, :t]


def mosaic_blocks(key_block: int = BLOCK) -> BlockSizes:
    """The tiles :func:`mosaic_attention`'s metadata is computed for: 64 x ``key_block`` forward, 64 x 64 backward."""
    return dataclasses.replace(BLOCK_SIZES, block_k=key_block)


# ---------------------------------------------------------------------------------------------- forward


def _forward(q, k, v, segment_ids, metadata: BlockMetadata, scale: float, variant: Variant):
    """Output [B, T, H, D] and the base-2 log-sum-exp [B, H, T] the backward passes reuse: one CTA per query
    block (``consumers=1``), or per pair of query blocks, one consumer warpgroup each, in ping-pong
    (``consumers=2``)."""
    b, t, h, d = q.shape
    group, c, kb = h // k.shape[2], variant.consumers, variant.key_block

    def body(ranges, window_ref, seg, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, seg_q, k_ring, v_ring,
             seg_ring, lse_smem, p_smem, q_ready, k_ready, v_ready, s_ready, consumed, *turn):
        pair, hd, r = lax.axis_index("blocks"), lax.axis_index("heads"), lax.axis_index("rows")
        lo, hi = _union(ranges, r, pair, c)
        mt.produce_keys((lo, hi), seg, k_ref, v_ref, (k_ring, v_ring, seg_ring), (k_ready, v_ready, s_ready),
                        consumed, group, variant.slots, producer=c, block=kb)

        for w in range(c):  # (each consumer its own query block, tiles and barriers: w is static)
            pl.when(lax.axis_index("wg") == w)(lambda w=w: _consume_keys(
                (ranges, window_ref, seg, q_ref, o_ref, lse_ref), (r, hd, pair * c + w, lo, hi),
                (q_smem.at[w], seg_q.at[w], lse_smem.at[w], p_smem.at[w], (q_ready.at[2 * w], q_ready.at[2 * w + 1])),
                (k_ring, v_ring, seg_ring, k_ready, v_ready, s_ready, consumed), scale * LOG2_E, variant,
                _turns(turn, w, c)))

    n = variant.slots
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)),
        grid=(t // (c * BLOCK), h, b), grid_names=("blocks", "heads", "rows"), num_threads=c + 1, thread_name="wg",
        scratch_types=[mt.tile(q.dtype, d, c), plgpu.SMEM((c, BLOCK), jnp.int32), mt.tile(k.dtype, d, n, kb),
                       mt.tile(v.dtype, d, n, kb), plgpu.SMEM((n, kb), jnp.int32), plgpu.SMEM((c, BLOCK), jnp.float32),
                       mt.tile(v.dtype, kb, c), plgpu.Barrier(num_barriers=2 * c),
                       *[plgpu.Barrier(num_barriers=n)] * 3, plgpu.Barrier(num_arrivals=c, num_barriers=n),
                       *([plgpu.Barrier(num_arrivals=c)] if c > 1 else [])],
        interpret=mt.interpret_params(variant))
    return kernel(metadata.fwd_kv, window_operand(metadata), segment_ids, q, k, v)


def _union(ranges, r, pair, c: int):
    """The key tiles [lo, hi) the producer streams for a CTA's ``c`` query blocks: the union of their ranges (an
    empty range, (0, 0, 0, 0), adds nothing)."""
    if c == 1:
        return ranges[r, pair, 0], ranges[r, pair, 3]
    (lo0, hi0), (lo1, hi1) = ((ranges[r, pair * 2 + w, 0], ranges[r, pair * 2 + w, 3]) for w in range(2))
    lo = jnp.where(hi0 == lo0, lo1, jnp.where(hi1 == lo1, lo0, jnp.minimum(lo0, lo1)))
    return lo, jnp.maximum(hi0, hi1)


def _turns(turn, w: int, c: int):
    """Consumer ``w``'s ping-pong (``c`` = 2): ``(first, between, last)``, the syncs on the shared ``turn`` barrier
    before its loop, between its steps' phases and after its loop; consumer 1 starts one sync behind, so its
    softmax runs while consumer 0's matmuls do, and the other way round. None for one consumer."""
    if c == 1:
        return None

    def sync():
        plgpu.barrier_arrive(turn[0])
        plgpu.barrier_wait(turn[0])

    nothing = lambda: None  # noqa: E731
    return (sync if w == 1 else nothing), sync, (sync if w == 0 else nothing)


def _consume_keys(refs, where, own, rings, qk_scale, variant, turns):
    """A consumer warpgroup of the forward: its query block against the key tiles [lo, hi) the producer streams,
    through an online softmax; tiles outside the block's own range (another consumer's) are masked edge tiles,
    and its own ``[full_lo, full_hi)`` runs without a mask."""
    ranges, window_ref, seg, q_ref, o_ref, lse_ref = refs
    r, hd, i, lo, hi = where
    q_smem, seg_q, lse_smem, p_smem, q_ready = own
    queries = pl.ds(i * BLOCK, BLOCK)
    plgpu.copy_gmem_to_smem(q_ref.at[r, queries, hd], q_smem, q_ready[0])
    plgpu.copy_gmem_to_smem(seg.at[r, queries], seg_q, q_ready[1])
    plgpu.barrier_wait(q_ready[0])
    plgpu.barrier_wait(q_ready[1])
    first, between, last = turns or (None, None, None)
    step, qk = _key_steps((q_smem, mt.rows(seg_q, 1), window_ref[0], p_smem), (i, hi), rings, qk_scale, variant,
                          between or (lambda: None))
    rows = plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    init = (plgpu.layout_cast(jnp.zeros((BLOCK, q_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
            rows + MASKED, rows)
    if variant.overlap:  # tile lo's S before the loops (an empty [lo, hi) never reads it)
        k_ready = rings[3]  # (k_ring, v_ring, seg_ring, k_ready, v_ready, s_ready, consumed)
        pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_ready.at[0]))
        init = (*init, qk(0))
    if first:
        first()
    # (the own full range clipped to the streamed tiles: an empty own range leaves every streamed tile masked)
    full_lo = jnp.clip(ranges[r, i, 1], lo, hi)
    acc, m, row_sum, *_ = mt.three_loops((lo, full_lo, jnp.clip(ranges[r, i, 2], full_lo, hi), hi), step, init)
    if last:
        last()
    empty = row_sum == 0.0  # padding queries and queries with no key: zeros, never NaN
    safe = jnp.where(empty, 1.0, row_sum)
    mt.store(acc / lax.broadcast_in_dim(safe, acc.shape, (0,)), q_smem, o_ref.at[r, queries, hd])
    mt.store(jnp.where(empty, 0.0, m + jnp.log2(safe)), lse_smem, lse_ref.at[r, hd, queries])
    plgpu.wait_smem_to_gmem(0)


def _key_steps(own, where, rings, qk_scale, variant, between):
    """A forward consumer's step over key tile j, and its QK^T of a ring slot. Plain: QK^T, softmax, P V. With
    ``variant.overlap`` the step takes tile j's S from the step before (the carry's last entry), issues tile
    j + 1's QK^T before tile j's softmax and waits for it only after, so the two overlap on a GPU."""
    q_smem, seg_rows, window, p_smem = own
    i, hi = where
    k_ring, v_ring, seg_ring, k_ready, v_ready, s_ready, consumed = rings
    kb = variant.key_block

    def qk(slot):
        return mt.matmul(q_smem, k_ring.at[slot].T, (BLOCK, kb)) * qk_scale

    def softmax(masked, j, slot, s, carry):  # tile j's online softmax: P, and the running (acc, max, sum)
        acc, m, row_sum = carry
        mask = None
        if masked:
            plgpu.barrier_wait(s_ready.at[slot])
            mask = mt.tile_mask(seg_rows, mt.rows(seg_ring.at[slot], 0), i * BLOCK, j * kb, window, True, kb)
            s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp2(s - mt.broadcast(m_new, 0, kb))
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        correction = jnp.exp2(m - m_new)
        return p, (acc * lax.broadcast_in_dim(correction, acc.shape, (0,)), m_new,
                   row_sum * correction + p.sum(axis=1))

    def pv(masked, slot, p, carry):  # P V into the accumulator; the slot goes back to the producer
        acc, m, row_sum = carry
        plgpu.barrier_wait(v_ready.at[slot])
        if not masked:
            plgpu.barrier_wait(s_ready.at[slot])  # every ready barrier is waited once per fill
        between()  # and back
        acc = mt.accumulate(acc, p, p_smem, v_ring.at[slot])
        plgpu.barrier_arrive(consumed.at[slot])
        return acc, m, row_sum

    def step(masked, j, n, carry):
        slot = lax.rem(n, variant.slots)
        plgpu.barrier_wait(k_ready.at[slot])
        s = qk(slot)
        between()  # the tensor cores go to the other consumer while this one takes its softmax
        p, carry = softmax(masked, j, slot, s, carry)
        return pv(masked, slot, p, carry)

    def overlapped_step(masked, j, n, carry):
        *carry, s = carry
        slot, following = lax.rem(n, variant.slots), j + 1 < hi
        after = jnp.where(following, lax.rem(n + 1, variant.slots), slot)  # (the last step: its own tile again)
        # (in ping-pong, the turn before the wait: the producer's next fill may await the other consumer's
        # last slot, which it frees only after this turn)
        between()
        pl.when(following)(lambda: plgpu.barrier_wait(k_ready.at[after]))

        def issue(s_next):
            plgpu.wgmma(s_next, q_smem, k_ring.at[after].T)  # asynchronous: it runs during the softmax below
            out = softmax(masked, j, slot, s, tuple(carry))
            plgpu.wgmma_wait(0)
            return out, s_next[...] * qk_scale

        (p, carry), s_next = pl.run_scoped(issue, plgpu.ACC((BLOCK, kb), jnp.float32))
        return (*pv(masked, slot, p, carry), s_next)

    return (overlapped_step if variant.overlap else step), qk


# ---------------------------------------------------------------------------------------------- backward


def _dq(q, k, v, segment_ids, metadata, scale, variant, lse, delta, do):
    b, t, h, d = q.shape
    group = h // k.shape[2]
    qk_scale = scale * LOG2_E

    def body(ranges, window_ref, seg, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
             q_smem, do_smem, seg_q, lse_smem, delta_smem, k_ring, v_ring, seg_ring, ds_smem, q_ready, k_ready,
             v_ready, s_ready, consumed):
        i, hd, r = lax.axis_index("blocks"), lax.axis_index("heads"), lax.axis_index("rows")
        mt.produce_keys(_union(ranges, r, i, 1), seg, k_ref, v_ref, (k_ring, v_ring, seg_ring),
                        (k_ready, v_ready, s_ready), consumed, group, variant.slots)

        @pl.when(lax.axis_index("wg") == 0)
        def _consumer():
            queries = pl.ds(i * BLOCK, BLOCK)
            loads = ((q_ref.at[r, queries, hd], q_smem), (do_ref.at[r, queries, hd], do_smem),
                     (seg.at[r, queries], seg_q), (lse_ref.at[r, hd, queries], lse_smem),
                     (delta_ref.at[r, hd, queries], delta_smem))
            for n, (src, dst) in enumerate(loads):
                plgpu.copy_gmem_to_smem(src, dst, q_ready.at[n])
            for n in range(len(loads)):
                plgpu.barrier_wait(q_ready.at[n])
            seg_rows, window = mt.rows(seg_q, 1), window_ref[0]
            lse_rows, delta_rows = mt.broadcast(mt.rows(lse_smem, 1), 0), mt.broadcast(mt.rows(delta_smem, 1), 0)

            def step(masked, j, n, dq):
                slot = lax.rem(n, variant.slots)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(s_ready.at[slot])
                p = jnp.exp2(mt.matmul(q_smem, k_ring.at[slot].T, (BLOCK, BLOCK)) * qk_scale - lse_rows)
                if masked:
                    mask = mt.tile_mask(seg_rows, mt.rows(seg_ring.at[slot], 0), i * BLOCK, j * BLOCK, window, True)
                    p = jnp.where(mask, p, 0.0)
                ds = p * (mt.matmul(do_smem, v_ring.at[slot].T, (BLOCK, BLOCK)) - delta_rows)
                dq = mt.accumulate(dq, ds, ds_smem, k_ring.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                return dq

            init = plgpu.layout_cast(jnp.zeros((BLOCK, d), jnp.float32), plgpu.Layout.WGMMA)
            dq = mt.three_loops(mt.bounds(ranges, r, i), step, init)
            mt.store(dq * scale, q_smem, dq_ref.at[r, queries, hd])
            plgpu.wait_smem_to_gmem(0)

    n = variant.slots
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(t // BLOCK, h, b), grid_names=("blocks", "heads", "rows"), num_threads=THREADS, thread_name="wg",
        scratch_types=[mt.one_tile(q.dtype, d), mt.one_tile(q.dtype, d), plgpu.SMEM((BLOCK,), jnp.int32),
                       plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((BLOCK,), jnp.float32),
                       mt.tile(k.dtype, d, n), mt.tile(v.dtype, d, n), plgpu.SMEM((n, BLOCK), jnp.int32),
                       mt.one_tile(k.dtype, BLOCK), plgpu.Barrier(num_barriers=5),
                       *[plgpu.Barrier(num_barriers=n)] * 4],
        interpret=mt.interpret_params(variant))
    return kernel(metadata.dq_kv, window_operand(metadata), segment_ids, q, k, v, do, lse, delta)


def _dkv(q, k, v, segment_ids, metadata, scale, variant, lse, delta, do):
    (b, t, h, d), hkv = q.shape, k.shape[2]
    group, qk_scale = h // hkv, scale * LOG2_E

    def body(ranges, window_ref, seg, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
             k_smem, v_smem, seg_k, q_ring, do_ring, seg_ring, lse_ring, delta_ring, t_smem, k_ready, q_ready,
             do_ready, s_ready, l_ready, d_ready, consumed):
        j, kvh, r = lax.axis_index("blocks"), lax.axis_index("heads"), lax.axis_index("rows")
        lo, hi = ranges[r, j, 0], ranges[r, j, 3]
        per_head = hi - lo

        def query_tile(start, step):  # steps run over (head of the group, query block), heads outermost
            g, i = lax.div(step, jnp.maximum(per_head, 1)), start + lax.rem(step, jnp.maximum(per_head, 1))
            queries, head = pl.ds(i * BLOCK, BLOCK), kvh * group + g
            return ((q_ref.at[r, queries, head], q_ring, q_ready), (do_ref.at[r, queries, head], do_ring, do_ready),
                    (seg.at[r, queries], seg_ring, s_ready), (lse_ref.at[r, head, queries], lse_ring, l_ready),
                    (delta_ref.at[r, head, queries], delta_ring, d_ready))

        @pl.when(lax.axis_index("wg") == 1)
        def _producer():
            mt.produce(lo, group * per_head, query_tile, consumed, variant.slots)

        @pl.when(lax.axis_index("wg") == 0)
        def _consumer():
            keys = pl.ds(j * BLOCK, BLOCK)
            for n, (src, dst) in enumerate(((k_ref.at[r, keys, kvh], k_smem), (v_ref.at[r, keys, kvh], v_smem),
                                            (seg.at[r, keys], seg_k))):
                plgpu.copy_gmem_to_smem(src, dst, k_ready.at[n])
            for n in range(3):
                plgpu.barrier_wait(k_ready.at[n])
            seg_rows, window = mt.rows(seg_k, 1), window_ref[0]

            def step(masked, i, n, carry):
                dk, dv = carry
                slot = lax.rem(n, variant.slots)
                for ready in (q_ready, do_ready, s_ready, l_ready, d_ready):
                    plgpu.barrier_wait(ready.at[slot])
                # transposed tiles: rows are this block's keys, columns the streamed queries
                lse_cols = mt.broadcast(mt.rows(lse_ring.at[slot], 0), 1)
                p_t = jnp.exp2(mt.matmul(k_smem, q_ring.at[slot].T, (BLOCK, BLOCK)) * qk_scale - lse_cols)
                if masked:
                    mask = mt.tile_mask(seg_rows, mt.rows(seg_ring.at[slot], 0), j * BLOCK, i * BLOCK, window, False)
                    p_t = jnp.where(mask, p_t, 0.0)
                dv = mt.accumulate(dv, p_t, t_smem, do_ring.at[slot])
                delta_cols = mt.broadcast(mt.rows(delta_ring.at[slot], 0), 1)
                ds_t = p_t * (mt.matmul(v_smem, do_ring.at[slot].T, (BLOCK, BLOCK)) - delta_cols)
                dk = mt.accumulate(dk, ds_t, t_smem, q_ring.at[slot])  # t_smem free again: dV's wgmma waited
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            def head(g, carry):
                return mt.three_loops(mt.bounds(ranges, r, j), step, carry, offset=g * per_head)

            zeros = plgpu.layout_cast(jnp.zeros((BLOCK, d), jnp.float32), plgpu.Layout.WGMMA)
            dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
            mt.store(dk * scale, k_smem, dk_ref.at[r, keys, kvh])
            mt.store(dv, v_smem, dv_ref.at[r, keys, kvh])
            plgpu.wait_smem_to_gmem(0)

    n = variant.slots
    kernel = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(t // BLOCK, hkv, b), grid_names=("blocks", "heads", "rows"), num_threads=THREADS, thread_name="wg",
        scratch_types=[mt.one_tile(k.dtype, d), mt.one_tile(v.dtype, d), plgpu.SMEM((BLOCK,), jnp.int32),
                       mt.tile(q.dtype, d, n), mt.tile(do.dtype, d, n), plgpu.SMEM((n, BLOCK), jnp.int32),
                       plgpu.SMEM((n, BLOCK), jnp.float32), plgpu.SMEM((n, BLOCK), jnp.float32),
                       mt.one_tile(q.dtype, BLOCK), plgpu.Barrier(num_barriers=3),
                       *[plgpu.Barrier(num_barriers=n)] * 6],
        interpret=mt.interpret_params(variant))
    return kernel(metadata.dkv_q, window_operand(metadata), segment_ids, q, k, v, do, lse, delta)


# ---------------------------------------------------------------------------------------------- custom VJP


def _backward(q, k, v, segment_ids, metadata, scale, variant, lse, delta, do):
    dq = _dq(q, k, v, segment_ids, metadata, scale, variant, lse, delta, do)
    dk, dv = _dkv(q, k, v, segment_ids, metadata, scale, variant, lse, delta, do)
    return dq, dk, dv


_attention = tiled_vjp(_forward, _backward)
