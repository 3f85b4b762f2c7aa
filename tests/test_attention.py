"""Attention dispatch: segment isolation at the attention level, GQA, backend choice and its errors."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.core.errors import ConfigError
from seqjax.model import attention as attn
from seqjax.model.attention import attention, resolve_backend
from test_train_support import with_devices

T, H, HKV, D = 16, 4, 2, 16


def qkv(seed: int, b: int = 1, t: int = T, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, H, D), dtype), jax.random.normal(kk, (b, t, HKV, D), dtype),
            jax.random.normal(kv, (b, t, HKV, D), dtype))


def segments_from_lengths(lengths: list[int], t: int) -> np.ndarray:
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(t - sum(lengths))])
    return ids.astype(np.int32)[None]


packings = st.lists(st.integers(1, 6), min_size=1, max_size=5).map(
    lambda lengths: [n for i, n in enumerate(lengths) if sum(lengths[: i + 1]) <= T] or [T]
)
xla_attention = jax.jit(lambda q, k, v, s: attention(q, k, v, s, backend="xla"))


@settings(max_examples=25, deadline=None)
@given(lengths=packings, seed=st.integers(0, 2**16))
def test_each_segment_attends_as_if_alone_and_padding_gives_zeros(lengths, seed):
    q, k, v = qkv(seed)
    segment_ids = segments_from_lengths(lengths, T)
    out = np.asarray(xla_attention(q, k, v, segment_ids))
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        alone_ids = segments_from_lengths([n], T)
        pad = lambda a: jnp.pad(a[:, piece], ((0, 0), (0, T - n), (0, 0), (0, 0)))  # noqa: E731
        alone = np.asarray(xla_attention(pad(q), pad(k), pad(v), alone_ids))[:, :n]
        np.testing.assert_allclose(out[:, piece], alone, rtol=1e-5, atol=1e-6)
        start += n
    assert (out[:, start:] == 0).all()


def test_grouped_query_equals_multi_head_with_repeated_kv_heads():
    q, k, v = qkv(0, b=2)
    segment_ids = np.concatenate([segments_from_lengths([5, 11], T), segments_from_lengths([3, 4, 2], T)])
    repeat = lambda a: jnp.repeat(a, H // HKV, axis=2)  # noqa: E731
    np.testing.assert_allclose(np.asarray(xla_attention(q, k, v, segment_ids)),
                               np.asarray(xla_attention(q, repeat(k), repeat(v), segment_ids)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, s: (q[0], k, v, s), r"q has shape \(16, 4, 16\), expected \[batch, seq, heads, head_dim\]"),
        (
            lambda q, k, v, s: (q, k[:, :8], v[:, :8], s),
            r"k/v have shape \(1, 8, 2, 16\), expected \[1, 16, kv_heads, 16\]",
        ),
        (lambda q, k, v, s: (q, k, v[..., :4], s), "k has shape .* but v has"),
        (lambda q, k, v, s: (q[:, :, :3], k, v, s), "3 query heads is not a multiple of 2"),
        (lambda q, k, v, s: (q, k, v.astype(jnp.bfloat16), s), "dtypes differ"),
        (lambda q, k, v, s: (q, k, v, s[:, :8]), r"segment_ids has shape \(1, 8\), expected \[1, 16\]"),
        (lambda q, k, v, s: (q, k, v, s.astype(np.float32)), "segment_ids dtype is float32"),
    ],
)
def test_bad_shapes_and_dtypes_fail_at_trace_time(change, message):
    args = change(*qkv(0), segments_from_lengths([T], T))
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda: attention(*args, backend="xla"))


def test_unknown_backend_and_cudnn_off_gpu_are_refused():
    with pytest.raises(ValueError, match="model.attention: got 'flash', expected one of auto, xla"):
        attention(*qkv(0), segments_from_lengths([T], T), backend="flash")
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="model.attention: got 'cudnn', which needs an NVIDIA GPU; this machine's "
                                              "JAX platform is cpu"):
            attention(*qkv(0), segments_from_lengths([T], T), backend="cudnn")


def test_a_missing_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(attn._KERNELS, "pallas", ("seqjax.model.kernels.not_there", "flash_attention"))
    with pytest.raises(
        RuntimeError, match="model.attention='pallas' needs seqjax.model.kernels.not_there.flash_attention"
    ):
        attention(*qkv(0), segments_from_lengths([T], T), backend="pallas")


@pytest.mark.parametrize("platform", ["cpu", "METAL"])
def test_auto_picks_xla_where_no_kernel_runs_and_says_so(monkeypatch, caplog, platform):
    """Asserted on every machine: the platform is set here, not read from the one the tests run on."""
    from seqjax.core import progress

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(progress, "_SAID", set())  # (said once a process: an earlier test may have said it)
    with caplog.at_level(logging.INFO, logger="seqjax.model.attention"):
        assert resolve_backend("auto") == "xla"
    assert f"using xla on platform {platform}" in caplog.text


@pytest.mark.parametrize("dtype, expected", [(jnp.bfloat16, "cudnn"), (jnp.float32, "xla")])
def test_auto_on_a_gpu_without_the_kernel_falls_back_and_says_why(monkeypatch, caplog, dtype, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(attn._KERNELS, "pallas", ("seqjax.model.kernels.not_there", "flash_attention"))
    with caplog.at_level(logging.WARNING, logger="seqjax.model.attention"):
        assert resolve_backend("auto", dtype) == expected
    assert "not_there" in caplog.text


def test_auto_on_a_gpu_with_the_kernel_picks_pallas(monkeypatch):
    pytest.importorskip("seqjax.model.kernels.flash")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_backend("auto", jnp.bfloat16) == "pallas"


def test_kernel_backends_receive_the_batch_and_scale(monkeypatch):
    """The dispatch hands a kernel q, k, v, segment_ids and scale untouched (kernel numerics are D's tests)."""
    calls = []

    def fake_kernel(q, k, v, segment_ids, *, scale=None):
        calls.append((q, k, v, segment_ids, scale))
        return q

    monkeypatch.setattr(attn, "_load_kernel", lambda name: fake_kernel)
    q, k, v = qkv(1)
    segment_ids = segments_from_lengths([6, 7], T)
    for backend in ("pallas", "splash"):
        assert attention(q, k, v, segment_ids, backend=backend, scale=0.3) is q
    assert len(calls) == 2
    for got in calls:
        assert got[0] is q and got[1] is k and got[2] is v and got[4] == 0.3
        np.testing.assert_array_equal(got[3], segment_ids)


def test_cudnn_path_passes_the_segment_mask_densely(monkeypatch):
    """Off a GPU: the same call with XLA's implementation of dot_product_attention checks mask and padding plumbing."""
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn, "dot_product_attention", lambda *a, implementation, **kw: real(*a, implementation="xla", **kw)
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v = qkv(4, b=2, dtype=jnp.bfloat16)
    segment_ids = np.concatenate([segments_from_lengths([5, 7], T), segments_from_lengths([T], T)])
    dense = np.asarray(attention(q, k, v, segment_ids, backend="cudnn"), np.float32)
    np.testing.assert_allclose(dense, np.asarray(xla_attention(q, k, v, segment_ids), np.float32), rtol=2e-2, atol=2e-2)
    assert (dense[0, 12:] == 0).all()
    with pytest.raises(ConfigError, match="'cudnn', which needs bfloat16 or float16, got float32"):
        attention(*qkv(0), segment_ids[:1], backend="cudnn")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_backend_matches_xla_in_bfloat16():
    q, k, v = qkv(2, b=2, t=128, dtype=jnp.bfloat16)
    segment_ids = np.concatenate([segments_from_lengths([40, 60], 128), segments_from_lengths([128], 128)])

    def run(backend):
        return np.asarray(jax.jit(lambda *a: attention(*a, backend=backend))(q, k, v, segment_ids), np.float32)

    cudnn, xla = run("cudnn"), run("xla")
    np.testing.assert_allclose(cudnn, xla, rtol=2e-2, atol=2e-2)
    assert (cudnn[0, 100:] == 0).all()  # padding rows zeroed


PACKED_OFFSETS = jax.jit(attn.packed_offsets)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=6), min_size=3, max_size=3))
def test_packed_offsets_give_cudnn_the_segments_of_segment_mask(rows):
    """cudnn_packed's conversion: rebuilding a mask from (seqlen, offsets), causal inside each listed segment,
    gives segment_mask exactly, padding in no segment. Rows of 54 (one compile), their tails padding."""
    t = 54
    segment_ids = np.stack([segments_from_lengths(r, t)[0] for r in rows])
    seqlen, offsets = (np.asarray(a) for a in PACKED_OFFSETS(jnp.asarray(segment_ids)))
    assert seqlen.shape == (len(rows), t) and offsets.shape == (len(rows), t + 1) and (offsets[:, -1] == -1).all()
    rebuilt = np.zeros((len(rows), t), int)
    for b in range(len(rows)):
        listed = seqlen[b] >= 0
        assert listed.sum() == len(rows[b]) and (offsets[b, :t] >= 0).sum() == len(rows[b])
        for k, (start, length) in enumerate(zip(offsets[b][:t][listed], seqlen[b][listed])):
            rebuilt[b, start:start + length] = k + 1
    np.testing.assert_array_equal(rebuilt[:, :, None] == rebuilt[:, None, :], segment_ids[:, :, None] ==
                                  segment_ids[:, None, :])  # the same documents, so segment_mask's same mask
    np.testing.assert_array_equal(rebuilt == 0, segment_ids == 0)


def test_cudnn_packed_is_refused_as_a_runs_backend_even_on_a_gpu(monkeypatch):
    """Until a GPU shows cuDNN's packed layout works, a run that names it is refused in one line, with why."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ConfigError, match="got 'cudnn_packed', refused until a GPU shows it works: on an H200"):
        resolve_backend("cudnn_packed", jnp.bfloat16)
    assert resolve_backend("cudnn", jnp.bfloat16) == "cudnn"


def test_cudnn_packed_is_refused_off_a_gpu_in_float32_and_with_windows():
    q, k, v = qkv(0)
    ids = segments_from_lengths([T], T)
    with pytest.raises(ConfigError, match="'cudnn_packed', which needs an NVIDIA GPU"):
        attention(q, k, v, ids, backend="cudnn_packed")
    with pytest.raises(ConfigError, match="'cudnn_packed', which does not compute sliding windows"):
        resolve_backend("cudnn_packed", jnp.bfloat16, windows=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_packed_matches_xla_in_bfloat16():
    q, k, v = qkv(3, b=2, t=128, dtype=jnp.bfloat16)
    segment_ids = np.concatenate([segments_from_lengths([40, 1, 59], 128), segments_from_lengths([128], 128)])

    packed = np.asarray(jax.jit(lambda *a: attn._cudnn_packed_attention(*a, max_segments=3))(
        q, k, v, segment_ids), np.float32)
    xla = np.asarray(jax.jit(lambda *a: attention(*a, backend="xla"))(q, k, v, segment_ids), np.float32)
    np.testing.assert_allclose(packed, xla, rtol=2e-2, atol=2e-2)
    assert (packed[0, 100:] == 0).all()


SHARDED_RUN = """
import json
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from seqjax.model.attention import _device_layout, attention, reference_attention
from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata

B, T, H, HKV, D = 4, 24, 4, 2, 16
rng = np.random.default_rng(0)
q, k, v, cot = (rng.normal(size=(B, T, h, D)).astype(np.float32) for h in (H, HKV, HKV, H))
segment_ids = np.array([np.repeat([1, 2, 0], [10, 10, 4]), np.ones(T), np.repeat([3, 4], [5, 19]),
                        np.repeat([1, 0], [20, 4])], np.int32)

def loss(fn):
    return lambda q, k, v, s: (fn(q, k, v, s) * cot).sum()

def compare(fn, place, in_shardings=None):
    args = [place(a) for a in (q, k, v, segment_ids)]
    fwd = jax.jit(fn, in_shardings=in_shardings).lower(*args).compile()
    grad = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)), in_shardings=in_shardings).lower(*args).compile()
    reference_grad = jax.grad(loss(reference_attention), argnums=(0, 1, 2))
    want = [reference_attention(q, k, v, segment_ids)] + list(reference_grad(q, k, v, segment_ids))
    got = [fwd(*args)] + list(grad(*args))
    hlo = fwd.as_text() + grad.as_text()
    return {"error": max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want)),
            "all_gather": "all-gather" in hlo}

axes = ("data", "fsdp", "tensor")
results = {}
# rows over data x fsdp; the mesh is found on the arguments' shardings (jit in_shardings, no mesh context)
mesh = jax.make_mesh((2, 2, 1), axes, axis_types=(jax.sharding.AxisType.Auto,) * 3)
rows = NamedSharding(mesh, P(("data", "fsdp")))
metadata = lambda s: block_metadata(s, BlockSizes.for_head_dim(D))
results["pallas"] = compare(lambda q, k, v, s: attention(q, k, v, s, backend="pallas", metadata=metadata(s)),
                            lambda a: jax.device_put(a, rows), in_shardings=rows)
# rows over fsdp, heads over tensor, under jax.set_mesh
mesh = jax.make_mesh((1, 2, 2), axes, axis_types=(jax.sharding.AxisType.Auto,) * 3)
heads = NamedSharding(mesh, P("fsdp", None, "tensor"))
with jax.set_mesh(mesh):
    # host arrays: the mesh comes from the context
    results["context_layout"] = repr(_device_layout(q, k, segment_ids)[1:])
    results["splash"] = compare(lambda q, k, v, s: attention(q, k, v, s, backend="splash"),
                                lambda a: jax.device_put(a, heads if a.ndim == 4 else NamedSharding(mesh, P("fsdp"))))
print(json.dumps(results))
"""


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_kernels_run_per_device_shard_on_a_mesh():
    """On 4 forced host devices, batch-sharded (and head-sharded) inputs: pallas and splash (interpret mode) give
    the reference output and gradients, and the compiled programs gather nothing (each device runs the kernel on
    its own rows and heads). Without the per-shard dispatch XLA all-gathers q/k/v around the kernel."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": with_devices(4), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for backend in ("pallas", "splash"):
        assert results[backend]["error"] < 1e-4, (backend, results[backend])
        assert not results[backend]["all_gather"], (backend, results[backend])
    assert results["context_layout"] == "(('fsdp',), 'tensor')"
