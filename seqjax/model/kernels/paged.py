"""Decode attention over a paged KV cache in Pallas: each row's one new query against the keys and
values its page table points at (seqjax.engine, ``engine.attention=pallas``).

One program per (row, key/value head). The query heads that share the kv head (GQA) form the
program's query tile, padded to 16 rows (Triton's tile rule); it streams the row's pages in blocks
of ``pages_per_block`` pages, each block's page ids read from the page table and its keys and
values gathered straight from the pool (no copy of the row's cache is ever made), through an online
softmax in float32. A sliding layer's loop starts at the first block its window reaches, and the
loop ends at the row's length, so a program reads only the pages its query can see.

    pool     [pages, Hkv, page_size, D]      table row: P0 P1 P4 P7 -   (length 3.5 pages)
    program (row, kv head h): blocks of pages_per_block pages, P0 P1 | P4 P7, masked past length

The mask is contract 2's :func:`seqjax.model.mask.allowed`, the sequence as one segment and its
places as indices (the XLA path's :func:`seqjax.model.mask.page_mask`, tile by tile). The kernel
returns the output and its log-sum-exp; attention sinks (gpt-oss) are applied through it, as the
flash kernel's are. A row of length 0 (an idle slot) gives zeros.

It lowers through Pallas's Triton backend on NVIDIA GPUs and runs in Pallas's interpreter on a CPU,
where CI checks its numbers against the XLA path. Without split-K: a decode step of B rows has
B x Hkv programs, enough for a GPU at the batch sizes the engine runs (its slots)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqjax.model.kernels.flash import MASKED, _dot, _head_pad
from seqjax.model.mask import allowed

NO_WINDOW = 2**30  # (a window no sequence reaches: every written place within it)
DEFAULT_BLOCK_TOKENS = 64  # keys a loop step reads: pages_per_block x page_size, at least 16


def paged_attention(q: jax.Array, keys: jax.Array, values: jax.Array, page_table: jax.Array,
                    lengths: jax.Array, *, scale: float, window=None, layer=None,
                    pages_per_block: int | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(out [B, H, D], lse [B, H] float32): each row's query ``q`` [B, H, D], the last of the
    ``lengths`` [B] places written to the row's pages (0: an idle row, zeros), attending to places
    0..lengths - 1 (within ``window``, an int or a traced scalar) of ``keys``/``values`` [pages, Hkv,
    page_size, D] through ``page_table`` [B, W] (an entry of ``pages`` or more: no page). With
    ``layer`` (an int or a traced scalar), ``keys``/``values`` are every layer's pools stacked [A,
    pages, Hkv, page_size, D] and the kernel reads layer ``layer``'s in place: the stack is one pool
    of A x pages pages (a free reshape), the page table moved to the layer's."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if layer is not None:
        pages = keys.shape[1]
        keys, values = (a.reshape(-1, *a.shape[2:]) for a in (keys, values))
        page_table = jnp.where(page_table < pages, page_table + layer * pages, keys.shape[0])
    b, h, d = q.shape
    pages, hkv, size, _ = keys.shape
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {hkv}")
    per_block = pages_per_block or max(1, DEFAULT_BLOCK_TOKENS // size)
    per_block = max(per_block, -(-16 // size))  # (a tile of at least 16 keys)
    group = h // hkv
    rows_pad, d_pad = max(16, pl.next_power_of_2(group)) - group, _head_pad(d)
    qg = jnp.pad(q.reshape(b, hkv, group, d), ((0, 0), (0, 0), (0, rows_pad), (0, d_pad)))
    if d_pad:  # (a head_dim Triton cannot tile: the pool padded, a tiny model's cost)
        keys, values = (jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, d_pad))) for a in (keys, values))
    width = -(-page_table.shape[1] // per_block) * per_block
    table = jnp.where(page_table < pages, page_table, 0).astype(jnp.int32)  # (unused entries: never read)
    table = jnp.pad(table, ((0, 0), (0, width - page_table.shape[1])))
    window = NO_WINDOW if window is None else window
    scalars = jnp.stack([lengths.astype(jnp.int32), jnp.broadcast_to(jnp.asarray(window, jnp.int32), (b,))], 1)
    out, lse = _call(qg, keys, values, table, scalars, scale=scale, per_block=per_block, interpret=bool(interpret))
    out = out[:, :, :group, :d].reshape(b, h, d)
    return out, lse[:, :, :group].reshape(b, h)


@functools.partial(jax.jit, static_argnames=("scale", "per_block", "interpret"))
def _call(qg, keys, values, table, scalars, *, scale, per_block, interpret):
    b, hkv, rows, d = qg.shape
    pages, _, size, _ = keys.shape
    pool = pl.BlockSpec((pages, None, size, d), lambda i, j: (0, j, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, per_block=per_block),
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((None, table.shape[1]), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, 2), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)), pool, pool],
        out_specs=[pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct(qg.shape, qg.dtype), jax.ShapeDtypeStruct((b, hkv, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="seqjax_paged_decode",
    )(table, scalars, qg, keys, values)


def _kernel(table_ref, scalars_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, per_block):
    rows, d = q_ref.shape
    block = per_block * k_ref.shape[1]
    length, window = scalars_ref[0], scalars_ref[1]
    q = q_ref[...]
    qk_scale = scale * math.log2(math.e)  # (base-2 exponentials)

    def visit(i, carry):
        o, m, total = carry
        ids = table_ref[pl.ds(i * per_block, per_block)]
        k = k_ref[ids].reshape(block, d)
        v = v_ref[ids].reshape(block, d)
        place = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        ok = allowed(1, (place < length).astype(jnp.int32), length - 1, place, window)
        s = jnp.where(ok, _dot(q, k.astype(q.dtype), trans_b=True) * qk_scale, MASKED)
        m_next = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(ok, jnp.exp2(s - m_next[:, None]), 0.0)
        correction = jnp.exp2(m - m_next)
        o = o * correction[:, None] + _dot(p.astype(q.dtype), v.astype(q.dtype))
        return o, m_next, total * correction + p.sum(axis=1)

    first = jnp.maximum(length - window, 0) // block  # (a sliding layer's first block in reach)
    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASKED, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    o, m, total = jax.lax.fori_loop(first, pl.cdiv(length, block), visit, carry)
    seen = total > 0
    o_ref[...] = jnp.where(seen[:, None], o / jnp.where(seen, total, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, total, 1.0))) / math.log2(math.e), MASKED)
