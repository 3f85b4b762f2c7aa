"""An RL run's step time on-policy, one step off-policy on the training mesh, and one step off-policy with a
sampler of its own devices (rl.max_staleness, mesh.sampler_devices; docs/rl.md), side by side (JSON lines).

    python scripts/bench_overlap.py --devices 2 --steps 12 --out overlap.jsonl

Each run is ``python -m seqjax.train`` on the same ``--devices`` (simulated host devices on a CPU: they share its
cores, so an overlap there says what the bookkeeping costs, not what two accelerators gain): a 4-layer model on a
tokenizer of its own arithmetic prompts, ``rl.num_generations`` completions of up to ``--new-tokens`` tokens a
prompt. The three settings:

- ``on_policy``: rl.max_staleness=0, sampling and training on every device, one after the other;
- ``sequential``: rl.max_staleness=1, the same devices (the batch a step trains on was launched a step before);
- ``overlap``: rl.max_staleness=1, mesh.sampler_devices=1: the last device samples while the others train.

Each row: the median and mean seconds a step over the steps after the first two (compiles), new tokens sampled
a second over them, and the run's final loss. The last line is a summary object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from seqjax.core.devices import with_host_devices

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"on_policy": ["rl.max_staleness=0"], "sequential": ["rl.max_staleness=1"],
            "overlap": ["rl.max_staleness=1", "mesh.sampler_devices=1"]}


def write_prompts(path: Path, n: int = 128) -> None:
    rng = random.Random(0)
    lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)})
             for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n))]
    path.write_text("\n".join(lines) + "\n")


def overrides(args, folder: Path, run_dir: Path) -> list[str]:
    return [f"run.dir={run_dir}", "data.corpus=jsonl", "data.format=prompt",
            f"data.train_files=[{folder / 'prompts.jsonl'}]", f"data.cache_dir={folder / 'cache'}",
            "data.seq_len=512", "tokenizer.vocab_size=300", f"model.d_model={args.d_model}", "model.n_layers=4",
            "model.n_heads=4", "model.n_kv_heads=2", f"model.d_ff={2 * args.d_model}", "model.max_seq_len=512",
            "model.attention=xla", f"rl.num_generations={args.generations}", f"rl.prompts_per_step={args.prompts}",
            f"rl.max_completion_length={args.new_tokens}", "rl.reward_funcs=[length]", "train.lr=1e-3",
            "train.warmup_steps=0", "train.schedule=constant", "train.eval_every=0", "train.checkpoint_every=1000",
            "train.log_every=1", f"train.steps={args.steps}", "engine.slots=16"]


def run(args, folder: Path, name: str) -> dict:
    run_dir = folder / name
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),  # (the caller's XLA flags kept)
           "XLA_FLAGS": with_host_devices(os.environ.get("XLA_FLAGS", ""), args.devices)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "seqjax.train", *overrides(args, folder, run_dir),
                           *SETTINGS[name]], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name}: the run failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "seconds" in r and r.get("step", 0) > 2]
    seconds = statistics.median(r["seconds"] for r in steps)
    tokens = sum(r["completions/mean_length"] * args.prompts * args.generations for r in steps)
    mean = statistics.mean(r["seconds"] for r in steps)
    return {"setting": name, "devices": args.devices, "steps_timed": len(steps), "step_s": round(seconds, 4),
            "mean_step_s": round(mean, 4),
            "new_tokens_per_s": round(tokens / sum(r["seconds"] for r in steps), 1),
            "final_loss": rows[-1].get("loss"), "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_prompts(folder / "prompts.jsonl")
        records = [run(args, folder, name) for name in SETTINGS]
    summary = {"rows": len(records), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:] if argv is None
               else argv}
    lines = [json.dumps(r) for r in [*records, summary]]
    print("\n".join(lines))
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")
    return summary


if __name__ == "__main__":
    main()
