"""The Mosaic GPU flash kernel (``model.attention: pallas_mosaic``) against contract 2's reference, run by Pallas's
Mosaic GPU interpreter on a CPU (CI), and lowered for an H100 without one.

Forward and all three gradients are checked under hypothesis-drawn packings and sliding windows in float32
(exact in the interpreter), and in bfloat16 at D = 128; the segment-skipping ranges are the flash kernel's
(tests/test_flash.py checks them tile by tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.core.errors import ConfigError
from seqjax.model.attention import reference_attention
from seqjax.model.kernels.block_ranges import block_metadata
from seqjax.model.kernels.mosaic import BLOCK_SIZES, mosaic_attention
from seqjax.model.mask import FULL
from test_flash import assert_close, lowered_for_h100, packed_batch, random_qkv


def _vjp(attend, q, k, v, segment_ids, window, cotangent):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids, window), q, k, v)
    return out, vjp(cotangent)


def _exact(q, k, v, segment_ids, window):
    with jax.default_matmul_precision("highest"):
        return reference_attention(q, k, v, segment_ids, window=window)


REFERENCE = jax.jit(lambda q, k, v, s, w, ct: _vjp(_exact, q, k, v, s, w, ct))
MOSAIC = jax.jit(lambda q, k, v, s, w, ct: _vjp(lambda q, k, v, s, w: mosaic_attention(q, k, v, s, window=w),
                                                q, k, v, s, w, ct))
# T = 120 pads to two 64-token tiles; 4 query heads share 2 kv heads (GQA); D = 64.
F32 = random_qkv((2, 120, 4, 64), kv_heads=2, dtype=jnp.float32, seed=4)


def check(q, k, v, segment_ids, window, cotangent, tol):
    out, grads = MOSAIC(q, k, v, segment_ids, window, cotangent)
    ref_out, ref_grads = REFERENCE(q, k, v, segment_ids, window, cotangent)
    assert_close(out, ref_out, tol, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, tol, name)
    padding = np.asarray(segment_ids) == 0  # contract 2: padding sees nothing: exact zeros, never NaN
    assert not np.asarray(out, np.float32)[padding].any()
    assert not np.asarray(grads[0], np.float32)[padding].any()


@pytest.mark.slow  # (the full suite; the fast loop keeps the overlapped-softmax case and the lowerings)
def test_a_packed_row_under_a_sliding_window_in_float32():
    q, k, v, cotangent = (x[:1] for x in F32)
    rows = np.repeat([1, 2, 3, 0], [50, 3, 60, 7])[None].astype(np.int32)
    check(q, k, v, jnp.asarray(rows), jnp.int32(20), cotangent, tol=2e-5)


BF16 = random_qkv((2, 120, 4, 64), kv_heads=2, dtype=jnp.bfloat16, seed=6)


@pytest.mark.slow  # about a minute of interpreter per dtype: the fast loop runs the fixed cases
@pytest.mark.parametrize(("qkv", "tol"), [(F32, 2e-5), (BF16, 3e-2)], ids=["float32", "bfloat16"])
@settings(max_examples=5, deadline=None)
@given(segment_ids=packed_batch(2, 120), window=st.one_of(st.just(FULL), st.integers(1, 130)))
def test_matches_the_reference_over_packings_and_windows(qkv, tol, segment_ids, window):
    q, k, v, cotangent = qkv
    check(q, k, v, jnp.asarray(segment_ids), jnp.int32(window), cotangent, tol=tol)


@pytest.mark.parametrize(("lengths", "dtype"), [pytest.param([128], jnp.bfloat16, marks=pytest.mark.slow),
                                                pytest.param([5, 1, 60, 40], jnp.bfloat16, marks=pytest.mark.slow),
                                                pytest.param([5, 1, 60, 40], jnp.float16, marks=pytest.mark.slow)])
def test_matches_the_reference_in_half_precision_at_head_dim_128(lengths, dtype):
    """One document, and ragged documents with a padding tail; bfloat16 and float16."""
    rows = np.zeros((1, 128), np.int32)
    rows[0, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    q, k, v, cotangent = random_qkv((1, 128, 2, 128), kv_heads=1, dtype=dtype, seed=5)
    check(q, k, v, jnp.asarray(rows), jnp.int32(FULL), cotangent, tol=3e-2)


@pytest.mark.slow  # (the interpreter's heaviest: the full suite)
@pytest.mark.parametrize("slots", [3, 4])
def test_a_deeper_tma_pipeline_computes_the_same(slots):
    """The variant a GPU sweep weighs: the producers' rings of 3 or 4 stages instead of 2 (more tiles in flight);
    a packed row with a padding tail and more tiles a pass streams than there are slots, so every slot is
    reused, forward and the three gradients in float32, exact in the interpreter."""
    q, k, v, cotangent = random_qkv((1, 384, 2, 64), kv_heads=1, dtype=jnp.float32, seed=7)
    rows = np.repeat([1, 2, 0], [330, 40, 14])[None].astype(np.int32)  # (the last query block streams 6 tiles)
    attend = jax.jit(lambda q, k, v, s, ct: _vjp(
        lambda q, k, v, s, w: mosaic_attention(q, k, v, s, slots=slots), q, k, v, s, None, ct))
    out, grads = attend(q, k, v, jnp.asarray(rows), cotangent)
    ref_out, ref_grads = REFERENCE(q, k, v, jnp.asarray(rows), jnp.int32(FULL), cotangent)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)
    with pytest.raises(ValueError, match=r"slots 5, expected one of \(2, 3, 4\)"):
        mosaic_attention(q, k, v, jnp.asarray(rows), slots=5)


@pytest.mark.slow  # (the fast loop keeps the overlapped softmax with two consumers)
@pytest.mark.parametrize(("lengths", "window"), [([64, 192], None), ([100, 3, 130, 23], 40)])
def test_two_consumers_in_ping_pong_compute_the_same(lengths, window):
    """The forward's ping-pong variant a GPU sweep weighs: two query blocks a CTA, one consumer warpgroup each,
    sharing the key tiles of the union of their ranges, and taking turns on the tensor cores; float32, exact in
    the interpreter, forward and the three gradients. The packings: a pair whose second block is all padding (an
    empty range), and blocks whose documents differ under a sliding window."""
    q, k, v, cotangent = random_qkv((1, 256, 2, 64), kv_heads=1, dtype=jnp.float32, seed=7)
    rows = jnp.asarray(np.repeat(np.arange(1, len(lengths) + 1) % len(lengths), lengths)[None].astype(np.int32))
    attend = jax.jit(lambda q, k, v, s, ct: _vjp(
        lambda q, k, v, s, w: mosaic_attention(q, k, v, s, window=window, consumers=2), q, k, v, s, None, ct))
    out, grads = attend(q, k, v, rows, cotangent)
    ref_out, ref_grads = REFERENCE(q, k, v, rows, jnp.int32(window or FULL), cotangent)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)
    with pytest.raises(ValueError, match=r"consumers 2 with T padded to 64; expected one of \(1, 2\), and T padded "
                                         "to a multiple of 128"):
        mosaic_attention(q[:, :60], k[:, :60], v[:, :60], rows[:, :60], consumers=2)


@pytest.mark.parametrize(("consumers", "slots", "overlap", "key_block"),
                         [(2, 2, True, 64), *(pytest.param(*case, marks=pytest.mark.slow) for case in (
                             (1, 2, True, 64), (2, 3, True, 64), (1, 2, False, 128), (2, 2, True, 128)))])
def test_the_overlapped_softmax_and_the_wider_key_tile_compute_the_same(consumers, slots, overlap, key_block):
    """The forward's intra-warpgroup variant a GPU sweep weighs (``overlap=True``): each step issues the next key
    tile's QK^T before this tile's softmax and waits for it after, alone and with the ping-pong's two consumers
    (where the turn must come before the wait for the next tile, or the ring of 2 deadlocks); and the 128-key
    forward tile ([64, 128] S tiles, ranges in 128-key blocks), alone and with both. float32, exact in the
    interpreter, forward and the three gradients, over blocks with different documents, a sliding window,
    masked and unmasked tiles and a padding tail."""
    q, k, v, cotangent = random_qkv((1, 256, 2, 64), kv_heads=1, dtype=jnp.float32, seed=9)
    rows = jnp.asarray(np.repeat([1, 2, 3, 0], [100, 3, 130, 23])[None].astype(np.int32))
    attend = jax.jit(lambda q, k, v, s, ct: _vjp(lambda q, k, v, s, w: mosaic_attention(
        q, k, v, s, window=40, consumers=consumers, slots=slots, overlap=overlap, key_block=key_block),
        q, k, v, s, None, ct))
    out, grads = attend(q, k, v, rows, cotangent)
    ref_out, ref_grads = REFERENCE(q, k, v, rows, jnp.int32(40), cotangent)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)
    if key_block != 64:  # metadata for other tiles is refused, and so is a tile the kernel has no form for
        with pytest.raises(ValueError, match="metadata was computed for"):
            mosaic_attention(q, k, v, rows, metadata=block_metadata(rows, BLOCK_SIZES), key_block=key_block)
        with pytest.raises(ValueError, match=r"key_block 96, expected one of \(64, 128\)"):
            mosaic_attention(q, k, v, rows, key_block=96)


def test_refuses_what_it_cannot_compute(monkeypatch):
    q, k, v, _ = F32
    ids = jnp.ones((2, 120), jnp.int32)
    with pytest.raises(ValueError, match="head_dim 32, expected one of"):
        mosaic_attention(q[..., :32], k[..., :32], v[..., :32], ids)
    with pytest.raises(ValueError, match="float32 only in interpret mode"):
        mosaic_attention(q, k, v, ids, interpret=False)
    with pytest.raises(ValueError, match="metadata was computed for"):
        mosaic_attention(q, k, v, ids, metadata=block_metadata(ids, type(BLOCK_SIZES)()))
    with pytest.raises(ValueError, match="pass the window to block_metadata"):
        mosaic_attention(q, k, v, ids, metadata=block_metadata(ids, BLOCK_SIZES, 8), window=8)
    # the interpreter on too few XLA CPU threads would hang (a 2-core machine without PJRT_NPROC): refused instead
    monkeypatch.setenv("PJRT_NPROC", "2")
    # a SeqjaxError (ConfigError): the commands print it as one line, exit 2
    with pytest.raises(ConfigError, match="model.attention=pallas_mosaic: interpret mode .*needs 3 XLA CPU threads "
                                          "and this process has 2 .*PJRT_NPROC=4"):
        mosaic_attention(q, k, v, ids, interpret=True)


@pytest.mark.parametrize(("consumers", "overlap", "key_block"), [(1, False, 64), (2, False, 64), (1, True, 64),
                                                                (2, True, 64), (1, False, 128), (2, True, 128)])
def test_lowers_through_mosaic_gpu_for_an_h100(consumers, overlap, key_block):
    """Without a GPU: forward, dQ and dK/dV pass Mosaic GPU's lowering (layouts, TMA, wgmma) for an H100, with one
    consumer warpgroup or two in ping-pong, each with and without the softmax overlapped with the next QK^T, and
    on 128-key forward tiles."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)

    def loss(q, k, v, s):
        return mosaic_attention(q, k, v, s, interpret=False, consumers=consumers, overlap=overlap,
                                key_block=key_block).astype(jnp.float32).sum()

    text = lowered_for_h100(loss, q, kv, kv, ids)
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 3  # forward, dQ, dK/dV


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_a_model_with_sliding_layers_runs_on_it_as_on_xla():
    """model.attention=pallas_mosaic: per-window metadata from the model, packed rows, a sliding window of 20."""
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.model import build_model

    def logits(backend):
        config = load_config(None, ["model.d_model=128", "model.n_layers=2", "model.n_heads=2", "model.head_dim=64",
                                    "model.vocab_size=50", "model.max_seq_len=128", "data.seq_len=128",
                                    f"model.attention={backend}", "model.layer_types=[sliding,full]",
                                    "model.sliding_window=20"])
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (1, 128)))
        segments = jnp.asarray(np.repeat([1, 2], [70, 58])[None])
        positions = jnp.asarray(np.r_[np.arange(70), np.arange(58)][None])
        return build_model(config, rngs=nnx.Rngs(0))(ids, positions=positions, segment_ids=segments)

    np.testing.assert_allclose(logits("pallas_mosaic"), logits("xla"), rtol=1e-5, atol=1e-5)
