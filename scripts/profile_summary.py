"""Where a profiled window's GPU time goes: device ops from a ``train.profile`` trace, grouped, as JSON.

    python scripts/profile_summary.py runs/gpt2_small/profile/plugins/profile/*/*.trace.json.gz [--top 25]

Reads the Chrome-trace JSON that ``jax.profiler`` writes beside the ``.xplane.pb`` (what Perfetto opens), sums
the duration of every op on the GPU timeline by name, and groups the names into what they are: the flash
kernel's three passes, cuBLAS/cuDNN matrix products in bf16 (``nvjet``) or float32/TF32 (``xmma ... f32``),
and XLA's fused elementwise/reduction kernels. Prints one JSON object: per-group and top-N totals in ms per
step (the window's total divided by ``--steps``) and as shares of GPU time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

GROUPS = (
    ("flash attention (seqjax Pallas)", re.compile(r"^seqjax_flash")),
    ("matmul float32/TF32", re.compile(r"xmma_gemm_f32|gemm.*tf32")),
    ("matmul bf16 (cuBLAS nvjet)", re.compile(r"nvjet|xmma_gemm_bf16|gemm.*bf16")),
    ("XLA fusions", re.compile(r"fusion|concatenate|convert|scatter|gather")),
    ("memset/memcpy", re.compile(r"Memset|Memcpy|memcpy|memset")),
)


def summarize(path: Path, steps: int, top: int) -> dict:
    trace = json.load(gzip.open(path) if path.suffix == ".gz" else path.open())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in names.items() if "GPU" in name}
    totals, counts = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["pid"] in gpu_pids:
            totals[e["name"]] += e["dur"]
            counts[e["name"]] += 1
    whole = sum(totals.values())
    groups = collections.Counter()
    for name, us in totals.items():
        group = next((g for g, pattern in GROUPS if pattern.search(name)), "other")
        groups[group] += us

    def row(name, us, n=None):
        out = {"name": name, "ms_per_step": round(us / 1e3 / steps, 3), "share": round(us / whole, 4)}
        return out if n is None else {**out, "calls_per_step": n / steps}

    return {
        "trace": str(path), "steps": steps, "gpu_ms_per_step": round(whole / 1e3 / steps, 3),
        "groups": [row(g, us) for g, us in groups.most_common()],
        "top_ops": [row(name, us, counts[name]) for name, us in totals.most_common(top)],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="profile_summary", description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="a .trace.json.gz from run.dir/profile/plugins/profile/<time>/")
    p.add_argument("--steps", type=int, default=5, help="train steps in the profiled window (train.profile[1])")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"{args.trace}: no such trace file "
                "(expected run.dir/profile/plugins/profile/<time>/<host>.trace.json.gz)")
    result = summarize(args.trace, args.steps, args.top)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
