"""A NaN/inf loss stops the run naming the step and keeps the last good checkpoint; nonfinite=skip skips instead.

A learning rate of 1e30 makes the first update push the weights to ~1e30, so
step 2's activations overflow float32: a reliable, data-independent NaN.
"""

from __future__ import annotations

import json
import math

import pytest

from seqjax.train.metrics import read_metrics
from test_train_support import assert_ok, run_cli, tiny_overrides

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

EXPLODE = {"train.lr": 1e30, "train.warmup_steps": 0, "train.checkpoint_every": 1, "train.steps": 4}


def test_a_nonfinite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **EXPLODE))
    assert proc.returncode == 1
    # the message names what was not finite: the loss, or (a finite loss) the gradient
    assert ("non-finite loss" in proc.stderr or "non-finite gradient" in proc.stderr) and "at step 2" in proc.stderr
    assert f"Last good checkpoint: step 1 in {run_dir / 'checkpoints'}" in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1]  # the bad step is not logged as a result


def test_nonfinite_skip_skips_the_update_and_carries_on(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **EXPLODE, **{"train.nonfinite": "skip"}))
    assert_ok(proc)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert math.isfinite(rows[0]["loss"]) and "skipped" not in rows[0]
    assert all(r.get("skipped") and r["grad_norm"] is None for r in rows[1:])  # a NaN is written as null
    # Strict JSON everywhere: Python's json would otherwise write NaN, which other readers reject.
    for text in [*(run_dir / "metrics.jsonl").read_text().splitlines(), (run_dir / "summary.json").read_text(),
                 proc.stdout.strip().splitlines()[-1]]:
        json.loads(text, parse_constant=reject)


def reject(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_under_skip_a_whole_log_window_of_skipped_steps_stops_the_run(tiny_root, tmp_path):
    """Every step from 2 on is non-finite: skipping them all would save NaN-free but useless checkpoints forever."""
    run_dir = tmp_path / "run"
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **{**EXPLODE, "train.steps": 8, "train.log_every": 3,
                                                         "train.nonfinite": "skip"}))
    assert proc.returncode == 1
    assert "the last 3 steps (to step 4) were all non-finite and skipped" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "summary.json").exists()
    assert max(r["step"] for r in read_metrics(run_dir)) == 4
