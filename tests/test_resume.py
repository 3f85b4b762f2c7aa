"""Exact resumption: SIGKILL, SIGTERM and a corrupt latest checkpoint all end with the reference run's losses.

Every run is the CLI in a subprocess on the tiny corpus (tests/test_train_support.py).
Losses are compared exactly (float32, CPU, same program): a repeated or
skipped batch, or any state not restored, changes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqjax.train.metrics import read_metrics
from test_train_support import (
    REFERENCE_STEPS,
    REPO,
    assert_ok,
    cli_env,
    copy_reference,
    run_cli,
    snapshot,
    tiny_overrides,
    train_losses,
)

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def start_and_signal(overrides: list[str], run_dir: Path, at_step: int, signum: int) -> subprocess.Popen:
    """Start the CLI, send ``signum`` once metrics.jsonl shows ``at_step``, and wait for the process to end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "seqjax.train", *overrides],
        cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if max(train_losses(run_dir), default=0) >= at_step:
            proc.send_signal(signum)
            break
        time.sleep(0.002)
    proc.stderr_text = proc.communicate(timeout=240)[1]
    return proc


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_sigkill_then_restart_reproduces_every_loss(reference, tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir)
    proc = start_and_signal(overrides, run_dir, at_step=25, signum=signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(train_losses(run_dir))
    assert 25 <= killed_at < REFERENCE_STEPS, "the kill must land mid-run"
    assert max(checkpoint_steps(run_dir)) < killed_at  # some steps after the last checkpoint are recomputed

    resumed = run_cli(overrides)
    assert_ok(resumed)
    assert "resuming from" in resumed.stderr
    assert train_losses(run_dir) == reference
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, REFERENCE_STEPS + 1))  # no duplicated lines
    reference_rows = [r for r in read_metrics(tiny_root / "reference") if "loss" in r]
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in reference_rows]


def test_sigterm_saves_a_checkpoint_then_exits_and_resumes(reference, tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.checkpoint_every": 1000})
    proc = start_and_signal(overrides, run_dir, at_step=25, signum=signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr_text[-3000:]
    stopped_at = max(train_losses(run_dir))
    assert stopped_at < REFERENCE_STEPS
    assert checkpoint_steps(run_dir) == [stopped_at]  # the only checkpoint is the one SIGTERM wrote
    assert f"after step {stopped_at}" in proc.stderr_text

    assert_ok(run_cli(overrides))
    assert train_losses(run_dir) == reference


# Ctrl-C twice: the first after step 3 asks for a stop (save, then exit); the second lands while that save is being
# written (orbax's manager.save is wrapped to signal first). The write must finish, not be cut in half.
DOUBLE_CTRL_C = """
import os, signal, sys
import orbax.checkpoint as ocp
from seqjax.train import hooks
after_step, save = hooks.Hooks.after_step, ocp.CheckpointManager.save
def first(self, state):
    if state.step == 3:
        os.kill(os.getpid(), signal.SIGINT)
        state = type(state)(**{**state.__dict__, "stopping": True})
    return after_step(self, state)
def second(self, step, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return save(self, step, *args, **kwargs)
hooks.Hooks.after_step, ocp.CheckpointManager.save = first, second
from seqjax.main.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_ctrl_c_while_the_stop_is_saving_lets_the_save_finish(reference, tiny_root, tmp_path):
    """Issue: a double Ctrl-C left only a 3.orbax-checkpoint-tmp folder and two orbax thread tracebacks; the next
    start removed it and began at step 0. The save the first Ctrl-C asked for now finishes, and the run resumes
    from it."""
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.checkpoint_every": 1000})
    proc = subprocess.run([sys.executable, "-c", DOUBLE_CTRL_C, *overrides], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-3000:]
    assert "a checkpoint is being written; it finishes first" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert checkpoint_steps(run_dir) == [3]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]
    resumed = run_cli(overrides)
    assert_ok(resumed)
    assert "resuming from" in resumed.stderr and train_losses(run_dir) == reference


def truncate_params(run_dir: Path, step: int) -> None:
    for f in (run_dir / "checkpoints" / str(step) / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def test_a_second_damaged_copy_of_a_step_is_set_aside_beside_the_first(reference, tiny_root, tmp_path):
    """Nothing set aside is ever deleted: the second damaged checkpoint 60 goes to checkpoints_corrupt/60.1."""
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    corrupt = run_dir / "checkpoints_corrupt"
    for attempt in range(2):
        (run_dir / "summary.json").unlink()
        truncate_params(run_dir, REFERENCE_STEPS)
        if attempt:
            first = snapshot(corrupt / str(REFERENCE_STEPS))
        proc = run_cli(tiny_overrides(tiny_root, run_dir))
        assert_ok(proc)
    assert sorted(p.name for p in corrupt.iterdir()) == ["60", "60.1"]
    assert snapshot(corrupt / "60") == first
    assert f"moving it to {corrupt / '60.1'}" in proc.stderr
    assert train_losses(run_dir) == reference


def test_a_checkpoint_with_garbage_array_data_is_one_line_and_no_traceback(reference, tiny_root, tmp_path):
    """Overwritten chunks make every array read fail; orbax stops at the first and orphans the others, which
    used to print one "Exception ignored in coroutine" traceback each (18 here)."""
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    (run_dir / "summary.json").unlink()
    chunks = [f for f in (run_dir / "checkpoints" / str(REFERENCE_STEPS) / "params").rglob("*")
              if f.is_file() and f.parent.name == "d" and f.parent.parent.name.startswith("ocdbt.process")]
    assert len(chunks) > 1
    for f in chunks:
        f.write_bytes(os.urandom(100))
    proc = run_cli(tiny_overrides(tiny_root, run_dir))
    assert_ok(proc)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in proc.stderr.splitlines() if "is unreadable" in line]) == 1
    assert train_losses(run_dir) == reference


def test_a_truncated_latest_checkpoint_is_reported_and_the_previous_one_used(reference, tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_root / "reference", run_dir)
    (run_dir / "summary.json").unlink()  # a run that crashed has none (a finished one is not trained again)
    steps = checkpoint_steps(run_dir)
    latest, previous = steps[-1], steps[-2]
    truncate_params(run_dir, latest)

    proc = run_cli(tiny_overrides(tiny_root, run_dir))
    assert_ok(proc)
    assert f"checkpoints/{latest} is unreadable" in proc.stderr
    assert f"resuming from {run_dir / 'checkpoints' / str(previous)}" in proc.stderr
    assert (run_dir / "checkpoints_corrupt" / str(latest)).is_dir()
    assert train_losses(run_dir) == reference
    assert latest in checkpoint_steps(run_dir)  # rewritten by the resumed run


def test_running_a_finished_run_again_says_so_and_changes_nothing(reference, tiny_root, tmp_path):
    """A scheduler that requeues a finished job must not blank its results (it used to rewrite summary.json)."""
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["val_loss"] is not None
    before = snapshot(run_dir)
    proc = run_cli(tiny_overrides(tiny_root, run_dir))
    assert_ok(proc)
    assert "already finished its 60 steps" in proc.stderr
    assert snapshot(run_dir) == before


def test_a_run_killed_during_its_final_validation_runs_it_on_the_next_start(reference, tiny_root, tmp_path):
    """The last checkpoint was saved, the final validation never completed: the re-run does it and writes it."""
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    reference_summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    rows = [r for r in read_metrics(run_dir) if "val_loss" not in r]  # the kill came before the valid row
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli(tiny_overrides(tiny_root, run_dir))
    assert_ok(proc)
    assert "final validation never completed: running it now" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["finished"] and summary["resumed_from"] == REFERENCE_STEPS
    for key in ("val_loss", "val_perplexity", "val_word_perplexity", "final_train_loss"):
        assert summary[key] == pytest.approx(reference_summary[key], rel=1e-6), key
    assert [r["step"] for r in read_metrics(run_dir) if "val_loss" in r] == [REFERENCE_STEPS]
