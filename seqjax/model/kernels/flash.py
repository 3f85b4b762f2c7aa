"""Flash attention for segment-masked causal attention in Pallas, skipping the tiles packing leaves
empty.

Three ``pallas_call`` passes joined by ``jax.custom_vjp``, in the FlashAttention-2 arrangement:

- forward: one program per (query block, batch row, query head); it streams key blocks through an
  online softmax (base-2 exponentials, float32 accumulators) and saves the log-sum-exp for the
  backward pass;
- dQ: one program per (query block, row, query head), streaming key blocks again;
- dK/dV: one program per (key block, row, key/value head), streaming query blocks of every query
  head that shares this kv head (GQA), so dK/dV are summed in registers with no atomics and no extra
  reduction.

Every loop visits only the ranges in :class:`~seqjax.model.kernels.block_ranges.BlockMetadata`;
tiles inside one document and below the diagonal (and inside a sliding layer's window) run without a
mask, the edge tiles apply contract 2's :func:`seqjax.model.mask.segment_mask`, window included.
Fully masked queries (segment 0) give zero output and zero gradients.

The kernels lower through Pallas's Triton backend on NVIDIA GPUs (``interpret=False``), and run in
Pallas's interpreter anywhere else (``interpret=True``), which is how CI checks their numerics on a
CPU. ``interpret=None`` chooses: compiled on a GPU, interpreted elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  (see below)
from jax.experimental.pallas import triton as plgpu

from seqjax.model.kernels.block_ranges import (
    BlockMetadata,
    BlockSizes,
    block_metadata,
    kernel_metadata,
    tiled_vjp,
    window_operand,
)
from seqjax.model.mask import check_attention_inputs, segment_mask

# Why the fuser import above: jax registers the tracing-context flag
# ``pallas_fuser_disable_nested_fuse`` when that module is first imported, which a pallas_call
# otherwise does lazily while it runs. The flag changes the jit cache key, so the first jitted
# function that ran this kernel (a whole train step) would compile twice.

LOG2_E = math.log2(math.e)
# A finite stand-in for -inf: masked logits and the running max start here, so no exp2(-inf - -inf)
# = NaN.
MASKED = -1e30
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    metadata: BlockMetadata | None = None,
    window=None,
    causal: bool = True,
    prefix_ids: jax.Array | None = None,
    with_lse: bool = False,
) -> jax.Array:
    """Segment-masked causal attention. q: [B, T, H, D]; k, v: [B, T, Hkv, D] with Hkv dividing H.

    ``segment_ids`` [B, T] int: contract 2 (0 = padding). ``scale`` defaults to D**-0.5. T need not
    be a multiple of the block sizes: the kernel pads with segment 0 (which costs no tile) and
    slices back. D is zero-padded to a power of two >= 16 (Triton's tile rule; zero columns change
    no logit, and their output columns are dropped); 64, 128 and 256 need no padding.
    ``block_sizes`` defaults to ``BlockSizes.for_head_dim(D)``. ``metadata``: precomputed
    :func:`block_metadata` for these segment ids and block sizes — compute it once per forward and
    pass it to every layer; computed here when omitted. ``window``: a sliding layer's window
    (contract 2; an int or a traced int32 scalar); it lives in the metadata, so pass it here only
    when the metadata is computed here. ``causal=False``: contract 2's non-causal form (a vision
    encoder's images: a query sees its whole segment); the metadata must have been computed so.
    ``prefix_ids`` [B, T]: a shared prompt (contract 2's extension): query i also sees the keys of
    segment ``prefix_ids[i]`` (0: none), the prompt preceding the completions that continue it (as
    ``data.shared_prompt`` and GRPO's ``prompt_once`` lay rows out); the metadata must come from
    ``block_metadata(..., prefix_ids=)``, which visits each prompt's tiles once for a query block,
    and never the other completions between them. No window then. ``with_lse``: ``(out, the natural
    log-sum-exp [B, H, T])``, both differentiable (attention sinks rescale by it).
    """
    _check_inputs(q, k, v, segment_ids)
    b, t, h, d = q.shape
    scale = float(d**-0.5 if scale is None else scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if metadata is None and prefix_ids is not None:
        metadata = block_metadata(segment_ids, block_sizes or BlockSizes.for_head_dim(d), window,
                                  prefix_ids=prefix_ids)
        window = None  # (refused above if set)
    metadata = kernel_metadata("flash_attention", segment_ids, metadata, window, block_sizes,
                               BlockSizes.for_head_dim(d), causal)
    if metadata.shared_prompt != (prefix_ids is not None):
        raise ValueError("flash_attention: " + ("prefix_ids without metadata for them; expected "
                                                "block_metadata(..., prefix_ids=)" if prefix_ids is not None else
                                                "metadata for a shared prompt, but no prefix_ids"))
    padded = metadata.seq_len
    pad = ((0, 0), (0, padded - t), (0, 0), (0, _head_pad(d)))
    segment_ids, prefix_ids = (None if a is None else jnp.pad(a.astype(jnp.int32), ((0, 0), (0, padded - t)))
                               for a in (segment_ids, prefix_ids))
    run = _flash_with_lse if with_lse else _flash
    out = run(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), (segment_ids, segment_ids, prefix_ids), metadata,
              scale, bool(interpret))
    if with_lse:
        return out[0][:, :t, :, :d], out[1][:, :, :t]
    return out[:, :t, :, :d]


def flash_attention_span(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    metadata: BlockMetadata,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """A span of a row's queries against a span of its keys: what one device computes of a row split
    over mesh.context (seqjax.model.context).

    q [B, Tq, H, D] with ``q_segment_ids`` [B, Tq]; k, v [B, Tk, Hkv, D] with ``kv_segment_ids``
    [B, Tk]; ``metadata``: :func:`~seqjax.model.kernels.block_ranges.block_metadata` of the whole
    row's ids with ``queries=(offset, Tq)`` and ``keys=(offset, Tk)``, which also carries the
    spans' offsets, so contract 2 compares the tokens' row indices. Returns the output [B, Tq, H,
    D] in q's dtype and the natural log-sum-exp [B, H, Tq] (float32; about -7e29 for a query with
    no allowed key in the span, so it weighs nothing in a merge), both differentiable: outputs over
    several key spans merge by their log-sum-exp.
    """
    b, tq, h, d = q.shape
    _check_dtype("flash_attention_span", q.dtype)
    if not metadata.spans or (metadata.seq_len, metadata.kv_len) != (tq, k.shape[1]):
        raise ValueError(f"flash_attention_span: metadata for spans of {metadata.seq_len} queries "
                         f"and {metadata.kv_len} keys, but q has {tq} and k {k.shape[1]} (expected "
                         "block_metadata with queries=(offset, Tq) and keys=(offset, Tk))")
    scale = float(d**-0.5 if scale is None else scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    pad = ((0, 0), (0, 0), (0, 0), (0, _head_pad(d)))
    segment_ids = (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32))
    out, lse = _flash_with_lse(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), (*segment_ids, None),
                               metadata, scale, bool(interpret))
    return out[..., :d], lse


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> None:
    check_attention_inputs(q, k, v, segment_ids)
    _check_dtype("flash_attention", q.dtype)


def _check_dtype(name: str, dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {dtype}, expected bfloat16, float16 or float32")


def _head_pad(d: int) -> int:
    """Zero columns that make head_dim d a power of two >= 16 (Triton's tile rule)."""
    return max(16, pl.next_power_of_2(d)) - d


def _tile_mask(seg_q, seg_k, q_start, k_start, window, causal, prefix_q=None):
    """Contract 2's mask for one tile: [block_q, block_k] bool, from the one definition in
    mask.py (``prefix_q``: the queries' shared prompt, when the row has one)."""
    q_index = q_start + jax.lax.broadcasted_iota(jnp.int32, (1, seg_q.shape[0]), 1)
    k_index = k_start + jax.lax.broadcasted_iota(jnp.int32, (1, seg_k.shape[0]), 1)
    if not causal:
        return segment_mask(seg_q[None], seg_k[None], causal=False)[0]
    return segment_mask(seg_q[None], seg_k[None], q_index=q_index, kv_index=k_index, window=window,
                        q_prefix_ids=None if prefix_q is None else prefix_q[None])[0]


def _dot(a, b, *, trans_a=False, trans_b=False):
    """Tile matmul with float32 accumulation; float32 tiles stay exact (no TF32) so tests can be
    tight."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _log2_logits(q, k, seg_q, seg_k, q_start, k_start, qk_scale, masked: bool, window, causal: bool,
                 prefix_q=None):
    """Scaled logits of one tile in log2 units, and its mask (None on a full tile, where every pair
    is allowed).

    Masked logits become MASKED; callers also zero their probabilities, so a row with no allowed key
    so far (running max still MASKED) adds nothing.
    """
    s = _dot(q, k, trans_b=True) * qk_scale
    if not masked:
        return s, None
    mask = _tile_mask(seg_q, seg_k, q_start, k_start, window, causal, prefix_q)
    return jnp.where(mask, s, MASKED), mask


def _exp2(x, mask):
    p = jnp.exp2(x)
    return p if mask is None else jnp.where(mask, p, 0.0)


def _visit_tiles(ranges_ref, row, step, carry, prompt_ref=None):
    """One block's loop over its ranges (lo, full_lo, full_hi, hi): masked edge, unmasked full
    tiles, masked edge; first over its shared prompt's range ``prompt_ref`` when the row has one.

    ``step(masked)`` returns the fori_loop body; splitting the loop keeps the mask arithmetic off
    the bulk of a long document's tiles, as FlashAttention-2 does for the causal diagonal.
    """
    for ref in (prompt_ref, ranges_ref):
        if ref is not None:
            lo, full_lo, full_hi, hi = (ref[row, c] for c in range(4))
            carry = jax.lax.fori_loop(lo, full_lo, step(True), carry)
            carry = jax.lax.fori_loop(full_lo, full_hi, step(False), carry)
            carry = jax.lax.fori_loop(full_hi, hi, step(True), carry)
    return carry


def _scalars_operand(metadata: BlockMetadata) -> jax.Array:
    """The [3] int32 operand every pass reads: the window, and the row index of the first query and
    of the first key (0 and 0 for a whole row; a span's offsets, block_metadata's queries/keys)."""
    offsets = metadata.offsets
    offsets = jnp.zeros((2,), jnp.int32) if offsets is None else offsets.astype(jnp.int32)
    return jnp.concatenate([window_operand(metadata), offsets])


def _scalars(scalars_ref):
    """(window, first query's row index, first key's row index) inside a pass."""
    return scalars_ref[0], scalars_ref[1], scalars_ref[2]


# ----------------------------------------------------------------------------------------------
# forward


def _query_block():
    """This program's query block. Programs launch in grid order, so the last query blocks (the
    longest rows of a causal triangle) go first and the short ones fill in at the end: less idle
    tail on the last wave."""
    return pl.num_programs(0) - 1 - pl.program_id(0)


def _reversed(n: int):
    """Index map of the query-block grid axis matching :func:`_query_block`."""
    return lambda i: n - 1 - i



def _forward_kernel(ranges_ref, scalars_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, *refs,
                    qk_scale, block_k, causal, prompt):
    (prompt_ref, prefix_ref, o_ref, lse_ref) = refs if prompt else (None, None, *refs)
    i = _query_block()
    block_q, d = q_ref.shape
    q, seg_q, (window, q_offset, k_offset) = q_ref[...], seg_q_ref[...], _scalars(scalars_ref)
    prefix = None if prefix_ref is None else prefix_ref[...]

    def step(masked):
        def visit(j, carry):
            acc, m, row_sum = carry
            keys = pl.ds(j * block_k, block_k)
            s, mask = _log2_logits(q, k_ref[keys, :], seg_q, seg_k_ref[keys], q_offset + i * block_q,
                                   k_offset + j * block_k, qk_scale, masked, window, causal, prefix)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = _exp2(s - m_new[:, None], mask)
            correction = jnp.exp2(m - m_new)
            v = v_ref[keys, :]
            acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
            return acc, m_new, row_sum * correction + p.sum(axis=-1)

        return visit

    rows = jnp.zeros((block_q,), jnp.float32)
    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full_like(rows, MASKED), rows)
    acc, m, row_sum = _visit_tiles(ranges_ref, i, step, init, prompt_ref)
    # padding queries, and queries with no allowed key: zeros, not NaN, and a log-sum-exp of MASKED
    # (no weight when spans merge; the backward's masked tiles give them p = 0 all the same)
    empty = row_sum == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, row_sum)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, MASKED, m + jnp.log2(jnp.where(empty, 1.0, row_sum)))


def _forward(q, k, v, segment_ids, metadata: BlockMetadata, scale: float, interpret: bool):
    """Output [B, Tq, H, D] and the base-2 log-sum-exp [B, H, Tq] (float32) the backward pass
    reuses. ``segment_ids``: the queries' and the keys' ([B, Tq], [B, Tk]), and the queries' shared
    prompt ids (or None)."""
    b, t, h, d = q.shape
    tk = k.shape[1]
    seg_q, seg_k, prefix = segment_ids
    group = h // k.shape[2]
    bs = metadata.block_sizes
    n_q = t // bs.block_q
    rev = _reversed(n_q)
    prompt, prompt_specs = _prompt_operands(metadata.fwd_prefix, prefix, n_q, bs.block_q, rev)
    kernel = functools.partial(_forward_kernel, qk_scale=scale * LOG2_E, block_k=bs.block_k, causal=metadata.causal,
                               prompt=bool(prompt))
    return pl.pallas_call(
        kernel,
        grid=(n_q, b, h),
        in_specs=[
            pl.BlockSpec((None, n_q, 4), lambda i, r, hd: (r, 0, 0)),
            pl.BlockSpec((3,), lambda i, r, hd: (0,)),
            pl.BlockSpec((None, bs.block_q), lambda i, r, hd: (r, rev(i))),
            pl.BlockSpec((None, tk), lambda i, r, hd: (r, 0)),
            pl.BlockSpec((None, bs.block_q, None, d), lambda i, r, hd: (r, rev(i), hd, 0)),
            pl.BlockSpec((None, tk, None, d), lambda i, r, hd: (r, 0, hd // group, 0)),
            pl.BlockSpec((None, tk, None, d), lambda i, r, hd: (r, 0, hd // group, 0)),
            *prompt_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, bs.block_q, None, d), lambda i, r, hd: (r, rev(i), hd, 0)),
            pl.BlockSpec((None, None, bs.block_q), lambda i, r, hd: (r, hd, rev(i))),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="seqjax_flash_forward",
    )(metadata.fwd_kv, _scalars_operand(metadata), seg_q, seg_k, q, k, v, *prompt)


def _prompt_operands(ranges, prefix, n_q: int, block_q: int, rev) -> tuple[tuple, tuple]:
    """A query-block pass's extra operands under a shared prompt and their BlockSpecs: the blocks'
    prompt ranges and the queries' prefix ids; ((), ()) without one."""
    if ranges is None:
        return (), ()
    return (ranges, prefix), (pl.BlockSpec((None, n_q, 4), lambda i, r, hd: (r, 0, 0)),
                              pl.BlockSpec((None, block_q), lambda i, r, hd: (r, rev(i))))


# ----------------------------------------------------------------------------------------------
# backward


def _dq_kernel(ranges_ref, scalars_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *refs, scale, block_k, causal, prompt):
    (prompt_ref, prefix_ref, dq_ref) = refs if prompt else (None, None, *refs)
    i = _query_block()
    block_q, d = q_ref.shape
    q, do, seg_q = q_ref[...], do_ref[...], seg_q_ref[...]
    prefix = None if prefix_ref is None else prefix_ref[...]
    window, q_offset, k_offset = _scalars(scalars_ref)
    lse, delta = lse_ref[...], delta_ref[...]

    def step(masked):
        def visit(j, dq):
            keys = pl.ds(j * block_k, block_k)
            k, v = k_ref[keys, :], v_ref[keys, :]
            s, mask = _log2_logits(q, k, seg_q, seg_k_ref[keys], q_offset + i * block_q,
                                   k_offset + j * block_k, scale * LOG2_E, masked, window, causal, prefix)
            p = _exp2(s - lse[:, None], mask)
            ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return visit

    dq = _visit_tiles(ranges_ref, i, step, jnp.zeros((block_q, d), jnp.float32), prompt_ref)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(ranges_ref, scalars_ref, seg_q_ref, seg_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                *refs, scale, block_q, causal, prompt):
    (prefix_ref, dk_ref, dv_ref) = refs if prompt else (None, *refs)
    j = pl.program_id(0)
    block_k, d = k_ref.shape
    group = q_ref.shape[1]
    k, v, seg_k = k_ref[...], v_ref[...], seg_k_ref[...]
    window, q_offset, k_offset = _scalars(scalars_ref)

    def visit_head(g, carry):
        def step(masked):
            def visit(i, carry):
                dk, dv = carry
                queries = pl.ds(i * block_q, block_q)
                q, do = q_ref[queries, g, :], do_ref[queries, g, :]
                s, mask = _log2_logits(q, k, seg_q_ref[queries], seg_k, q_offset + i * block_q,
                                       k_offset + j * block_k, scale * LOG2_E, masked, window, causal,
                                       None if prefix_ref is None else prefix_ref[queries])
                p = _exp2(s - lse_ref[g, queries][:, None], mask)
                dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
                ds = p * (_dot(do, v, trans_b=True) - delta_ref[g, queries][:, None])
                return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

            return visit

        return _visit_tiles(ranges_ref, j, step, carry)

    zeros = jnp.zeros((block_k, d), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, visit_head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, segment_ids, metadata: BlockMetadata, scale, interpret, lse, delta, do):
    b, t, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    seg_q, seg_k, prefix = segment_ids
    scalars = _scalars_operand(metadata)
    group = h // hkv
    bs = metadata.block_sizes
    bq, bk = bs.block_q_bwd, bs.block_k_bwd  # the dK/dV pass
    bq_dq, bk_dq = bs.block_q_dq, bs.block_k_dq
    params = plgpu.CompilerParams(num_warps=bs.num_warps_bwd, num_stages=bs.num_stages_bwd)
    full_row = lambda r, hd: (r, 0, hd, 0)  # noqa: E731  (index maps read better inline)

    n_q = t // bq_dq
    rev = _reversed(n_q)
    prompt, prompt_specs = _prompt_operands(metadata.dq_prefix, prefix, n_q, bq_dq, rev)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk_dq, causal=metadata.causal, prompt=bool(prompt)),
        grid=(n_q, b, h),
        in_specs=[
            pl.BlockSpec((None, n_q, 4), lambda i, r, hd: (r, 0, 0)),
            pl.BlockSpec((3,), lambda i, r, hd: (0,)),
            pl.BlockSpec((None, bq_dq), lambda i, r, hd: (r, rev(i))),
            pl.BlockSpec((None, tk), lambda i, r, hd: (r, 0)),
            pl.BlockSpec((None, bq_dq, None, d), lambda i, r, hd: (r, rev(i), hd, 0)),
            pl.BlockSpec((None, tk, None, d), lambda i, r, hd: full_row(r, hd // group)),
            pl.BlockSpec((None, tk, None, d), lambda i, r, hd: full_row(r, hd // group)),
            pl.BlockSpec((None, bq_dq, None, d), lambda i, r, hd: (r, rev(i), hd, 0)),
            pl.BlockSpec((None, None, bq_dq), lambda i, r, hd: (r, hd, rev(i))),
            pl.BlockSpec((None, None, bq_dq), lambda i, r, hd: (r, hd, rev(i))),
            *prompt_specs,
        ],
        out_specs=pl.BlockSpec((None, bq_dq, None, d), lambda i, r, hd: (r, rev(i), hd, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="seqjax_flash_dq",
    )(metadata.dq_kv, scalars, seg_q, seg_k, q, k, v, do, lse, delta, *prompt)

    n_k = tk // bk
    prefixes = () if prefix is None else (prefix,)  # the queries' prompt ids, for edge tiles
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=bq, causal=metadata.causal, prompt=bool(prefixes)),
        grid=(n_k, b, hkv),
        in_specs=[
            pl.BlockSpec((None, n_k, 4), lambda j, r, hd: (r, 0, 0)),
            pl.BlockSpec((3,), lambda j, r, hd: (0,)),
            pl.BlockSpec((None, t), lambda j, r, hd: (r, 0)),
            pl.BlockSpec((None, bk), lambda j, r, hd: (r, j)),
            pl.BlockSpec((None, t, group, d), lambda j, r, hd: full_row(r, hd)),
            pl.BlockSpec((None, bk, None, d), lambda j, r, hd: (r, j, hd, 0)),
            pl.BlockSpec((None, bk, None, d), lambda j, r, hd: (r, j, hd, 0)),
            pl.BlockSpec((None, t, group, d), lambda j, r, hd: full_row(r, hd)),
            pl.BlockSpec((None, group, t), lambda j, r, hd: (r, hd, 0)),
            pl.BlockSpec((None, group, t), lambda j, r, hd: (r, hd, 0)),
            *[pl.BlockSpec((None, t), lambda j, r, hd: (r, 0))] * len(prefixes),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, d), lambda j, r, hd: (r, j, hd, 0)),
            pl.BlockSpec((None, bk, None, d), lambda j, r, hd: (r, j, hd, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="seqjax_flash_dkv",
    )(metadata.dkv_q, scalars, seg_q, seg_k, q, k, v, do, lse, delta, *prefixes)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# custom VJP


_flash = tiled_vjp(_forward, _backward)
_flash_with_lse = tiled_vjp(_forward, _backward, with_lse=True)
