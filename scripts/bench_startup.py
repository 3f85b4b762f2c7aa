"""Start-up of the commands on a tiny model: where the seconds before the first step go, and what the persistent
compilation cache saves.

    python scripts/bench_startup.py [--repeats 2]

A synthetic corpus and a 2-layer model (made here, in a temporary folder): ``train`` (3 steps and a validation),
``eval`` and ``generate`` on its run, each timed as a whole process three ways: without the compilation cache
(``SEQJAX_XLA_CACHE=0``), with it cold (an empty cache, written), and with it warm (read back). Also the import of
each command's module alone, and ``--help``. Prints one JSON object; BENCHMARKS.md ("Start-up") records it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()


def corpus(folder: Path, n: int = 400) -> None:
    rng = np.random.default_rng(0)
    for name, count in (("train", n), ("valid", n // 10)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for _ in range(count):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS, int(rng.integers(8, 60))))}) + "\n")


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="runs of each measurement (the median is reported)")
    p.add_argument("--repo", type=Path, default=None,
                   help="the checkout whose commands are timed (another commit's: a worktree), with this interpreter")
    args = p.parse_args()
    global REPO
    REPO = (args.repo or REPO).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus(tmp)
        common = ["data.corpus=jsonl", f"data.train_files=[{tmp / 'train.jsonl'}]",
                  f"data.valid_files=[{tmp / 'valid.jsonl'}]", "data.seq_len=64", "data.batch_size=8",
                  "tokenizer.vocab_size=300", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                  "model.d_ff=64", "train.steps=3", "train.warmup_steps=1", "train.eval_every=0",
                  "train.checkpoint_every=3"]
        base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")} | {"PYTHONPATH": str(REPO)}
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        result = {"python": sys.version.split()[0], "cores": os.cpu_count(), "commit": commit or None}
        result["import_s"] = {
            name: statistics.median(timed(["-c", f"import seqjax.main.{name}"], base) for _ in range(args.repeats))
            for name in ("train", "eval", "generate")}
        result["help_s"] = statistics.median(timed(["-m", "seqjax.train", "--help"], base)
                                             for _ in range(args.repeats))
        data = [f"data.cache_dir={tmp / 'data'}"]  # (the tokenizer and stores, built once beforehand)
        timed(["-m", "seqjax.prepare", *common, *data], base)
        ways = {}
        for way in ("no cache", "cache cold", "cache warm"):
            times = {"train": [], "eval": [], "generate": []}
            for r in range(args.repeats):
                xla = tmp / f"xla_{r}"  # (cold: a new folder; warm: the cold run's, read back)
                if way == "cache cold":
                    shutil.rmtree(xla, ignore_errors=True)
                env = {**base, **({"SEQJAX_XLA_CACHE": "0"} if way == "no cache" else {
                    "JAX_COMPILATION_CACHE_DIR": str(xla), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1"})}
                run = tmp / f"run_{way}_{r}"
                times["train"].append(timed(["-m", "seqjax.train", *common, *data, f"run.dir={run}"], env))
                times["eval"].append(timed(["-m", "seqjax.eval", "--run", str(run)], env))
                times["generate"].append(timed(["-m", "seqjax.generate", "--run", str(run), "--prompt", "the cat",
                                                "--max-new-tokens", "8"], env))
            ways[way] = {k: round(statistics.median(v), 2) for k, v in times.items()}
        result["seconds"] = ways
    print(json.dumps(result))


if __name__ == "__main__":
    main()
