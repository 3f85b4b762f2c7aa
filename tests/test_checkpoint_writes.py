"""A checkpoint that cannot be written stops the run at once with one line naming the folder and the OS error;
the previous checkpoint stays intact and resumes; low free space is announced a checkpoint ahead.

The first two tests stand in for the file system with monkeypatch (they run anywhere); the last writes to a
real, tiny tmpfs (skipped where mounting one is not allowed): a full disk under orbax's background write, then
the same folder read-only.
"""

from __future__ import annotations

import collections
import errno
import os
import subprocess

import orbax.checkpoint as ocp
import pytest

from seqjax.train import checkpoint
from test_train_support import assert_ok, checkpoint_steps, run_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

Usage = collections.namedtuple("Usage", "total used free")


def train_here(overrides: list[str]) -> int:
    """The training CLI in this process (so monkeypatches reach it); its exit code."""
    from seqjax.main.train import main

    return main(overrides)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if " ERROR " in line or line.startswith("ERROR")]


def test_a_failed_save_stops_the_run_at_that_step_and_the_previous_checkpoint_resumes(
        reference, tiny_root, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 20:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self.directory / "20"))
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    assert train_here(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30})) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.endswith(f"checkpoint 20 could not be written to {run_dir / 'checkpoints'}: [Errno 30] Read-only "
                         "file system. The run stops here. Checkpoint 10 is intact: run the same command again to "
                         "resume from it")
    assert max(train_losses(run_dir)) == 20  # stopped at that step
    assert checkpoint_steps(run_dir) == [10]

    monkeypatch.undo()
    assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30})))
    assert train_losses(run_dir) == {step: reference[step] for step in range(1, 31)}


def test_little_free_space_warns_a_checkpoint_ahead_then_stops_before_writing(tiny_root, tmp_path, monkeypatch,
                                                                             capsys):
    """The first checkpoint (about 0.34 MB of arrays) finds 0.5 MB free: it fits, the next may not; the second finds
    a kilobyte and is not attempted."""
    run_dir = tmp_path / "run"
    free = iter([500_000, 1_000])
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(1 << 30, 0, next(free)))
    assert train_here(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30})) == 1
    err = capsys.readouterr().err
    assert "checkpoint 10 fits, the one after it may not; free some space" in err
    (line,) = error_lines(err)
    assert "checkpoint 20 could not be written" in line and "0.0 MB free, a checkpoint takes about" in line
    assert "[Errno 28] No space left on device (foreseen, nothing written)" in line
    assert checkpoint_steps(run_dir) == [10] and max(train_losses(run_dir)) == 20
    assert not [p for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 700 kB tmpfs (room for one tiny checkpoint), or a skip where this process may not mount one."""
    mount = tmp_path / "checkpoints"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_and_a_read_only_folder_under_real_writes_each_give_one_line(tiny_root, tmp_path, tiny_tmpfs,
                                                                                monkeypatch, capfd):
    run_dir = tmp_path  # checkpoints/ is the tmpfs
    # Report plenty of room, so the write is attempted and fails inside orbax's background thread.
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 1 << 40))
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.steps": 40, "train.keep_checkpoints": 1})
    assert train_here(overrides) == 1
    err = capfd.readouterr().err  # the file descriptor: orbax's threads and TensorStore write there too
    (line,) = error_lines(err)
    assert f"checkpoint 20 could not be written to {tiny_tmpfs}: [Errno 28] No space left on device." in line
    assert "its partial folder was removed. Checkpoint 10 is intact" in line
    assert "Traceback" not in err and "Exception ignored" not in err
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["10"]  # keep_checkpoints=1 did not delete it

    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    assert train_here(overrides) == 1
    err = capfd.readouterr().err
    assert "resuming from" in err
    (line,) = error_lines(err)
    assert f"checkpoint 20 could not be written to {tiny_tmpfs}: [Errno 30] Read-only file system" in line
    assert "Traceback" not in err


def test_a_full_disk_under_metrics_jsonl_stops_the_run_in_one_line(reference, tiny_root, tmp_path, monkeypatch,
                                                                     capsys):
    """Between checkpoints, metrics.jsonl's append fails: one ERROR line naming the file and the OS error, no
    traceback (there were two: the write's, and close() retrying the buffer), and the run resumes later."""
    from seqjax.train import metrics

    run_dir = tmp_path / "run"
    real_note = metrics.MetricsLog.note

    def note(self, row):
        if row.get("step") == 15 and "loss" in row:
            real_file = self.file

            class Full:
                def write(self, text):
                    real_file.write(text)  # buffered: the flush is what the full disk refuses

                def flush(self):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                def close(self):
                    real_file.close()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self.file = Full()
        return real_note(self, row)

    monkeypatch.setattr(metrics.MetricsLog, "note", note)
    assert train_here(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30, "train.log_every": 5})) == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert f"{run_dir / 'metrics.jsonl'} could not be written at step 15: [Errno 28] No space left on device" in line
    assert "Traceback" not in err and checkpoint_steps(run_dir) == [10]
    monkeypatch.undo()
    assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **{"train.steps": 30})))
    assert train_losses(run_dir) == {step: reference[step] for step in range(1, 31)}
