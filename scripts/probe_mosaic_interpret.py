"""What Pallas's Mosaic GPU interpret mode runs on a CPU: one small case per construct, each checked (JSON).

    python scripts/probe_mosaic_interpret.py

JAX 0.11 runs Mosaic GPU kernels on the CPU under
``plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())``. seqjax's GPU
kernel needs TMA copies, barriers, wgmma, loops whose bounds come from
per-tile metadata, and warp specialization; this script tries each alone, plus
the kernels bundled with JAX, and reports for each case "ok" (ran, and the
result matched numpy) or the first line of its error. The last line printed is
one JSON object.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import traceback

# The interpreter needs more XLA CPU threads than a 2-core machine gives (seqjax/model/kernels/mosaic.py says why);
# XLA reads this when JAX starts.
os.environ.setdefault("PJRT_NPROC", str(max(4, os.cpu_count() or 1)))

import jax  # noqa: E402  (after PJRT_NPROC)
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def pallas_call_whole_arrays():
    x = jnp.arange(2 * 128, dtype=jnp.float32).reshape(2, 128)

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    np.testing.assert_array_equal(out, np.asarray(x) * 2)


@case
def pallas_call_grid_with_block_specs():
    x = jnp.ones((4, 128), jnp.float32)

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((1, 128), lambda i: (i, 0))
    out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), in_specs=[spec],
                         out_specs=spec)(x)
    np.testing.assert_array_equal(out, 2 * np.ones((4, 128)))


def _tile_copy_kernel(x_gmem, o_gmem, smem, barrier):
    i = lax.axis_index("tiles")
    plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(i * 64, 64)], smem, barrier)
    plgpu.barrier_wait(barrier)
    smem[...] = smem[...] + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem.at[pl.ds(i * 64, 64)])
    plgpu.wait_smem_to_gmem(0)


@case
def kernel_grid_tma_copies_and_barriers():
    x = jnp.arange(4 * 64 * 64, dtype=jnp.float32).reshape(4 * 64, 64)
    f = plgpu.kernel(_tile_copy_kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                     grid_names=("tiles",),
                     scratch_types=[plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=1)])
    np.testing.assert_array_equal(f(x), np.asarray(x) + 1)


@case
def wgmma_from_smem_tiles():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)

    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, barrier, o_smem):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier)
        plgpu.barrier_wait(barrier)

        def product(acc_ref):  # the accumulator lives in registers: a scope of its own, as the bundled matmul's
            plgpu.wgmma(acc_ref, a_smem, b_smem)
            plgpu.wgmma_wait(0)
            o_smem[...] = acc_ref[...]

        pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                     scratch_types=[plgpu.SMEM((64, 64), jnp.bfloat16), plgpu.SMEM((64, 64), jnp.bfloat16),
                                    plgpu.Barrier(num_arrivals=1), plgpu.SMEM((64, 64), jnp.float32)])
    want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    np.testing.assert_allclose(f(a, b), want, rtol=1e-2, atol=1e-2)


@case
def loop_bounds_read_from_metadata():
    """A tile loop whose trip count is data (the per-tile segment ranges that let a kernel skip empty tiles)."""
    bounds = jnp.asarray([3, 0, 2, 1], jnp.int32)

    def body(bounds_gmem, o_gmem, smem, barrier):
        i = lax.axis_index("tiles")
        n = bounds_gmem[i]

        def add_one(_, acc):
            return acc + 1.0

        smem[...] = jnp.full((64,), lax.fori_loop(0, n, add_one, jnp.float32(0.0)), jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem.at[i])
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4, 64), jnp.float32), grid=(4,), grid_names=("tiles",),
                     scratch_types=[plgpu.SMEM((64,), jnp.float32), plgpu.Barrier(num_arrivals=1)])
    np.testing.assert_array_equal(f(bounds)[:, 0], np.asarray(bounds, np.float32))


@case
def warp_specialized_producer_and_consumer():
    """Warpgroup 1 loads a tile (the producer), warpgroup 0 waits on the barrier and uses it (the consumer)."""
    x = jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64)

    def body(x_gmem, o_gmem, smem, barrier):
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _produce():
            plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)

        @pl.when(wg == 0)
        def _consume():
            plgpu.barrier_wait(barrier)
            smem[...] = smem[...] * 3.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), num_threads=2, thread_name="wg",
                     scratch_types=[plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=1)])
    np.testing.assert_array_equal(f(x), np.asarray(x) * 3)


@case
def emit_pipeline_over_tiles():
    x = jnp.arange(4 * 64 * 64, dtype=jnp.float32).reshape(4 * 64, 64)

    def body(x_gmem, o_gmem):
        def step(_, x_smem, o_smem):
            o_smem[...] = x_smem[...] + 1.0

        spec = plgpu.BlockSpec((64, 64), lambda i: (i, 0))
        plgpu.emit_pipeline(step, grid=(4,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2)(x_gmem,
                                                                                                      o_gmem)

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))
    np.testing.assert_array_equal(f(x), np.asarray(x) + 1)


@case
def bundled_hopper_wgmma_matmul():
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as mm

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(256, 128)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(128, 256)), jnp.bfloat16)
    config = mm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, epi_tile_m=None,
                             epi_tile_n=None, grid_minor_dim=mm.MatmulDimension.M, grid_tile_width=1,
                             wg_dimension=mm.MatmulDimension.N, cluster_dimension=None)
    mm.get_num_sms = lambda: 2  # the CPU has no SM count to ask
    out = mm.matmul(a, b, None, config)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(a, np.float32) @ np.asarray(b, np.float32),
                               rtol=5e-2, atol=5e-1)


@case
def bundled_warp_specialized_attention():
    from jax.experimental.pallas.ops.gpu import attention_mgpu as att

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, 1, 64)), jnp.float16) for _ in range(3))
    out = att.attention(q, k, v, att.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2))
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(att.attention_reference(q, k, v), np.float32), rtol=2e-2, atol=2e-2)


def run(name: str, fn) -> dict:
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
            fn()
        return {"case": name, "result": "ok"}
    except Exception as err:  # noqa: BLE001 - the probe's point is to report every failure, whatever it is
        return {"case": name, "result": "fails", "error": _cause(err)}


def _cause(err: BaseException) -> str:
    """The innermost error of the chain, with the source line that raised it when its message is empty."""
    while err.__cause__ is not None and type(err.__cause__).__name__ != "JaxStackTraceBeforeTransformation":
        err = err.__cause__
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    # A callback's error carries the callback's own traceback: its last line is the error
    message = lines[-1] if lines and "Traceback" in str(err) else (lines[0] if lines else "")
    if not message:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        message = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}: {frame.line}"
    return f"{type(err).__name__}: {message[:300]}"


def main() -> None:
    rows = []
    for name, fn in CASES.items():
        rows.append(run(name, functools.partial(fn)))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"probe": "mosaic_gpu_interpret", "date": datetime.date.today().isoformat(),
                      "jax": jax.__version__, "backend": jax.default_backend(), "cases": rows}))


if __name__ == "__main__":
    main()
