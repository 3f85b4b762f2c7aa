"""What seqjax's checks cost on a checkpoint save and a restore, side by side with plain orbax (JSON).

    python scripts/bench_checkpoint.py --sizes-mb 4,64,256 --reps 3 --dir /tmp/bench_checkpoint

For each size, a state of float32 arrays (one third "parameters", two thirds
"optimizer moments", as AdamW's) is saved ``--reps`` times and restored once
by two writers, one after the other, in one run:

- ``orbax``: a plain ``ocp.CheckpointManager`` saving the same items as
  seqjax's checkpoints did before it kept their config (params, opt_state, rng,
  the Grain data position, meta), asynchronously, and restoring the three array
  items: what a user of orbax would write;
- ``seqjax``: :class:`seqjax.train.checkpoint.Checkpointer`, which adds the
  config item, waits for the previous write first, probes the folder for
  writing, compares its free space with the last checkpoint's size, and
  confirms each write; its restore first reads every array's metadata and the
  checkpoint's own config (:func:`seqjax.weights.saved.plan_resume`).

``save_s`` is the time the training loop is blocked by ``save()``; ``total_s``
adds waiting for the background write to commit. Medians over the reps. The
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from grain.checkpoint import CheckpointSave  # noqa: E402
from tqdm import tqdm  # noqa: E402

from seqjax.config.load import load_config  # noqa: E402
from seqjax.train.checkpoint import Checkpointer  # noqa: E402
from seqjax.train.prefetch import IteratorPosition  # noqa: E402

ARRAY_MB = 4  # each array's size: a state is many arrays, as a model's is


def state_of(size_mb: int) -> tuple[dict, dict, jax.Array]:
    """(params, opt_state as {"mu", "nu"}, rng): ``size_mb`` MB in float32 arrays of about ARRAY_MB each."""
    n_arrays = max(1, size_mb // (3 * ARRAY_MB))
    elements = max(1, size_mb * (1 << 20) // (3 * n_arrays * 4))
    rng = np.random.default_rng(0)

    def tree():
        return {f"w{i}": jnp.asarray(rng.standard_normal(elements, dtype=np.float32)) for i in range(n_arrays)}

    return tree(), {"mu": tree(), "nu": tree()}, jax.random.key_data(jax.random.key(0))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_orbax(folder: Path, params, opt_state, rng, reps: int, keep: int) -> dict:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
    manager = ocp.CheckpointManager(folder, options=options)
    saves, totals = [], []
    for step in range(1, reps + 1):
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            rng=ocp.args.StandardSave({"key": rng}), data=CheckpointSave(IteratorPosition({"epoch": 0, "batch": step})),
            meta=ocp.args.JsonSave({"step": step, "tokens_seen": 0}))
        saved = timed(lambda: manager.save(step, args=args, force=True))
        totals.append(saved + timed(manager.wait_until_finished))
        saves.append(saved)
    target = {"params": params, "opt_state": opt_state, "rng": {"key": rng}}
    restore = timed(lambda: manager.restore(reps, args=ocp.args.Composite(
        **{k: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, v)) for k, v in target.items()})))
    manager.close()
    return {"save_s": statistics.median(saves), "total_s": statistics.median(totals), "restore_s": restore}


def bench_seqjax(folder: Path, params, opt_state, rng, reps: int, keep: int) -> dict:
    config = load_config(None, [f"train.keep_checkpoints={keep}", "train.async_checkpoint=true"])
    checkpoints = Checkpointer(folder, config.train)
    saves, totals = [], []
    for step in range(1, reps + 1):
        position = IteratorPosition({"epoch": 0, "batch": step})
        saved = timed(lambda: checkpoints.save(step, params, opt_state, rng, position,
                                               {"tokens_seen": 0}, config.to_dict()))
        totals.append(saved + timed(checkpoints.wait))
        saves.append(saved)
    restore = timed(lambda: checkpoints.restore_latest(params, opt_state, rng, config, {}))
    checkpoints.close()
    return {"save_s": statistics.median(saves), "total_s": statistics.median(totals), "restore_s": restore}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", default="4,64,256", help="state sizes to save, in MB (comma-separated)")
    p.add_argument("--reps", type=int, default=3, help="saves per size and writer")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (train.keep_checkpoints)")
    p.add_argument("--dir", default="/tmp/bench_checkpoint", help="scratch folder (emptied first and after)")
    args = p.parse_args(argv)
    root = Path(args.dir)
    results = []
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    for size in tqdm(sizes, desc="sizes", file=sys.stderr):
        params, opt_state, rng = state_of(size)
        row = {"size_mb": round(sum(x.nbytes for x in jax.tree.leaves((params, opt_state))) / (1 << 20), 1)}
        for name, bench in (("orbax", bench_orbax), ("seqjax", bench_seqjax)):
            shutil.rmtree(root, ignore_errors=True)
            row[name] = bench(root / name, params, opt_state, rng, args.reps, args.keep)
        row["seqjax_over_orbax_total"] = round(row["seqjax"]["total_s"] / row["orbax"]["total_s"], 3)
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    summary = {"machine": platform.machine(), "cpu_cores": os.cpu_count(), "backend": jax.default_backend(),
               "jax": jax.__version__, "date": datetime.date.today().isoformat(), "reps": args.reps,
               "results": results}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
