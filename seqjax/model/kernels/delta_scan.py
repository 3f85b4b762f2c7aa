"""The gated delta rule's scan over chunks in Pallas: the one sequential part of the chunked form
(:func:`seqjax.model.delta_rule.chunked_rule`), with the state in registers from the first chunk
to the last instead of one XLA loop iteration (and its launches) per chunk.

The chunk terms arrive solved (the UT transform, the segment mask and the resets are in them,
computed in parallel over chunks by XLA); per chunk i, per head, with S entering the chunk::

    new_i = values_i - k_read_i S          [C, Dv]   the chunk's values less what S predicts
    out_i = q_read_i S + inner_i new_i     [C, Dv]
    S     = keep_i S + k_write_i^T new_i   [Dk, Dv]  what the chunk's last segment passes on

Two ``pallas_call`` passes joined by ``jax.custom_vjp``: the forward, one program per (row, head,
block of Dv columns), keeps each chunk's entering state and ``new`` for the backward, which runs
the chunks in reverse carrying dS. The terms' cotangents summed over Dv (those of ``k_read``,
``q_read``, ``k_write``, ``inner``, ``keep``) come out one partial per Dv block and are summed by
XLA. Lowered through Pallas's Triton backend on NVIDIA GPUs; interpreted anywhere else
(``interpret`` None: compiled on a GPU), which is how CI checks it on a CPU
(tests/test_delta_scan.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqjax.core.errors import ConfigError

# Triton's dot takes tiles of at least 16 a side.
LEAST = 16


def _dot(a, b, *, trans_a=False, trans_b=False):
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=jax.lax.Precision.HIGHEST)


def _scalar(ref, i):
    """Element ``i`` of a 1-D ref, as a 0-d value."""
    return jnp.sum(ref[pl.ds(i, 1)])


def _forward_kernel(
    values_ref,
    k_read_ref,
    q_read_ref,
    inner_ref,
    k_write_ref,
    keep_ref,
    s0_ref,
    out_ref,
    states_ref,
    new_ref,
    final_ref,
    *,
    chunk: int,
    n: int,
    dk: int,
):
    def body(i, s):
        rows = pl.ds(i * chunk, chunk)
        states_ref[pl.ds(i * dk, dk), :] = s
        new = values_ref[rows, :] - _dot(k_read_ref[rows, :], s)
        out_ref[rows, :] = _dot(q_read_ref[rows, :], s) + _dot(inner_ref[rows, :], new)
        new_ref[rows, :] = new
        return s * _scalar(keep_ref, i) + _dot(k_write_ref[rows, :], new, trans_a=True)

    final_ref[...] = jax.lax.fori_loop(0, n, body, s0_ref[...])


def _backward_kernel(
    k_read_ref,
    q_read_ref,
    inner_ref,
    k_write_ref,
    keep_ref,
    states_ref,
    new_ref,
    d_out_ref,
    d_states_ref,
    d_new_ref,
    d_final_ref,
    d_values_ref,
    d_k_read_ref,
    d_q_read_ref,
    d_inner_ref,
    d_k_write_ref,
    d_keep_ref,
    d_s0_ref,
    *,
    chunk: int,
    n: int,
    dk: int,
):
    def body(j, ds):  # (ds: the cotangent of the state leaving chunk i)
        i = n - 1 - j
        rows, block = pl.ds(i * chunk, chunk), pl.ds(i * dk, dk)
        s, new, d_out = states_ref[block, :], new_ref[rows, :], d_out_ref[rows, :]
        d_new = (
            _dot(inner_ref[rows, :], d_out, trans_a=True)
            + _dot(k_write_ref[rows, :], ds)
            + d_new_ref[rows, :]
        )
        d_values_ref[rows, :] = d_new
        d_k_read_ref[rows, :] = -_dot(d_new, s, trans_b=True)
        d_q_read_ref[rows, :] = _dot(d_out, s, trans_b=True)
        d_inner_ref[rows, :] = _dot(d_out, new, trans_b=True)
        d_k_write_ref[rows, :] = _dot(new, ds, trans_b=True)
        # (summed one axis at a time: Triton's lowering of a whole tile's sum fails)
        d_keep_ref[pl.ds(i, 1)] = jnp.broadcast_to(jnp.sum(jnp.sum(s * ds, axis=1)), (1,))
        return (
            _dot(q_read_ref[rows, :], d_out, trans_a=True)
            - _dot(k_read_ref[rows, :], d_new, trans_a=True)
            + _scalar(keep_ref, i) * ds
            + d_states_ref[block, :]
        )

    d_s0_ref[...] = jax.lax.fori_loop(0, n, body, d_final_ref[...])


def _spec(rows: int, width: int, split: bool):
    """A (row, head) slice [rows, width]; ``split``: the program's block of Dv columns."""
    if split:
        return pl.BlockSpec((None, None, rows, width), lambda b, h, v: (b, h, 0, v))
    return pl.BlockSpec((None, None, rows, width), lambda b, h, v: (b, h, 0, 0))


def _keep_spec(n: int):
    """A (row, head)'s chunk decays [N], whole in every program."""
    return pl.BlockSpec((None, None, n), lambda b, h, v: (b, h, 0))


def _partial(rows: int, width: int):
    """One Dv block's partial [rows, width] of a cotangent summed over Dv."""
    return pl.BlockSpec((None, None, None, rows, width), lambda b, h, v: (b, h, v, 0, 0))


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=name,
    )


def _forward(terms, s0, block_v: int, interpret: bool):
    values, k_read, q_read, inner, k_write, keep = terms
    b, h, t, dv = values.shape
    dk, chunk = k_read.shape[-1], inner.shape[-1]
    n = t // chunk
    kernel = functools.partial(_forward_kernel, chunk=chunk, n=n, dk=dk)
    f32 = jnp.float32
    return _call(
        kernel,
        (b, h, dv // block_v),
        [
            _spec(t, block_v, True),
            _spec(t, dk, False),
            _spec(t, dk, False),
            _spec(t, chunk, False),
            _spec(t, dk, False),
            _keep_spec(n),
            _spec(dk, block_v, True),
        ],
        [
            _spec(t, block_v, True),
            _spec(n * dk, block_v, True),
            _spec(t, block_v, True),
            _spec(dk, block_v, True),
        ],
        [
            jax.ShapeDtypeStruct((b, h, t, dv), f32),
            jax.ShapeDtypeStruct((b, h, n * dk, dv), f32),
            jax.ShapeDtypeStruct((b, h, t, dv), f32),
            jax.ShapeDtypeStruct((b, h, dk, dv), f32),
        ],
        interpret,
        "seqjax_delta_scan_forward",
    )(values, k_read, q_read, inner, k_write, keep, s0)


def _backward(terms, saved, cotangents, block_v: int, interpret: bool):
    _, k_read, q_read, inner, k_write, keep = terms
    states, new = saved
    d_out, d_states, d_new, d_final = cotangents
    b, h, t, dv = new.shape
    dk, chunk = k_read.shape[-1], inner.shape[-1]
    n, nv = t // chunk, dv // block_v
    kernel = functools.partial(_backward_kernel, chunk=chunk, n=n, dk=dk)
    f32 = jnp.float32

    def part(rows, width):
        return jax.ShapeDtypeStruct((b, h, nv, rows, width), f32)

    out = _call(
        kernel,
        (b, h, nv),
        [
            _spec(t, dk, False),
            _spec(t, dk, False),
            _spec(t, chunk, False),
            _spec(t, dk, False),
            _keep_spec(n),
            _spec(n * dk, block_v, True),
            _spec(t, block_v, True),
            _spec(t, block_v, True),
            _spec(n * dk, block_v, True),
            _spec(t, block_v, True),
            _spec(dk, block_v, True),
        ],
        [
            _spec(t, block_v, True),
            _partial(t, dk),
            _partial(t, dk),
            _partial(t, chunk),
            _partial(t, dk),
            pl.BlockSpec((None, None, None, n), lambda b_, h_, v_: (b_, h_, v_, 0)),
            _spec(dk, block_v, True),
        ],
        [
            jax.ShapeDtypeStruct((b, h, t, dv), f32),
            part(t, dk),
            part(t, dk),
            part(t, chunk),
            part(t, dk),
            jax.ShapeDtypeStruct((b, h, nv, n), f32),
            jax.ShapeDtypeStruct((b, h, dk, dv), f32),
        ],
        interpret,
        "seqjax_delta_scan_backward",
    )(k_read, q_read, inner, k_write, keep, states, new, d_out, d_states, d_new, d_final)
    d_values, d_k_read, d_q_read, d_inner, d_k_write, d_keep, d_s0 = out
    return (
        d_values,
        *(a.sum(axis=2) for a in (d_k_read, d_q_read, d_inner, d_k_write, d_keep)),
        d_s0,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _scan(values, k_read, q_read, inner, k_write, keep, s0, block_v, interpret):
    return tuple(_forward((values, k_read, q_read, inner, k_write, keep), s0, block_v, interpret))


def _scan_fwd(values, k_read, q_read, inner, k_write, keep, s0, block_v, interpret):
    terms = (values, k_read, q_read, inner, k_write, keep)
    out, states, new, final = _forward(terms, s0, block_v, interpret)
    return (out, states, new, final), (terms, states, new)


def _scan_bwd(block_v, interpret, residuals, cotangents):
    terms, states, new = residuals
    return _backward(terms, (states, new), cotangents, block_v, interpret)


_scan.defvjp(_scan_fwd, _scan_bwd)


def delta_scan(
    values,
    k_read,
    q_read,
    inner,
    k_write,
    keep,
    s0,
    *,
    block_v: int | None = None,
    interpret: bool | None = None,
):
    """The scan over chunks, each term laid out [B, H, N * C, ...] (``inner`` [B, H, N * C, C],
    ``keep`` [B, H, N]) and ``s0`` [B, H, Dk, Dv], all float32: (out [B, H, N * C, Dv], each chunk's
    entering state [B, H, N * Dk, Dv], each chunk's ``new`` [B, H, N * C, Dv], the state after the
    last chunk). ``block_v``: the Dv columns a program carries (default: up to 64)."""
    dk, dv, chunk = k_read.shape[-1], values.shape[-1], inner.shape[-1]
    block_v = block_v or min(dv, 64)
    if dv % block_v:
        raise ConfigError(
            f"the Pallas delta-rule scan: value heads of {dv}, expected a multiple of its block of "
            f"{block_v} columns"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret and min(dk, block_v, chunk) < LEAST:
        raise ConfigError(
            f"model.deltanet.kernel=pallas: key width {dk}, value block {block_v} and "
            f"model.deltanet.chunk={chunk}, expected each at least {LEAST} (Triton's tiles); "
            "expected model.deltanet.kernel=xla for this shape"
        )
    return _scan(values, k_read, q_read, inner, k_write, keep, s0, block_v, bool(interpret))
