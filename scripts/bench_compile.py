"""Compile time of the real train step against depth, unrolled and scanned (``model.scan_layers``) (JSON).

    python scripts/bench_compile.py                       # 4, 16 and 32 layers, both ways, configs/gpt2_small.yaml
    python scripts/bench_compile.py --layers 4,8 --config configs/wikitext2_cpu.yaml

Each setting runs ``scripts/plan_memory.py`` in a fresh process (so no
compilation cache of an earlier setting helps a later one): it lowers and
compiles the train step ``python -m seqjax.train`` runs (model, AdamW, the
loss), with abstract inputs, on one CPU device, and reports the seconds and
XLA's temporary bytes. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt2_small.yaml")
    p.add_argument("--layers", default="4,16,32")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    rows = []
    for layers in map(int, args.layers.split(",")):
        for scan in ("false", "true"):
            proc = subprocess.run(
                [sys.executable, "scripts/plan_memory.py", "--config", args.config, "--devices", "1", *args.overrides,
                 f"model.n_layers={layers}", f"model.scan_layers={scan}"],
                cwd=REPO, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
            if proc.returncode:
                sys.exit(f"bench_compile: plan_memory failed for {layers} layers, scan_layers={scan}:\n"
                         f"{proc.stderr[-2000:]}")
            plan = json.loads(proc.stdout.strip().splitlines()[-1])
            row = {"layers": layers, "scan_layers": scan == "true", "compile_seconds": plan["compile_seconds"],
                   "parameters": plan["parameters"], "temp_bytes": plan["temp_bytes_per_device"]}
            rows.append(row)
            print(f"# {row}", file=sys.stderr, flush=True)
    summary = {"bench": "compile", "config": args.config, "overrides": args.overrides, "rows": rows,
               "date": datetime.date.today().isoformat(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
