"""Two local processes joined by jax.distributed (4 CPU devices each) train like one process.

Each process reads only its own rows (build_pipeline's process_index /
process_count) and the global batch is stitched with
make_array_from_process_local_data; losses must match the single-process
reference to 1e-5 relative.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from test_train_support import REPO, cli_env, tiny_overrides, train_losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(overrides: list[str]) -> list[str]:
    """Run the CLI as two jax.distributed processes with 4 CPU devices each; return their stderr."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
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
    try:
        errors = [p.communicate(timeout=400)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-4000:]
    return errors


def test_two_processes_with_four_devices_each_match_one_process_and_resume(reference, tiny_root, tmp_path):
    """10 steps, then a second launch to 20 that resumes from the checkpoint both processes wrote."""
    run_dir = tmp_path / "run"
    mesh = {"mesh.data": 4, "mesh.fsdp": 2}
    first = launch(tiny_overrides(tiny_root, run_dir, **mesh, **{"train.steps": 10}))
    assert "mesh {'data': 4, 'fsdp': 2, 'tensor': 1}; 2 process(es)" in first[0]
    data_states = sorted(p.name for p in (run_dir / "checkpoints" / "10" / "data").glob("process_*.json"))
    assert data_states == ["process_0-of-2.json", "process_1-of-2.json"]  # each process saved its own position

    second = launch(tiny_overrides(tiny_root, run_dir, **mesh, **{"train.steps": 20}))
    assert all("resuming from" in err for err in second)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 21))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
