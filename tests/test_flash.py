"""The Pallas flash kernel against contract 2's reference: interpret mode on a CPU (CI), the Triton kernel on a GPU.

Shapes are fixed per test so each jitted check compiles once; hypothesis varies only the packing (segment ids),
which the kernel reads as data. T=72 is not a multiple of the 16-token test blocks, so every example also
exercises the internal padding.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.model.attention import attention, masked_attention, reference_attention
from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata, full_blocks, visited_blocks
from seqjax.model.kernels.flash import flash_attention, flash_attention_span
from seqjax.model.mask import segment_mask

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


@st.composite
def packed_row(draw, length: int) -> np.ndarray:
    """One row of segment ids: documents 1, 2, ... then an optional padding tail (0)."""
    kind = draw(st.sampled_from(["many_short", "one_long", "single_tokens", "mixed"]))
    pad = draw(st.one_of(st.just(0), st.integers(1, max(1, length // 3)), st.just(length)))
    body = length - pad
    if kind == "one_long":
        lengths = [body]
    elif kind == "single_tokens":
        lengths = [1] * body
    else:
        top = 8 if kind == "many_short" else max(body, 1)
        lengths = draw(st.lists(st.integers(1, top), min_size=1, max_size=length))
    ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:body]
    return np.concatenate([ids, np.zeros(length - len(ids), int)]).astype(np.int32)


def packed_batch(batch: int, length: int):
    return st.lists(packed_row(length), min_size=batch, max_size=batch).map(np.stack)


def random_qkv(shape, kv_heads, dtype, seed=0):
    """q, k, v and an output cotangent, drawn with NumPy (no jitted RNG to compile)."""
    b, t, h, d = shape
    rng = np.random.default_rng(seed)
    draw = lambda heads: jnp.asarray(rng.standard_normal((b, t, heads, d)), dtype)  # noqa: E731
    return draw(h), draw(kv_heads), draw(kv_heads), draw(h)


def output_and_grads(attend):
    """jit(q, k, v, segment_ids, cotangent) -> (out, (dq, dk, dv)) for an attention function."""

    def run(q, k, v, segment_ids, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
        return out, vjp(cotangent)

    return jax.jit(run)


def assert_close(actual, expected, tol, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(actual).all(), f"{what}: non-finite values"
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale, err_msg=what)


def check_against_reference(flash_fn, q, k, v, segment_ids, cotangent, tol):
    out, grads = flash_fn(q, k, v, segment_ids, cotangent)
    ref_out, ref_grads = REFERENCE(q, k, v, segment_ids, cotangent)
    assert_close(out, ref_out, tol, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, tol, name)
    padding = np.asarray(segment_ids) == 0  # contract 2: padding sees nothing, so exact zeros, never NaN
    assert not np.asarray(out, np.float32)[padding].any()
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert not np.asarray(grad, np.float32)[padding].any(), f"{name} nonzero on padding"


def exact_reference(q, k, v, segment_ids):
    """The reference with float32 matmuls kept exact: on a GPU, XLA's default would use TF32."""
    with jax.default_matmul_precision("highest"):
        return reference_attention(q, k, v, segment_ids)


REFERENCE = output_and_grads(exact_reference)
FLASH_SMALL = output_and_grads(lambda q, k, v, s: flash_attention(q, k, v, s, block_sizes=SMALL))
F32_QKV = random_qkv((2, 72, 4, 12), kv_heads=2, dtype=jnp.float32)  # GQA (2 q heads per kv head); D padded to 16


@settings(max_examples=15, deadline=None)
@given(segment_ids=packed_batch(2, 72))
def test_matches_reference_float32_over_packings(segment_ids):
    q, k, v, cotangent = F32_QKV
    check_against_reference(FLASH_SMALL, q, k, v, jnp.asarray(segment_ids), cotangent, tol=2e-5)


@pytest.mark.parametrize(
    "lengths",
    [[64], [16, 16, 16, 16], [5, 1, 1, 30, 20], [40]],  # one doc; block-aligned docs; ragged + tail; mostly padding
)
def test_matches_reference_bfloat16_head_dim_64(lengths):
    """T=64 (a block multiple), head_dim 64, 4 query heads sharing one kv head; bf16 tolerance."""
    rows = np.zeros((2, 64), np.int32)
    for row, order in zip(rows, (lengths, lengths[::-1])):  # the second row packs the same docs reversed
        row[: sum(order)] = np.repeat(np.arange(1, len(order) + 1), order)
    segment_ids = jnp.asarray(rows)
    q, k, v, cotangent = random_qkv((2, 64, 4, 64), kv_heads=1, dtype=jnp.bfloat16, seed=1)
    check_against_reference(FLASH_SMALL, q, k, v, segment_ids, cotangent, tol=3e-2)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_each_pass_may_use_its_own_tiles():
    """Forward 16x32, dK/dV 32 keys x 16 queries, dQ 32 queries x 16 keys: the ranges of each pass follow its tiles."""
    blocks = BlockSizes(block_q=16, block_k=32, block_q_bwd=16, block_k_bwd=32, block_q_dq=32, block_k_dq=16)
    assert blocks.multiple == 32 and BlockSizes(block_q_bwd=32).block_q_dq == 32  # dQ defaults to the dK/dV tiles
    segment_ids = jnp.asarray(np.stack([np.repeat([1, 2, 3, 0], [20, 7, 40, 5]), np.ones(72, int)]).astype(np.int32))
    q, k, v, cotangent = F32_QKV
    flash = output_and_grads(lambda q, k, v, s: flash_attention(q, k, v, s, block_sizes=blocks))
    check_against_reference(flash, q, k, v, segment_ids, cotangent, tol=2e-5)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_shared_metadata_gives_the_same_result_and_is_checked():
    """A model computes BlockMetadata once per forward and passes it to every layer."""
    q, k, v, _ = F32_QKV
    segment_ids = jnp.asarray(np.repeat(np.arange(1, 5), 18)[None].repeat(2, 0).astype(np.int32))
    metadata = block_metadata(segment_ids, SMALL)
    shared = jax.jit(lambda q, m: flash_attention(q, k, v, segment_ids, metadata=m))(q, metadata)
    np.testing.assert_allclose(shared, exact_reference(q, k, v, segment_ids), atol=2e-5)
    with pytest.raises(ValueError, match="metadata was computed for"):
        flash_attention(q, k, v, segment_ids, metadata=metadata, block_sizes=BlockSizes())
    with pytest.raises(ValueError, match="padded length"):
        flash_attention(q[:, :40], k[:, :40], v[:, :40], segment_ids[:, :40], metadata=metadata)


def test_bad_inputs_raise_before_work():
    q, k, v, _ = F32_QKV
    segment_ids = jnp.ones((2, 72), jnp.int32)
    with pytest.raises(ValueError, match="dtype int32"):
        flash_attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32), segment_ids)
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads"):
        flash_attention(q, jnp.concatenate([k, k[:, :, :1]], 2), jnp.concatenate([v, v[:, :, :1]], 2), segment_ids)
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, k, v, segment_ids[:, :10])
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)


# ------------------------------------------------------------------------------------------- block skipping


SEGMENT_MASK = jax.jit(segment_mask, static_argnames="causal")
BLOCK_METADATA = jax.jit(block_metadata, static_argnums=1, static_argnames="causal")


def tiles(segment_ids: np.ndarray, block_rows: int, block_cols: int, by_key: bool,
          window=None, causal: bool = True, queries=slice(None), keys=slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """([B, n_rows, n_cols] tiles with any allowed pair, tiles with every pair allowed), from segment_mask;
    ``queries``/``keys``: the spans of the row's mask to tile."""
    mask = np.asarray(SEGMENT_MASK(jnp.asarray(segment_ids), window=window, causal=causal))  # [B, query, key]
    mask = mask[:, queries, keys]
    if by_key:
        mask = mask.transpose(0, 2, 1)
    b, rows, cols = mask.shape
    blocked = mask.reshape(b, rows // block_rows, block_rows, cols // block_cols, block_cols)
    return blocked.any(axis=(2, 4)), blocked.all(axis=(2, 4))


def tightest_cover(needed: np.ndarray) -> np.ndarray:
    """The contiguous [lo, hi) per row of tiles that covers every needed tile; (0, 0) when none is."""
    any_tile = needed.any(-1)
    lo = np.where(any_tile, needed.argmax(-1), 0)
    hi = np.where(any_tile, needed.shape[-1] - needed[..., ::-1].argmax(-1), 0)
    return np.stack([lo, hi], -1)


def between(ranges: np.ndarray, lo: int, hi: int, n_cols: int) -> np.ndarray:
    columns = np.arange(n_cols)
    return (columns >= ranges[..., lo : lo + 1]) & (columns < ranges[..., hi : hi + 1])


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), length=st.sampled_from([5, 100]), window=st.one_of(st.none(), st.integers(1, 70)))
def test_visited_tiles_are_the_tightest_cover_and_unmasked_tiles_are_full(data, length, window):
    """Every tile with an allowed pair is visited, the ranges are no wider than needed, and a tile the kernel
    runs without a mask really has every pair allowed: with and without a sliding window."""
    blocks = BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
    segment_ids = data.draw(packed_batch(2, length))
    metadata = BLOCK_METADATA(jnp.asarray(segment_ids), blocks, window)
    padded = np.pad(segment_ids, ((0, 0), (0, metadata.seq_len - length)))
    for ranges, rows, cols, by_key in (
        (metadata.fwd_kv, blocks.block_q, blocks.block_k, False),
        (metadata.dq_kv, blocks.block_q_bwd, blocks.block_k_bwd, False),
        (metadata.dkv_q, blocks.block_k_bwd, blocks.block_q_bwd, True),
    ):
        ranges = np.asarray(ranges)
        needed, full = tiles(padded, rows, cols, by_key, window)
        assert (np.diff(ranges, axis=-1) >= 0).all(), "ranges must be ordered lo <= full_lo <= full_hi <= hi"
        assert not (needed & ~between(ranges, 0, 3, needed.shape[-1])).any(), "a tile with an allowed pair is skipped"
        np.testing.assert_array_equal(ranges[..., [0, 3]], tightest_cover(needed))
        assert not (between(ranges, 1, 2, needed.shape[-1]) & ~full).any(), "an unmasked tile has a masked pair"


@pytest.mark.slow  # (the full suite: 30 draws of spans; the fast loop keeps the kernel's numbers)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), window=st.one_of(st.none(), st.integers(1, 70)))
def test_a_spans_ranges_are_the_tightest_cover_of_its_part_of_the_row(data, window):
    """block_metadata's spans (a row split over mesh.context): a span of queries against a span of keys
    visits exactly the tiles of that part of the row's mask with an allowed pair, counted from the spans'
    first blocks, and runs unmasked only tiles with every pair allowed; the offsets travel with it."""
    blocks = BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
    t, span = 128, 32
    segment_ids = data.draw(packed_batch(2, t))
    q_at, k_at = (data.draw(st.sampled_from(range(0, t, span))) for _ in range(2))
    q_len = data.draw(st.sampled_from([span, 2 * span]).filter(lambda n: q_at + n <= t))
    metadata = block_metadata(jnp.asarray(segment_ids), blocks, window, queries=(jnp.int32(q_at), q_len),
                              keys=(jnp.int32(k_at), span))
    assert (metadata.seq_len, metadata.kv_len, np.asarray(metadata.offsets).tolist()) == (q_len, span, [q_at, k_at])
    queries, keys = slice(q_at, q_at + q_len), slice(k_at, k_at + span)
    for ranges, rows, cols, by_key in (
        (metadata.fwd_kv, blocks.block_q, blocks.block_k, False),
        (metadata.dq_kv, blocks.block_q_bwd, blocks.block_k_bwd, False),
        (metadata.dkv_q, blocks.block_k_bwd, blocks.block_q_bwd, True),
    ):
        ranges = np.asarray(ranges)
        needed, full = tiles(segment_ids, rows, cols, by_key, window, queries=queries, keys=keys)
        assert (np.diff(ranges, axis=-1) >= 0).all(), "ranges must be ordered lo <= full_lo <= full_hi <= hi"
        np.testing.assert_array_equal(ranges[..., [0, 3]], tightest_cover(needed))
        assert not (between(ranges, 1, 2, needed.shape[-1]) & ~full).any(), "an unmasked tile has a masked pair"


def test_a_span_of_the_wrong_length_and_span_metadata_for_a_whole_row_are_refused():
    blocks = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
    ids = jnp.ones((1, 64), jnp.int32)
    with pytest.raises(ValueError, match="queries span of length 24; expected a multiple of 16"):
        block_metadata(ids, blocks, queries=(0, 24))
    spans = block_metadata(ids, blocks, queries=(0, 32), keys=(32, 32))
    q = jnp.ones((1, 32, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="metadata for spans of a row"):
        flash_attention(q, q, q, ids[:, :32], metadata=spans, interpret=True)
    with pytest.raises(ValueError, match="metadata for spans of 32 queries and 32 keys, but q has 32 and k 64"):
        flash_attention_span(q, jnp.ones((1, 64, 2, 16)), jnp.ones((1, 64, 2, 16)), ids[:, :32], ids, spans)


def test_packed_rows_visit_far_fewer_tiles_than_the_causal_triangle():
    """Eight 16-token documents in a 128-token row: only the 8 diagonal tiles, not 36; padding costs nothing."""
    packed = np.repeat(np.arange(1, 9), 16)[None].astype(np.int32)
    one_doc = np.ones((1, 128), np.int32)
    half_padding = np.concatenate([np.ones(64, np.int32), np.zeros(64, np.int32)])[None]

    def count(ids, which=visited_blocks):
        return int(which(BLOCK_METADATA(jnp.asarray(ids), SMALL).fwd_kv, 8).sum())

    assert count(one_doc) == 36  # the causal triangle of 8 x 8 tiles ...
    assert count(one_doc, full_blocks) == 28  # ... of which all but the diagonal run without a mask
    assert count(packed) == 8
    assert count(packed, full_blocks) == 0
    assert count(half_padding) == 10  # the 4 x 4 triangle of the real half; padding query blocks visit nothing
    dkv = BLOCK_METADATA(jnp.asarray(half_padding), SMALL).dkv_q
    assert not np.asarray(dkv)[0, 4:].any()  # padding key blocks run no dK/dV loop either


def test_a_sliding_window_visits_only_the_band():
    """One 128-token document, window 16, 16-token tiles: the diagonal and the one below it (15 tiles, not 36),
    none of them full (every tile crosses the band's edge or the diagonal); window 33 adds one full sub-diagonal."""
    one_doc = jnp.ones((1, 128), jnp.int32)

    def count(window, which=visited_blocks):
        metadata = BLOCK_METADATA(one_doc, SMALL, window)
        return (int(which(metadata.fwd_kv, 8).sum()), int(which(metadata.dkv_q, 8).sum()))

    assert count(16) == (15, 15)
    assert count(16, full_blocks) == (0, 0)
    assert count(33) == (8 + 7 + 6, 8 + 7 + 6)
    assert count(33, full_blocks) == (7, 7)


WINDOWED_REFERENCE = jax.jit(lambda q, k, v, s, w, ct: _vjp(exact_windowed, q, k, v, s, w, ct))
WINDOWED_FLASH = jax.jit(lambda q, k, v, s, w, ct: _vjp(
    lambda q, k, v, s, w: flash_attention(q, k, v, s, block_sizes=SMALL, window=w), q, k, v, s, w, ct))


def exact_windowed(q, k, v, segment_ids, window):
    with jax.default_matmul_precision("highest"):
        return reference_attention(q, k, v, segment_ids, window=window)


def _vjp(attend, q, k, v, segment_ids, window, cotangent):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids, window), q, k, v)
    return out, vjp(cotangent)


@settings(max_examples=15, deadline=None)
@given(segment_ids=packed_batch(2, 72), window=st.integers(1, 80))
def test_sliding_windows_match_the_dense_mask_over_packings(segment_ids, window):
    """Output and all three gradients under a sliding window equal the XLA path on segment_mask(window=...);
    the window is traced, as a scanned model's per-layer window is (one compile serves every window)."""
    q, k, v, cotangent = F32_QKV
    segment_ids, w = jnp.asarray(segment_ids), jnp.int32(window)
    out, grads = WINDOWED_FLASH(q, k, v, segment_ids, w, cotangent)
    ref_out, ref_grads = WINDOWED_REFERENCE(q, k, v, segment_ids, w, cotangent)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)


def test_a_window_given_twice_is_refused():
    q, k, v, _ = F32_QKV
    segment_ids = jnp.ones((2, 72), jnp.int32)
    with pytest.raises(ValueError, match="pass the window to block_metadata"):
        flash_attention(q, k, v, segment_ids, metadata=block_metadata(segment_ids, SMALL, 8), window=8)


# ------------------------------------------------------------------------------------------- training-like


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_sgd_on_an_attention_layer_matches_xla():
    """A few SGD steps of a one-layer attention regressor give the same losses with the kernel as with XLA."""
    b, t, width, heads, head_dim = 2, 40, 32, 2, 16
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (b, t, width))
    y = jax.random.normal(keys[1], (b, t, width))
    segment_ids = jnp.asarray(np.stack([np.repeat([1, 2, 3, 0], 10), np.repeat([1, 1, 2, 2], 10)]).astype(np.int32))
    params0 = {n: 0.2 * jax.random.normal(kk, (width, heads * head_dim)) for n, kk in zip("qkvo", keys[2:])}

    def train(attend):
        def loss_fn(params):
            def heads_of(name):
                return (x @ params[name]).reshape(b, t, heads, head_dim)

            o = attend(heads_of("q"), heads_of("k"), heads_of("v"), segment_ids).reshape(b, t, -1)
            err = (o @ params["o"].T - y) ** 2 * (segment_ids != 0)[..., None]
            return err.mean()

        @jax.jit
        def step(params):
            loss, grads = jax.value_and_grad(loss_fn)(params)
            return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

        params, losses = params0, []
        for _ in range(4):
            params, loss = step(params)
            losses.append(float(loss))
        return losses

    with jax.default_matmul_precision("highest"):  # a GPU would otherwise run the projections in TF32
        xla = train(reference_attention)
        pallas = train(lambda q, k, v, s: flash_attention(q, k, v, s, block_sizes=SMALL))
    assert xla[-1] < xla[0]  # the steps do train
    np.testing.assert_allclose(pallas, xla, rtol=1e-5)


# ------------------------------------------------------------------------------------------- GPU lowering


def lowered_for_h100(loss, *args) -> str:
    """The text of ``jit(grad(loss))`` over q, k, v (the first three of ``args``, ShapeDtypeStructs) lowered for an
    abstract H100 (AOT, no GPU needed): what each kernel's lowering tests read."""
    return h100_lowering(jax.grad(loss, argnums=(0, 1, 2)), *args)


def h100_lowering(fn, *args) -> str:
    """The text of ``jit(fn)`` over ``args`` (ShapeDtypeStructs) lowered for an abstract H100."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,),
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda"),
    )
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton lowering is deprecated in jax 0.11
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(("head_dim", "dtype", "window"), [(128, jnp.bfloat16, None), (256, jnp.float16, 100)])
def test_lowers_to_triton_for_h100(head_dim, dtype, window):
    """Without a GPU, check that forward, dQ and dK/dV pass Pallas's Triton lowering (AOT, abstract H100)."""
    q = jax.ShapeDtypeStruct((1, 200, 6, head_dim), dtype)  # T not a block multiple; 3 query heads per kv head
    kv = jax.ShapeDtypeStruct((1, 200, 2, head_dim), dtype)
    segment_ids = jax.ShapeDtypeStruct((1, 200), jnp.int32)

    def loss(q, k, v, s):
        return flash_attention(q, k, v, s, interpret=False, window=window).astype(jnp.float32).sum()

    text = lowered_for_h100(loss, q, kv, kv, segment_ids)
    assert text.count("__gpu$xla.gpu.triton") == 3
    for kernel in ("seqjax_flash_forward", "seqjax_flash_dq", "seqjax_flash_dkv"):
        assert kernel in text


# ------------------------------------------------------------------------------------------- non-causal


def exact_non_causal(q, k, v, segment_ids):
    with jax.default_matmul_precision("highest"):
        return masked_attention(q, k, v, segment_mask(segment_ids, causal=False))


NON_CAUSAL_REFERENCE = output_and_grads(exact_non_causal)
NON_CAUSAL_FLASH = output_and_grads(lambda q, k, v, s: flash_attention(q, k, v, s, block_sizes=SMALL, causal=False))


@settings(max_examples=15, deadline=None)
@given(segment_ids=packed_batch(2, 72))
def test_the_non_causal_form_matches_the_dense_mask_over_packings(segment_ids):
    """Contract 2's non-causal form (a vision encoder's images: each sees its whole segment, nothing else): output
    and all three gradients equal the XLA path on segment_mask(causal=False), padding exact zeros."""
    q, k, v, cotangent = F32_QKV
    segment_ids = jnp.asarray(segment_ids)
    out, grads = NON_CAUSAL_FLASH(q, k, v, segment_ids, cotangent)
    ref_out, ref_grads = NON_CAUSAL_REFERENCE(q, k, v, segment_ids, cotangent)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)
    padding = np.asarray(segment_ids) == 0
    assert not np.asarray(out)[padding].any()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), length=st.sampled_from([5, 100]))
def test_non_causal_tiles_are_the_tightest_cover_and_unmasked_tiles_are_full(data, length):
    """The non-causal ranges visit every tile with an allowed pair (above the diagonal too), no wider than
    needed, and run unmasked only tiles whose every pair is allowed."""
    blocks = BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
    segment_ids = data.draw(packed_batch(2, length))
    metadata = BLOCK_METADATA(jnp.asarray(segment_ids), blocks, causal=False)
    padded = np.pad(segment_ids, ((0, 0), (0, metadata.seq_len - length)))
    for ranges, rows, cols, by_key in ((metadata.fwd_kv, blocks.block_q, blocks.block_k, False),
                                       (metadata.dkv_q, blocks.block_k_bwd, blocks.block_q_bwd, True)):
        ranges = np.asarray(ranges)
        needed, full = tiles(padded, rows, cols, by_key, causal=False)
        assert (np.diff(ranges, axis=-1) >= 0).all()
        np.testing.assert_array_equal(ranges[..., [0, 3]], tightest_cover(needed))
        assert not (between(ranges, 1, 2, needed.shape[-1]) & ~full).any(), "an unmasked tile has a masked pair"


def test_non_causal_metadata_is_checked_and_takes_no_window():
    q, k, v, _ = F32_QKV
    segment_ids = jnp.ones((2, 72), jnp.int32)
    with pytest.raises(ValueError, match="metadata was computed with causal=True, not causal=False"):
        flash_attention(q, k, v, segment_ids, causal=False, metadata=block_metadata(segment_ids, SMALL))
    with pytest.raises(ValueError, match="a window with causal=False"):
        block_metadata(segment_ids, SMALL, window=8, causal=False)


def test_a_span_lowers_to_triton_for_h100():
    """A split row's span (256 queries against 512 keys, its offsets traced) passes the Triton lowering, its
    log-sum-exp differentiated too: the three passes, as for a whole row."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1, 1024), jnp.int32)

    def loss(q, k, v, row, at):
        metadata = block_metadata(row, BlockSizes.for_head_dim(128), 300, queries=(at, 256), keys=(at - 512, 512))
        out, lse = flash_attention_span(q, k, v, row[:, :256], row[:, :512], metadata, interpret=False)
        return out.astype(jnp.float32).sum() + lse.sum()

    text = lowered_for_h100(loss, q, kv, kv, row, jax.ShapeDtypeStruct((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 3


SINKS = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)


def sink_grads(attend):
    """jit(q, k, v, segment_ids, cotangent, sinks) -> (out, (dq, dk, dv, dsinks)) for attention with sinks."""

    def run(q, k, v, segment_ids, cotangent, sinks):
        out, vjp = jax.vjp(lambda q, k, v, s: attend(q, k, v, segment_ids, s), q, k, v, sinks)
        return out, vjp(cotangent)

    return jax.jit(run)


SINK_REFERENCE = sink_grads(lambda q, k, v, seg, s: reference_attention(q, k, v, seg, sinks=s))
SINK_FLASH = sink_grads(lambda q, k, v, seg, s: attention(q, k, v, seg, backend="pallas", sinks=s))


@settings(max_examples=6, deadline=None)
@given(segment_ids=packed_batch(2, 72))
def test_attention_sinks_on_the_flash_kernel_equal_the_dense_softmax_with_them(segment_ids):
    """gpt-oss's sinks (a logit per head in every query's softmax) on the flash kernel, its output rescaled by
    the sink's share of each query's log-sum-exp: the dense softmax with the sink column, output and the
    gradients of q, k, v and the sinks, over any packing; padding stays exactly zero."""
    q, k, v, cotangent = F32_QKV
    segment_ids = jnp.asarray(segment_ids)
    with jax.default_matmul_precision("highest"):
        out, grads = SINK_FLASH(q, k, v, segment_ids, cotangent, SINKS)
        ref_out, ref_grads = SINK_REFERENCE(q, k, v, segment_ids, cotangent, SINKS)
    assert_close(out, ref_out, 2e-5, "output")
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(got, want, 2e-5, name)
    assert not np.asarray(out)[np.asarray(segment_ids) == 0].any()


def test_sinks_take_weight_off_the_keys_and_other_backends_refuse_them():
    """A sink's weight leaves the keys (a row of one document differs with sinks and without); a backend that
    cannot honour them refuses in one line, never computing attention without them."""
    from seqjax.core.errors import ConfigError

    q, k, v, _ = F32_QKV
    ones = jnp.ones(q.shape[:2], jnp.int32)
    assert float(jnp.abs(reference_attention(q, k, v, ones) - reference_attention(q, k, v, ones, sinks=SINKS)).max()
                 ) > 1e-2
    with pytest.raises(ConfigError, match="model.attention: got 'splash', which cannot take attention sinks"):
        attention(q, k, v, ones, backend="splash", sinks=SINKS)
