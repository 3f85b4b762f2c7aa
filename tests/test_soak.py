"""Kill anywhere: one run SIGKILLed at five random steps, some of them in the middle of a checkpoint write, and
restarted each time, ends with the per-step losses and the final parameters of the uninterrupted reference run.

The kill points come from a fixed seed (:data:`KILL_SEED`), so CI repeats the same soak. A kill "during a write"
waits for orbax's temporary folder of the next checkpoint to appear and kills at once; whether it really landed
inside the write is read from the disk afterwards (the temporary folder is still there) and at least two must.
The test prints what each kill hit.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from seqjax.train.checkpoint import TMP_SUFFIX
from seqjax.train.metrics import read_metrics
from seqjax.weights.inference import load_for_inference
from test_train_support import assert_ok, checkpoint_steps, run_cli, start_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

KILL_SEED = 13
STEPS = 40
CHECKPOINT_EVERY = 5


def kill_points(seed: int = KILL_SEED) -> list[tuple[int, bool]]:
    """Five (step, during a checkpoint write?) pairs, in step order; three of them aim at a write."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(3, STEPS - CHECKPOINT_EVERY), 5))
    in_write = set(rng.sample(steps, 3))
    return [(step, step in in_write) for step in steps]


def writing(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(TMP_SUFFIX in name for name in (p.name for p in folder.iterdir()))


def kill_at(overrides: list[str], run_dir: Path, step: int, in_write: bool) -> dict:
    """Start the CLI, SIGKILL it at ``step`` (or at the first checkpoint write from there on); what the kill hit."""
    proc = start_cli(overrides)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        reached = max(train_losses(run_dir), default=0)
        if reached >= step and (not in_write or writing(run_dir)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.001)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == -signal.SIGKILL, f"the run ended before its kill at step {step}:\n{err[-3000:]}"
    return {"aimed_at": step, "during_write": in_write, "last_logged_step": max(train_losses(run_dir), default=0),
            "checkpoints": checkpoint_steps(run_dir), "write_interrupted": writing(run_dir)}


def test_killed_at_five_random_steps_and_resumed_each_time_it_ends_as_the_uninterrupted_run(reference, tiny_root,
                                                                                           tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.steps": STEPS, "train.checkpoint_every": CHECKPOINT_EVERY,
                                                      "train.log_every": 1})
    kills = [kill_at(overrides, run_dir, step, in_write) for step, in_write in kill_points()]
    print("soak kills:", json.dumps(kills))
    assert sum(k["write_interrupted"] for k in kills) >= 2, kills
    assert_ok(run_cli(overrides))

    assert train_losses(run_dir) == {step: reference[step] for step in range(1, STEPS + 1)}, kills
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once: none lost, none twice
    reference_rows = [r for r in read_metrics(tiny_root / "reference") if "loss" in r][:STEPS]
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in reference_rows]
    assert len([r for r in read_metrics(run_dir) if r.get("event") == "resume"]) >= 5

    _, soaked = load_for_inference(run_dir / "checkpoints" / str(STEPS))
    _, uninterrupted = load_for_inference(tiny_root / "reference" / "checkpoints" / str(STEPS))
    for a, b in zip(jax.tree.leaves(nnx.state(soaked, nnx.Param)), jax.tree.leaves(nnx.state(uninterrupted,
                                                                                            nnx.Param))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
