"""One run owns its run.dir: a second run there is refused before any work, naming the holder; a dead holder
leaves no lock behind; the processes of one multi-host job share the lock (tests/test_multiprocess.py runs a
real two-process job against it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from seqjax.core.errors import RunDirInUseError
from seqjax.train import rundir
from seqjax.train.rundir import LOCK_FILE, RunLock
from test_train_support import REPO, assert_ok, cli_env, run_cli, start_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def test_a_second_run_on_the_same_run_dir_exits_2_naming_the_holder_and_the_first_finishes_unharmed(
        reference, tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.steps": 30})
    first = start_cli(overrides)
    deadline = time.monotonic() + 120
    while first.poll() is None and (json.loads((run_dir / LOCK_FILE).read_text() or "{}")
                                    if (run_dir / LOCK_FILE).exists() else {}).get("pid") != first.pid:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = run_cli(overrides)
    still_running = first.poll() is None
    first_err = first.communicate(timeout=240)[1]
    assert still_running, "the first run must still hold the lock when the second starts"
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"run.dir {run_dir} is in use by another training run (host " in second.stderr
    assert f"PID {first.pid}, started " in second.stderr and "Traceback" not in second.stderr
    assert "resolved config" not in second.stderr  # refused before any work (nothing saved, nothing named)
    assert first.returncode == 0, first_err[-3000:]
    assert train_losses(run_dir) == {step: reference[step] for step in range(1, 31)}


def test_a_killed_holder_leaves_no_lock_and_a_live_one_is_refused(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from seqjax.train.rundir import RunLock\n"
                               "with RunLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
         str(tmp_path)],
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUseError, match=f"PID {holder.pid}"):
            RunLock(tmp_path).__enter__()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with RunLock(tmp_path):  # the kernel dropped the dead holder's lock
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with RunLock(tmp_path):  # and released on exit
        pass


def test_the_processes_of_one_job_share_the_lock_and_another_job_is_refused(tmp_path, monkeypatch):
    """Process 0 locks and broadcasts the job's token; the others accept a lock file holding that token only."""
    sent = {}

    def broadcast(message):  # stands in for the collective: every process receives process 0's message
        if "message" not in sent:
            sent["message"] = message
        return sent["message"]

    monkeypatch.setattr(rundir.multihost_utils, "broadcast_one_to_all", broadcast)
    with RunLock(tmp_path, process_index=0, process_count=2):
        with RunLock(tmp_path, process_index=1, process_count=2):  # the same job: accepted
            pass
        sent.clear()
        with pytest.raises(RunDirInUseError, match="in use by another training run"):
            RunLock(tmp_path, process_index=0, process_count=2).__enter__()  # another job's process 0
        sent.clear()
        sent["message"] = np.frombuffer(b"\x01" + bytes(16), np.uint8)  # another job's process 0, elsewhere
        with pytest.raises(RunDirInUseError, match="run.dir must be one folder every host shares"):
            RunLock(tmp_path, process_index=1, process_count=2).__enter__()


def test_eval_and_generate_read_a_run_that_is_training(reference, tiny_root, tmp_path):
    """Readers take no lock: they work beside a run that holds it."""
    with RunLock(tiny_root / "reference"):
        proc = subprocess.run([sys.executable, "-m", "seqjax.generate", "--run", str(tiny_root / "reference"),
                               "--prompt", "the", "--max-new-tokens", "2"],
                              cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert_ok(proc)


def test_a_run_refused_before_any_work_leaves_no_run_folder_and_keeps_a_folder_it_did_not_make(tiny_root, tmp_path):
    missing = tmp_path / "no-such.jsonl"
    for run_dir, made in ((tmp_path / "new" / "run", False), (tmp_path / "mine", True)):
        if made:
            run_dir.mkdir()
        proc = run_cli(tiny_overrides(tiny_root, run_dir, **{"data.train_files": f"[{missing}]",
                                                             "data.cache_dir": tmp_path / "cache"}))
        assert proc.returncode == 2 and str(missing) in proc.stderr
        assert run_dir.exists() == made  # a folder the user made stays, empty of the lock or not
