"""One training run owns its ``run.dir``: an OS lock on ``<run.dir>/run.lock`` for as long as it
runs.

Two runs writing one folder destroy each other's checkpoints and metrics, so
the second is refused before any work, with the holder's name::

    run.dir runs/x is in use by another training run (host node7, PID 4123, started 2026-11-23
    09:14:02 UTC, job 5f0c...); wait for it to end or choose another run.dir

The lock is ``fcntl.flock`` on the open file, so the kernel drops it when the
process ends, however it ends: a crashed or killed run leaves no stale lock,
and the file's contents (host, PID, start time, job) only describe the last
holder. The file is never replaced (a rename would move the lock to an
orphaned inode), only rewritten in place.

A multi-host job shares one lock: process 0 takes it and writes a job id (a
random token) into it, every process receives the same token from process 0
(a collective), and each checks that the file it sees holds that token, so a
``run.dir`` that is not the same folder on every host is caught too. When
process 0 is refused, every process of its job is. ``eval`` and ``generate``
only read a run, and take no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from seqjax.core.errors import ConfigError, RunDirInUseError

LOCK_FILE = "run.lock"
_TOKEN_BYTES = 16

log = logging.getLogger(__name__)


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder unknown: the lock file is being written"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
    return f"host {holder.get('host')}, PID {holder.get('pid')}, started {started}, job {holder.get('job')}"


def read_holder(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """What the lock file says about its last holder (None when it is missing, empty or being
    written)."""
    try:
        return json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


class RunLock:
    """The lock a training run holds on its ``run.dir`` (a context manager; released on exit or
    process death).

    ``process_index``/``process_count`` make every process of a multi-host job
    call it together: only process 0 takes the OS lock (see the module doc).
    """

    def __init__(self, run_dir: str | os.PathLike, process_index: int = 0, process_count: int = 1):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.process_index = process_index
        self.process_count = process_count
        self._handle = None
        # this lock made run.dir: a run refused before writing anything removes it again
        self._created = False

    def __enter__(self) -> RunLock:
        token = secrets.token_bytes(_TOKEN_BYTES)
        held = False
        if self.process_index == 0:
            held = self._try_lock(token.hex())
        if self.process_count > 1:
            # Process 0 tells the others whether it holds the lock, and the job's token.
            message = np.frombuffer(bytes([held]) + token, np.uint8)
            message = np.asarray(multihost_utils.broadcast_one_to_all(message), np.uint8).tobytes()
            held, token = bool(message[0]), message[1:]
        if not held:
            self.__exit__()
            holder = read_holder(self.run_dir)
            # the holder took the lock an instant ago and is writing its description
            if holder is None:
                time.sleep(0.2)
                holder = read_holder(self.run_dir)
            raise RunDirInUseError(
                f"run.dir {self.run_dir} is in use by another training run ({_describe(holder)}); "
                "wait for it to end or choose another run.dir"
            )
        if self.process_index != 0:
            seen = read_holder(self.run_dir) or {}
            if seen.get("job") != token.hex():
                raise RunDirInUseError(
                    f"run.dir {self.run_dir}: process 0 of this job locked it, but process {self.process_index} "
                    f"sees another lock file ({_describe(seen)}); run.dir must be one folder every host shares"
                )
        return self

    def _try_lock(self, job: str) -> bool:
        """Take the OS lock without waiting and write this run's description into the file; False if
        held."""
        try:
            self._created = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # "a": open without truncating, so a refused run never blanks the holder's description.
            handle = open(self.path, "a+")
        except OSError as err:
            raise ConfigError(
                f"run.dir: cannot write {self.path} ([Errno {err.errno}] {err.strerror}); "
                "expected a folder this run may write") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            handle.close()
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        self._handle = handle
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps({
                "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                "job": job, "processes": self.process_count
            }) + "\n")
        handle.flush()
        return True

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file releases the flock
            self._handle = None
            left = [p.name for p in self.run_dir.iterdir()] if self.run_dir.is_dir() else []
            if exc and exc[0] is not None and self._created and left == [LOCK_FILE]:
                # Refused before any work (a bad input): leave no empty run folder behind.
                self.path.unlink(missing_ok=True)
                self.run_dir.rmdir()
