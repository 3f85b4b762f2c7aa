"""Two local processes joined by jax.distributed (4 CPU devices each) train like one process, share one lock on
run.dir, stop together on a SIGTERM sent to one of them, and resume as a single process.

Each process reads only its own rows (build_pipeline's process_index /
process_count) and the global batch is stitched with
make_array_from_process_local_data; losses must match the single-process
reference to 1e-5 relative, before and after the elastic resume.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from seqjax.core.errors import RunDirInUseError
from seqjax.train.rundir import LOCK_FILE, RunLock
from test_train_support import REPO, assert_ok, checkpoint_steps, cli_env, run_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(overrides: list[str]) -> list[subprocess.Popen]:
    """Start the CLI as two jax.distributed processes with 4 CPU devices each."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            [sys.executable, "-m", "seqjax.train", *overrides],
            cwd=REPO,
            env=cli_env(devices=4, SEQJAX_COORDINATOR=coordinator, SEQJAX_NUM_PROCESSES="2", SEQJAX_PROCESS_ID=str(i)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def run_two_processes(overrides: list[str]) -> list[str]:
    """:func:`launch`, then wait for both to end; both must succeed. Returns their stderr."""
    procs = launch(overrides)
    try:
        errors = [p.communicate(timeout=400)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-4000:]
    return errors


def wait_for(condition, procs, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(p.poll() is None for p in procs), f"a process ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_two_processes_share_the_lock_stop_together_on_sigterm_and_resume_as_one(reference, tiny_root, tmp_path):
    """SIGTERM reaches one process; JAX's preemption sync point makes both save the same step and exit. The run then
    resumes in one process on 4 devices (8 before) and matches the single-process reference."""
    run_dir = tmp_path / "run"
    procs = launch(tiny_overrides(tiny_root, run_dir, **{"mesh.data": 4, "mesh.fsdp": 2, "train.log_every": 1,
                                                         "train.checkpoint_every": 1000}))
    try:
        def locked_by_process_0():
            text = (run_dir / LOCK_FILE).read_text() if (run_dir / LOCK_FILE).exists() else ""
            return text.endswith("\n") and json.loads(text)["pid"] == procs[0].pid

        wait_for(locked_by_process_0, procs, "process 0 to lock run.dir")
        with pytest.raises(RunDirInUseError, match=f"PID {procs[0].pid}"):  # another job, here: refused
            RunLock(run_dir).__enter__()
        wait_for(lambda: max(train_losses(run_dir), default=0) >= 5, procs, "step 5")
        procs[1].send_signal(signal.SIGTERM)
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, errors[1][-3000:]
    assert "mesh {'data': 4, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 1}; 2 process(es)" in errors[0]
    (stopped,) = checkpoint_steps(run_dir)  # one checkpoint, written by both at the same step
    assert all(f"stopped by SIGTERM after step {stopped}" in err for err in errors)
    assert max(train_losses(run_dir)) == stopped < 30
    data_states = sorted(p.name for p in (run_dir / "checkpoints" / str(stopped) / "data").glob("process_*.json"))
    assert data_states == ["process_0-of-2.json", "process_1-of-2.json"]  # each process saved its own position

    resumed = run_cli(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30}), devices=4)
    assert_ok(resumed)
    assert (f"elastic resume: checkpoint {stopped} was written by 2 process(es) on 8 device(s), now 1 on 4"
            in resumed.stderr)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def test_an_rl_run_in_two_processes_takes_one_process_steps(tmp_path):
    """GRPO in two processes (4 CPU devices each): every process samples and scores the same generation batch (the
    engine's tokens a function of seed, prompt, completion and position), places only its own rows of it, and
    gathers the old and reference log-probabilities back whole; the losses, rewards, KL and tokens each step equal
    one process's on 8 devices (the global batch is the batch, not one copy a process), and process 0 alone
    writes the rollouts and completions tables, the same ones."""
    from seqjax.train.metrics import read_metrics
    from test_rl_run import rewards_of, rl_overrides

    extra = ("train.steps=4", "data.batch_size=8", "mesh.data=8", "rl.beta=0.1", "rl.steps_per_generation=2",
             "rl.log_completions_every=1")
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(rl_overrides(tmp_path, one, *extra), devices=8))
    run_two_processes(rl_overrides(tmp_path, two, *extra))
    losses = train_losses(one)
    assert sorted(losses) == [1, 2, 3, 4] and train_losses(two) == pytest.approx(losses, rel=1e-5)
    assert rewards_of(two) == rewards_of(one)
    steps = [[row for row in read_metrics(run) if "loss" in row] for run in (one, two)]
    for mine, theirs in zip(*steps):
        assert theirs["tokens_seen"] == mine["tokens_seen"] and theirs["kl"] == pytest.approx(mine["kl"], rel=1e-5)
    for name in ("rollouts", "completions"):
        files = sorted(p.name for p in (one / name).iterdir())
        assert files and files == sorted(p.name for p in (two / name).iterdir())
    for name in files:
        assert (two / "completions" / name).read_bytes() == (one / "completions" / name).read_bytes()
    for name in (p.name for p in (one / "rollouts").iterdir()):
        mine, theirs = np.load(one / "rollouts" / name), np.load(two / "rollouts" / name)
        for key in mine.files:
            if key != "metrics":
                np.testing.assert_allclose(theirs[key], mine[key], rtol=1e-5, atol=1e-6, err_msg=key)
