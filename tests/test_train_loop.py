"""The loop's host-side scheduling (prefetch depth, metrics fetched once per log window) changes no number,
and ``train.profile`` writes a trace.

The reference run uses the defaults (2 batches prefetched, metrics fetched every 10 steps); these runs build
each batch in the loop and fetch every step's metrics at once (the behaviour before the loop stopped syncing
per step), or fetch in odd windows that straddle the checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from seqjax.train.metrics import read_metrics
from test_train_support import REPO, assert_ok, cli_env, run_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("prefetch, log_every", [(0, 1), (3, 7)])
def test_prefetch_and_log_windows_leave_every_loss_and_count_unchanged(reference, tiny_root, tmp_path, prefetch,
                                                                      log_every):
    run_dir = tmp_path / "run"
    extra = {"train.steps": 20, "train.prefetch": prefetch, "train.log_every": log_every}
    assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **extra)))
    losses = train_losses(run_dir)
    assert losses == {step: reference[step] for step in range(1, 21)}
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    reference_rows = [r for r in read_metrics(tiny_root / "reference") if "loss" in r][:20]
    assert [r["tokens_seen"] for r in rows] == [r["tokens_seen"] for r in reference_rows]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in reference_rows]


def test_profile_window_writes_a_trace_and_the_summary_reports_step_time(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **{"train.steps": 8, "train.profile": "[3,2]"}))
    assert_ok(proc)
    traces = list((run_dir / "profile").rglob("*.xplane.pb"))
    assert traces, f"no trace under {run_dir / 'profile'}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step_time_s"] > 0 and summary["tokens_per_s"] > 0
    assert "peak_memory_bytes" in summary and summary["mfu"] is None  # no trustworthy peak on a CPU


def test_a_bad_profile_window_is_refused_before_any_work(tiny_root, tmp_path):
    proc = run_cli(tiny_overrides(tiny_root, tmp_path / "run", **{"train.profile": "[3]"}))
    assert proc.returncode == 2
    assert "train.profile: got [3], expected [start_step, num_steps]" in proc.stderr


def test_under_a_scheduler_the_log_is_plain_lines_with_validation_and_the_data_location_is_recorded(tiny_root,
                                                                                                     tmp_path):
    """stderr to a file (as under SLURM): no bar redraws, a line per log window and per validation; and the
    config.yaml the run saves names the data folder it found through $SEQJAX_DATA_DIR."""
    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    data_dir.mkdir()
    extra = {"train.steps": 20, "train.log_every": 5, "train.eval_every": 10, "eval.mode": "sliding"}
    with open(tmp_path / "stderr.log", "w") as err:
        proc = subprocess.run([sys.executable, "-m", "seqjax.train", *tiny_overrides(tiny_root, run_dir, **extra)],
                              cwd=REPO, env=cli_env(SEQJAX_DATA_DIR=str(data_dir)), stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=240)
    assert proc.returncode == 0
    text = (tmp_path / "stderr.log").read_text()
    assert "\r" not in text and "%|" not in text  # no progress bar anywhere (train, prepare or eval)
    assert [line.split(": ", 2)[1] for line in text.splitlines() if ": step " in line and "/20:" in line] == \
        [f"step {s}/20" for s in (5, 10, 15, 20)]
    assert sum(": validation loss " in line for line in text.splitlines()) == 2  # steps 10 and 20
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["dir"] == str(data_dir.resolve())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["context"] is None and (summary["eval_context"], summary["eval_stride"]) == (32, 16)
