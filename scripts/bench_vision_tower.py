"""The vision tower's forward pass over one packed patch stream: the dense non-causal mask (xla) against the flash
kernel's non-causal form (pallas), at a real tower's shape, on the same images.

    python scripts/bench_vision_tower.py [--shape qwen2_5_vl_7b|qwen3_vl_8b|toy] [--patches 16384] [--iters 5]

The stream: images of random sides (in merged groups of 2 x 2 patches, 4 to 32 groups a side) packed in order
while they fit in ``--patches``, the rest padding, as one batch row's stream is. Qwen2.5-VL-7B's tower
(``qwen2_5_vl_7b``: 32 blocks, 1280 wide, 112-pixel windows with four full blocks) has two masks a forward, its
windows' and its images'; Qwen3-VL-8B's (``qwen3_vl_8b``: 27 blocks, 1152 wide, DeepStack) one. Random weights
(the timing does not depend on them), compute in ``--dtype``. Reported for each backend: the forward's median
milliseconds over ``--iters`` calls after a compile, and the largest difference from xla's image tokens relative
to their scale; for xla, the bytes of its dense masks. Off a GPU the kernel runs in Pallas's interpreter (its
times mean nothing there; ``--shape toy`` is what scripts/gpu_suite.py's dry run uses). The last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.vision import QWEN2_5_VL, VisionConfig
from seqjax.model.vision import VisionTower
from seqjax.store.images import patch_inputs

SHAPES = {
    "qwen2_5_vl_7b": VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                                  out_hidden_size=3584, hidden_act="silu", window_size=112,
                                  fullatt_block_indexes=[7, 15, 23, 31], **QWEN2_5_VL),
    "qwen3_vl_8b": VisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                                out_hidden_size=4096, num_position_embeddings=2304,
                                deepstack_visual_indexes=[8, 16, 24]),
    "toy": VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, out_hidden_size=32,
                        hidden_act="silu", window_size=56, fullatt_block_indexes=[1], **QWEN2_5_VL),
}


def stream(patches: int, seed: int) -> tuple[list[tuple[int, int, int]], dict[str, np.ndarray]]:
    """Image grids (t, h, w in patches) packed in order while they fit, and their patch inputs."""
    rng = np.random.default_rng(seed)
    grids, used = [], 0
    for _ in range(10_000):  # (an image that does not fit is drawn again, smaller ones still may)
        h, w = (2 * int(x) for x in rng.integers(4, 33, 2))
        if used + h * w <= patches:
            grids.append((1, h, w))
            used += h * w
        if patches - used < 64:
            break
    return grids, patch_inputs(grids, 2, patches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2_5_vl_7b")
    p.add_argument("--patches", type=int, default=16384, help="the stream's patch budget (a row's)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--impls", default="xla,pallas")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    grids, inputs = stream(args.patches, args.seed)
    base = SHAPES[args.shape]
    rng = np.random.default_rng(args.seed + 1)
    pixels = jnp.asarray(rng.standard_normal((args.patches, base.patch_dim)), jnp.float32)
    fields = [jnp.asarray(inputs[k]) for k in ("segment_ids", "rows", "columns", "heights", "widths")]
    records, reference = [], None
    for impl in args.impls.split(","):
        cfg = dataclasses.replace(base, attention=impl)
        tower = VisionTower(cfg, nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
        forward = jax.jit(lambda m, x, *f: m(x, *f)[0])
        record = {"impl": impl}
        try:
            tokens = np.asarray(forward(tower, pixels, *fields).astype(jnp.float32))  # (the compile)
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                forward(tower, pixels, *fields).block_until_ready()
                times.append(1000 * (time.perf_counter() - start))
            record["fwd_ms"] = round(statistics.median(times), 3)
            if reference is None:
                reference = tokens
            record["rel_err_vs_first"] = float(np.abs(tokens - reference).max() / np.abs(reference).max())
            if impl == "xla":
                record["dense_mask_bytes"] = (1 + bool(cfg.window_size)) * args.patches**2
        except Exception as err:  # a backend that cannot run here: recorded, the next still runs
            record["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        records.append(record)
        print(json.dumps(record), flush=True)
    print(json.dumps({"bench": "vision_tower", "shape": args.shape, "patches": args.patches,
                      "images": len(grids), "real_patches": int((inputs["segment_ids"] > 0).sum()),
                      "dtype": args.dtype, "records": records, "device": str(jax.devices()[0].device_kind),
                      "host": platform.node(), "date": datetime.date.today().isoformat()}))


if __name__ == "__main__":
    main()
