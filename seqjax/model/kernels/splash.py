"""Segment-masked causal attention on TPU through Pallas splash attention.

Splash takes segment ids natively (``SegmentIds(q, kv)``) and skips the tiles of its *static* mask
(here the causal triangle); the segment part is checked per tile. Its segment rule is plain
equality, so padding (segment 0) would attend to padding; contract 2 says padding attends to
nothing, so padding rows are zeroed after the kernel. That also zeroes every gradient path through
them: a real query never sees a padding key (different ids), so padding keys only feed padding
queries, whose outputs are discarded.

A sliding layer's window w (contract 2: ``i - j < w``) is splash's ``LocalMask`` with ``w - 1`` keys
to the left and none to the right, which is the causal band; splash then skips the tiles outside the
band as well. The mask is static, so the window must be a Python int: a scanned model whose layers
mix windows chooses between two kernels with ``lax.cond`` (seqjax.model.block.Attention).

Splash has an interpreter mode, which is how this wrapper is tested on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from seqjax.model.mask import check_attention_inputs


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    block_size: int = 128,
    window: int | None = None,
) -> jax.Array:
    """q: [B, T, H, D]; k, v: [B, T, Hkv, D] (Hkv divides H); segment_ids [B, T] (0 = padding) -> [B, T, H, D].

    T is padded internally (with segment 0) to a multiple of ``block_size``. ``interpret=None`` runs
    the compiled kernel on a TPU and the interpreter elsewhere. ``window``: a sliding layer's
    window, a Python int."""
    check_attention_inputs(q, k, v, segment_ids)
    b, t, h, d = q.shape
    if block_size % 128:
        raise ValueError(f"block_size {block_size}: splash tiles must be multiples of 128 (TPU lanes)")
    if window is not None and not isinstance(window, int):
        raise ValueError(f"splash_attention: window must be a Python int (splash's mask is static), got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"splash_attention: window {window}, expected >= 1")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    scale = d**-0.5 if scale is None else scale
    padded = -(-t // block_size) * block_size
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, padded - t)))

    def heads_first(x):  # [B, T, H, D] -> [B, H, padded, D], splash's layout
        return jnp.pad(x, ((0, 0), (0, padded - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    kernel = _kernel(h, padded, block_size, bool(interpret), window)
    ids = splash.SegmentIds(q=segment_ids, kv=segment_ids)
    out = jax.vmap(kernel)(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), ids)
    out = out.transpose(0, 2, 1, 3)[:, :t]
    return jnp.where(segment_ids[:, :t, None, None] != 0, out, 0).astype(q.dtype)


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, seq_len: int, block_size: int, interpret: bool, window: int | None):
    """The splash kernel for a causal (or causal band) mask of this shape (mask preprocessing runs in NumPy: build it
    once).

    Built under ``ensure_compile_time_eval`` so its mask tables are concrete arrays, safe to cache
    even when the first call happens inside a ``jit`` trace."""
    shape = (seq_len, seq_len)
    one = (splash.CausalMask(shape) if window is None or window >= seq_len
           else splash.LocalMask(shape, window_size=(window - 1, 0), offset=0))
    mask = splash.MultiHeadMask([one for _ in range(heads)])
    blocks = splash.BlockSizes(
        block_q=block_size,
        block_kv=block_size,
        block_kv_compute=block_size,
        block_q_dkv=block_size,
        block_kv_dkv=block_size,
        block_kv_dkv_compute=block_size,
        block_q_dq=block_size,
        block_kv_dq=block_size,
    )
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)
