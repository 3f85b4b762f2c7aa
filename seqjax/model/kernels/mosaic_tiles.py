"""The pieces the Mosaic GPU kernel's passes (seqjax.model.kernels.mosaic) share: shared-memory
tiles in wgmma's layout, the producer warpgroup's TMA ring, wgmma into a register accumulator,
contract 2 on one tile, the loops over a block's ranges, and the size of XLA's CPU thread pool
the interpreter needs."""

from __future__ import annotations

import os

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from seqjax.model.kernels.block_ranges import MOSAIC_BLOCKS
from seqjax.model.mask import allowed

BLOCK = MOSAIC_BLOCKS.block_q  # query and key tile rows, every pass: one warpgroup's wgmma M


def tile(dtype, d: int, slots: int, rows: int = BLOCK):
    """A ring of ``slots`` [rows, d] shared-memory tiles in wgmma's layout: 8-row tiles, swizzled
    128 bytes wide."""
    columns = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        (slots, rows, d),
        dtype,
        transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(128)),
    )


def one_tile(dtype, d: int):
    columns = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        (BLOCK, d),
        dtype,
        transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(128)),
    )


def produce(start, count, copies, consumed, slots: int):
    """The producer warpgroup: for steps ``0..count``, wait until the consumer has freed the step's
    slot (after the first ``slots`` steps), then issue ``copies(step)``: (global source, shared
    ring, ready barrier) triples."""

    @pl.loop(0, count)
    def _(step):
        slot = lax.rem(step, slots)

        @pl.when(step >= slots)
        def _wait_free():
            plgpu.barrier_wait(consumed.at[slot])

        for src, ring, ready in copies(start, step):
            plgpu.copy_gmem_to_smem(src, ring.at[slot], ready.at[slot])


def produce_keys(bounds, seg, k_ref, v_ref, rings, ready, consumed, group: int, slots: int,
                 producer: int = 1, block: int = BLOCK):
    """The forward's and dQ's producer warpgroup (warpgroup ``producer``): the key, value and
    segment-id tiles (``block`` keys each) ``bounds`` = (lo, hi) of this CTA's query blocks, into
    ``rings`` (k, v, ids) on ``ready`` (one barrier array each)."""
    hd, r = lax.axis_index("heads"), lax.axis_index("rows")
    lo, hi = bounds
    kv = lax.div(hd, jnp.int32(group))

    def key_tile(start, step):
        keys = pl.ds((start + step) * block, block)
        return tuple(
            zip((k_ref.at[r, keys, kv], v_ref.at[r, keys, kv], seg.at[r, keys]), rings, ready)
        )

    @pl.when(lax.axis_index("wg") == producer)
    def _producer():
        produce(lo, hi - lo, key_tile, consumed, slots)


def matmul(a, b, shape):
    """``a @ b`` on the tensor cores into a float32 register accumulator of ``shape``."""

    def run(acc):
        plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def accumulate(acc, a, staging, b):
    """``acc + a @ b`` with ``a`` a register tile (P, or dS): staged through the shared tile
    ``staging`` first.

    Shortcuts, stated: wgmma could take ``a`` from registers and accumulate into ``acc`` in place
    (``run_state(..)(ACC.init(acc))``), as FlashAttention-3 does, but Pallas's Mosaic GPU
    interpreter runs neither (a wgmma operand must be a shared-memory allocation; a ``run_state``
    accumulator leaks its effect), and CI checks this kernel only through that interpreter. The
    extra store and add per tile are what a GPU profile should weigh first."""
    staging[...] = a.astype(staging.dtype)
    plgpu.commit_smem()
    return acc + matmul(staging, b, acc.shape)


def rows(ref, layout_axis: int):
    """A [BLOCK] vector from shared memory, laid out to broadcast along ``layout_axis`` of a wgmma
    tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(layout_axis))


def broadcast(x, axis: int, columns: int = BLOCK):
    return lax.broadcast_in_dim(x, (BLOCK, columns), (axis,))


def tile_mask(seg_rows, seg_cols, row_start, col_start, window, rows_are_queries: bool,
              columns: int = BLOCK):
    """Contract 2 on one [BLOCK, columns] tile; rows are queries (forward, dQ) or keys (dK/dV)."""
    shape = (BLOCK, columns)
    row = row_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    col = col_start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    seg_r, seg_c = broadcast(seg_rows, 0, columns), broadcast(seg_cols, 1, columns)
    if rows_are_queries:
        return allowed(seg_r, seg_c, row, col, window)
    return allowed(seg_c, seg_r, col, row, window)


def bounds(ranges_ref, b, blk):
    """Block ``blk`` of row ``b``'s range ``(lo, full_lo, full_hi, hi)``, read from the metadata."""
    return tuple(ranges_ref[b, blk, c] for c in range(4))


def three_loops(bounds, step, carry, offset=0):
    """``step(masked, i, n)`` over ``bounds`` ``(lo, full_lo, full_hi, hi)``: masked edge, unmasked
    middle, masked edge; ``n`` counts steps from the first (plus ``offset``), which is what picks
    the ring slot."""
    lo, full_lo, full_hi, hi = bounds

    def loop(start, stop, masked, carry):
        return lax.fori_loop(start, stop, lambda i, c: step(masked, i, offset + i - lo, c), carry)

    carry = loop(lo, full_lo, True, carry)
    carry = loop(full_lo, full_hi, False, carry)
    return loop(full_hi, hi, True, carry)


def store(value, smem, dst):
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)


def xla_cpu_threads() -> int:
    """The size of XLA's CPU thread pool, as its CPU client sizes it: PJRT_NPROC, else NPROC, else
    the CPUs this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        if os.environ.get(name, "").strip().isdigit():
            return int(os.environ[name])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def interpret_params(variant):
    return plgpu.InterpretGPUParams() if variant.interpret else None
