"""Checkpoints with orbax's CheckpointManager: what a run needs to continue exactly where it
stopped.

A checkpoint is one step folder under ``<run.dir>/checkpoints/`` with six items:

- ``params``, ``opt_state``: the sharded pytrees (each process writes its shards);
- ``rng``: the run's PRNG key (saved so stochastic layers resume their stream);
- ``data``: the data position, one JSON file per process (Grain's own orbax
  handler), so the next batch after a restore is the one that would have come
  next: none repeated, none skipped (docs/design.md, contract 4);
- ``meta``: JSON with the step, the running counters (tokens_seen), the
  metrics row of that step, the processes and devices that wrote it, and the
  identity of the training data (tokenizer hash, source file hashes);
- ``config``: the resolved config the step was trained under, so each
  checkpoint keeps its own history (``config.yaml`` at the run's root is the
  latest run's).

orbax writes a step into a temporary folder and renames it when every item is
committed, so a run killed mid-write leaves no folder that looks complete.

**Restore tells damage from mismatch.** Before any array is read, each step's
own config and orbax's metadata (every array's shape and dtype) are compared
with what the current run would restore into (:func:`plan_resume`):

- arrays that do not fit (a changed ``model.d_ff``, a removed ``train.grad_clip``)
  or a config change that alters the batches or the model is a *mismatch*:
  :class:`~seqjax.core.errors.CheckpointMismatchError` lists the differing keys and
  nothing on disk is touched;
- a step whose config or metadata cannot be read, or whose arrays fail to load
  although they fit, is *damaged*: it is reported, moved aside to
  ``<run.dir>/checkpoints_corrupt/``, and the previous step is tried.

**Writes that fail say so.** Before each save the checkpoints folder is probed
for writing and its free space compared with the size of the last checkpoint
(a warning below twice that, a stop below it); a save that fails, at once or
in the background, stops the run with one line naming the folder and the OS
error (:class:`CheckpointWriteError`), after removing its partial folder. The
previous checkpoint is untouched and resumable.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from grain.checkpoint import CheckpointSave
from jax.experimental import multihost_utils

from seqjax.config.tree import Config, TrainConfig
from seqjax.core.errors import CheckpointMismatchError
from seqjax.weights.orbax_quiet import QuietOrbax, quiet_orphaned_reads
from seqjax.weights.saved import (
    CHECKPOINTS,
    CONFIG_FILE,
    CORRUPT,
    ITEMS_CHECKED,
    PARAMS_ONLY,
    Restored,
    abstract,
    first_line,
    like_target,
    params_only,
    plan_resume,
    read_saved,
)

TMP_SUFFIX = ".orbax-checkpoint-tmp"
MB = 1 << 20

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder, permissions); the run stops
    at that step."""


def _os_error(err: BaseException) -> str:
    """The OS error behind ``err`` ("[Errno 28] No space left on device"), or "" when it has
    none."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}"
        err = err.__cause__ or err.__context__
    return ""


def _os_error_in(message: str) -> str:
    """The OS error a TensorStore message carries ("... [os_error_code='28']"), as "[Errno 28] No
    space left ..."."""
    found = re.search(r"os_error_code='(\d+)'", message)
    return f"[Errno {found[1]}] {os.strerror(int(found[1]))}" if found else ""


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ...: the first that does not exist (nothing set aside is
    replaced)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _dir_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (whole blocks, as the file system counts
    them)."""
    return sum(max(f.stat().st_size, f.stat().st_blocks * 512) for f in path.rglob("*") if f.is_file())


class Checkpointer:
    """The run's CheckpointManager, the damage-or-mismatch restore, and saves that fail loudly and
    at once."""

    def __init__(self, run_dir: str | Path, train: TrainConfig):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINTS
        options = ocp.CheckpointManagerOptions(
            max_to_keep=train.keep_checkpoints,
            enable_async_checkpointing=train.async_checkpoint,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._quiet = QuietOrbax().__enter__()
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: int | None = None  # a step whose background write has not been confirmed yet
        # after a failed write, closing must not raise orbax's error a second time
        self._failed_once = False

    # -- saving

    def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array, data_iterator: Any,
             meta: dict, config: dict) -> None:
        """Start writing step ``step`` (in the background when async); a step already on disk is
        left alone.

        Raises :class:`CheckpointWriteError` when an earlier background save
        failed, when the folder cannot be written or has no room, or when
        this save fails to start.
        """
        # orbax would wait for the previous write anyway; waiting here first surfaces its failure
        # and lets the free space be measured with that checkpoint complete.
        self.wait()
        if step in self.manager.all_steps():
            return
        self._check_room(step, (params, opt_state))
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardSave(params),
                    opt_state=ocp.args.StandardSave(opt_state),
                    rng=ocp.args.StandardSave({"key": rng}),
                    data=CheckpointSave(data_iterator),
                    meta=ocp.args.JsonSave({**meta, "step": step}),
                    config=ocp.args.JsonSave(config),
                ),
                force=True,
            )
        except Exception as err:  # noqa: BLE001 - every failure to write is reported the same way, below
            self._failed(step, err)
        self._pending = step
        if not self.manager.is_saving_in_progress():  # written synchronously: confirm it now
            self.wait()

    def check(self) -> None:
        """Raise :class:`CheckpointWriteError` if a background save has ended without its step on
        disk (no wait)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until background writes are committed; a failed one raises
        :class:`CheckpointWriteError`."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - reported as one line naming the folder and the OS error
            self._failed(step, err)
        if step is not None and not (self.directory / str(step)).is_dir():
            self._failed(step, None)

    def _check_room(self, step: int, state: Any) -> None:
        """Probe the folder for writing and compare its free space with what a checkpoint takes (all
        processes agree).

        The size is the last checkpoint's on disk, or, before the first, the
        bytes of the arrays being saved (a lower bound).
        """
        problem = ""
        try:
            probe = self.directory / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"\0")
            probe.unlink()
            latest = self.manager.latest_step()
            needed = max(_dir_bytes(self.directory / str(latest)) if latest is not None else 0,
                         sum(x.nbytes for x in jax.tree.leaves(state)))
            free = shutil.disk_usage(self.directory).free
            if free < needed:
                problem = (
                    f"{free / MB:.1f} MB free, a checkpoint takes about {needed / MB:.1f} MB: "
                    f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (foreseen, nothing written)"
                )
            elif free < 2 * needed:
                log.warning(
                    "checkpoints: %.1f MB free in %s and a checkpoint takes about %.1f MB: checkpoint %d "
                    "fits, the one after it may not; free some space", free / MB, self.directory,
                    needed / MB, step)
        except OSError as err:
            problem = _os_error(err) or first_line(err)
        failed = bool(problem)
        if jax.process_count() > 1:  # every process stops at this step, or none does
            flags = multihost_utils.process_allgather(np.int32(failed))
            if np.any(flags) and not failed:
                problem = f"process {int(np.argmax(flags))} cannot write there"
            failed = bool(np.any(flags))
        if failed:
            raise CheckpointWriteError(self._message(step, problem, removed=False))

    def _failed(self, step: int | None, err: Exception | None) -> None:
        """Remove the step's partial folder, then raise the one-line
        :class:`CheckpointWriteError`."""
        self._failed_once = True
        orbax_said = self._quiet.messages[0] if self._quiet.messages else ""
        reason = ((_os_error(err) if err is not None else "") or _os_error_in(orbax_said)
                  or (_os_error_in(str(err)) if err is not None else "") or orbax_said[:300]
                  or (first_line(err) if err is not None else ""))
        removed = False
        if step is not None and jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
                shutil.rmtree(partial, ignore_errors=True)
                removed = True
        try:
            self.manager.reload()
        except Exception:  # noqa: BLE001 - the listing is refreshed for the message; the error is what matters
            pass
        raise CheckpointWriteError(
            self._message(step, reason or "unknown error (see --log-level DEBUG)", removed))

    def _message(self, step: int | None, reason: str, removed: bool) -> str:
        kept = self.manager.latest_step()
        return (
            f"checkpoint {step} could not be written to {self.directory}: {reason}. The run stops here"
            + ("; its partial folder was removed" if removed else "") +
            (f". Checkpoint {kept} is intact: run the same command again to resume from it"
             if kept is not None else ". No earlier checkpoint exists"))

    # -- restoring

    def restore_latest(self, params: Any, opt_state: Any, rng: jax.Array, config: Config,
                       identity: dict[str, Any]) -> Restored | None:
        """Restore the newest readable step into the given (sharded) templates; None when there is
        none.

        A mismatch (:func:`plan_resume`) raises before anything is read or
        moved; a damaged step is set aside and the previous one tried.
        """
        templates = {"params": abstract(params), "opt_state": abstract(opt_state),
                     "rng": abstract({"key": rng})}
        # a damaged step's orphaned reads report late: its one line says it all
        quiet_orphaned_reads()
        for step in sorted(self.manager.all_steps(), reverse=True):
            # not damage: nothing to resume, and nothing is moved
            if params_only(self.directory / str(step)):
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory / str(step)} holds parameters only (an import); training cannot "
                    f"resume from it. Nothing was moved: start a new run.dir with train.init_from={self.run_dir}"
                )
            try:
                saved = read_saved(self.directory / str(step), self.run_dir / CONFIG_FILE)
            except Exception as err:  # noqa: BLE001 - a step that cannot describe itself is damaged
                self._set_aside(step, err)
                continue
            # A mismatch raises here, before any array is read; only what follows can be damage.
            changes, data_state, data_restart = plan_resume(saved, config, templates, identity,
                                                            jax.process_index(), jax.process_count())
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    **{item: ocp.args.StandardRestore(templates[item]) for item in ITEMS_CHECKED}))
            except Exception as err:  # noqa: BLE001 - the arrays fit (checked above), so a failure is damage
                self._set_aside(step, err)
                continue
            return Restored(
                step=step,
                params=like_target(params, out["params"]),
                opt_state=like_target(opt_state, out["opt_state"]),
                rng=out["rng"]["key"],
                meta=saved.meta,
                data_state=data_state,
                changes=changes,
                data_restart=data_restart,
            )
        return None

    def _set_aside(self, step: int, err: Exception) -> None:
        gc.collect()
        src = self.directory / str(step)
        dst = _free_name(self.run_dir / CORRUPT / str(step))
        log.warning("checkpoint %s is unreadable (%s); moving it to %s and trying the previous one",
                    src, first_line(err), dst)
        if jax.process_index() == 0:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"seqjax: checkpoint {step} set aside")
        self.manager.reload()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception:
            if not self._failed_once:
                raise
            log.debug("closing the checkpoint manager after a failed write", exc_info=True)
        finally:
            # orbax's orphaned tasks report at garbage collection: collect them while quiet
            if self._failed_once:
                gc.collect()
            self._quiet.__exit__()


# ---------------------------------------------------------------------------
# Reading a trained run: eval, generate


def save_params(run_dir: str | Path, step: int, params: Any, meta: dict[str, Any]) -> Path:
    """Write a checkpoint of parameters only (what seqjax.import writes), synchronously; returns its
    folder.

    :func:`load_for_inference` and ``train.init_from`` read it; training cannot
    resume from it (no optimizer state), so a fine-tune starts in another run.dir.
    """
    folder = Path(run_dir).absolute() / CHECKPOINTS
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(folder, options=options) as manager:
        meta = {**meta, "step": step, PARAMS_ONLY: True}
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                   meta=ocp.args.JsonSave(meta)), force=True)
        manager.wait_until_finished()
    return folder / str(step)
