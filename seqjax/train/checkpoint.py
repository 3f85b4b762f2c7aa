"""Checkpoints with orbax's CheckpointManager: what a run needs to continue exactly where it stopped.

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
  :class:`~seqjax.errors.CheckpointMismatchError` lists the differing keys and
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
import json
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from grain.checkpoint import CheckpointSave
from jax.experimental import multihost_utils

from seqjax.config import DATA, Config, ConfigChange, ConfigError, TrainConfig, load_config, resume_changes
from seqjax.data.pipeline import next_epoch_start
from seqjax.errors import CheckpointError, CheckpointMismatchError
from seqjax.model import build_model

CHECKPOINTS = "checkpoints"
CORRUPT = "checkpoints_corrupt"
CONFIG_FILE = "config.yaml"
# The run's own copy of its tokenizer: a run folder copied to another machine still has it.
TOKENIZER_FILE = "tokenizer.json"
ITEMS_CHECKED = ("params", "opt_state", "rng")  # the arrays whose shapes and dtypes a restore must match
PARAMS_ONLY = "params_only"  # the meta key of a checkpoint of parameters alone (seqjax.import's)
TMP_SUFFIX = ".orbax-checkpoint-tmp"
MB = 1 << 20

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder, permissions); the run stops at that step."""


@dataclass
class Restored:
    """What a resume continues from; ``data_state`` is None when the data restarts from its beginning."""

    step: int
    params: Any
    opt_state: Any
    rng: jax.Array
    meta: dict[str, Any]
    data_state: dict[str, Any] | None
    changes: list[ConfigChange] = field(default_factory=list)
    data_restart: dict[str, Any] | None = None  # set when a changed config restarted the data (the position used)


@dataclass
class Saved:
    """What a checkpoint says about itself, read without loading any array."""

    step: int
    path: Path
    config: dict[str, Any] | None
    meta: dict[str, Any]
    arrays: dict[str, dict[str, tuple[tuple[int, ...], str]]]  # item -> {tree path: (shape, dtype)}
    data_states: dict[str, dict[str, Any]]  # file name (process_i-of-n.json) -> state


def _abstract(tree: Any) -> Any:
    """Shape/dtype/sharding of every leaf: the target orbax restores into (already sharded)."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _like(target: Any, restored: Any) -> Any:
    """Give restored leaves the target's tree structure (orbax returns optax's NamedTuples as plain tuples)."""
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored))


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def array_table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"blocks/0/mlp/w_up": ((32, 64), "float32"), ...}`` for a pytree of arrays or of orbax array metadata.

    Paths are written the same way for both (a NamedTuple field, a dict key
    and a list index all become one path part), so a template and a
    checkpoint's metadata compare directly.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): (tuple(int(d) for d in leaf.shape), str(np.dtype(leaf.dtype)))
            for path, leaf in leaves}


def array_differences(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """Each array whose presence, shape or dtype differs: ``path: checkpoint (64, 32) float32, now (128, 32) ...``."""
    def show(entry):
        return "absent" if entry is None else f"{entry[0]} {entry[1]}"

    return [f"{path}: checkpoint {show(saved.get(path))}, now {show(wanted.get(path))}"
            for path in sorted(set(saved) | set(wanted)) if saved.get(path) != wanted.get(path)]


def newest_readable(steps: Iterable[int], restore: Callable[[int], T],
                    unreadable: Callable[[int, Exception], None]) -> tuple[int, T] | None:
    """``(step, restore(step))`` for the first step, newest first, that restores; None when none does.

    Each step that fails is handed to ``unreadable`` (which reports it, and may
    move it aside) before the next older one is tried. A
    :class:`~seqjax.errors.CheckpointMismatchError` is not a failure to read:
    it stops the search at once.
    """
    for step in sorted(steps, reverse=True):
        try:
            return step, restore(step)
        except CheckpointMismatchError:
            raise
        except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is skipped, and said so
            unreadable(step, err)
    return None


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"


def _os_error(err: BaseException) -> str:
    """The OS error behind ``err`` ("[Errno 28] No space left on device"), or "" when it has none."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}"
        err = err.__cause__ or err.__context__
    return ""


def _os_error_in(message: str) -> str:
    """The OS error a TensorStore message carries ("... [os_error_code='28']"), as "[Errno 28] No space left ..."."""
    found = re.search(r"os_error_code='(\d+)'", message)
    return f"[Errno {found[1]}] {os.strerror(int(found[1]))}" if found else ""


def read_saved(step_dir: Path, fallback_config: Path | None = None, items: tuple[str, ...] = ITEMS_CHECKED) -> Saved:
    """A step folder's config, meta, array table (of ``items``) and data positions; raises if any of them is
    unreadable. A parameters-only checkpoint (:func:`save_params`) has no data positions: it reads with
    ``items=("params",)`` and gives none."""
    meta = _read_meta(step_dir)
    config_file = step_dir / "config" / "metadata"
    if config_file.exists():
        config = json.loads(config_file.read_text())
    else:  # written before checkpoints kept their config: the run's config.yaml, if it still loads
        try:
            config = load_config(fallback_config).to_dict() if fallback_config is not None else None
        except ConfigError:
            config = None
    handler = ocp.StandardCheckpointHandler()
    arrays = {item: array_table(handler.metadata(epath.Path(step_dir / item)).tree) for item in items}
    data_states = {p.name: json.loads(p.read_text()) for p in sorted((step_dir / "data").glob("process_*.json"))}
    if not data_states and not meta.get(PARAMS_ONLY):
        raise FileNotFoundError(f"{step_dir / 'data'}: no data position (process_*.json)")
    return Saved(int(step_dir.name), step_dir, config, meta, arrays, data_states)


def _data_state(saved: Saved, process_index: int, process_count: int) -> dict[str, Any] | None:
    """This process's saved position; a position of seqjax's epochs ({epoch, batch}) is global, so any file serves."""
    own = f"process_{process_index}-of-{process_count}.json"
    if own in saved.data_states:
        return saved.data_states[own]
    first = next(iter(saved.data_states.values()))
    return first if "epoch" in first else None


def _likely_causes_first(changes: list[ConfigChange]) -> list[ConfigChange]:
    return sorted(changes, key=lambda c: c.kind == "exact")  # stable: config order within each group


def plan_resume(saved: Saved, config: Config, templates: dict[str, Any], identity: dict[str, Any],
                process_index: int, process_count: int) -> tuple[list[ConfigChange], dict[str, Any] | None,
                                                              dict[str, Any] | None]:
    """Decide how ``saved`` resumes under ``config``: (changes, data state to set, data restart or None).

    Raises :class:`~seqjax.errors.CheckpointMismatchError`, touching nothing,
    when the arrays do not fit ``templates`` (shape, dtype or tree), or when a
    change alters the batches or the model and ``train.allow_config_change``
    is off. ``identity`` is the current run's training data identity
    (tokenizer and source hashes), compared with the checkpoint's.

    With the override and a change to the batches, the data restarts at the
    next epoch boundary: a checkpoint at ``{"epoch": 3, "batch": 17}`` goes on
    from ``{"epoch": 4, "batch": 0}`` of the new config (one at
    ``{"epoch": 3, "batch": 0}`` from that position itself). A position of
    Grain's own packers has no epochs: their stream restarts from the beginning.
    """
    changes = resume_changes(saved.config, config) if saved.config is not None else []
    old_identity = saved.meta.get("data_identity")
    if old_identity is not None:
        for name, label in (("tokenizer", "tokenizer (sha256)"), ("sources", "training text (xxh3 of each file)")):
            if old_identity.get(name) != identity.get(name):
                changes.append(ConfigChange(label, old_identity.get(name), identity.get(name), DATA))
    state = _data_state(saved, process_index, process_count)
    if state is None:  # Grain's packers keep one position per process: another process count cannot continue it
        old = len(saved.data_states)
        changes.append(ConfigChange("processes (Grain packer positions are per process)", old, process_count, DATA))
    where = f"checkpoint {saved.path}"
    wrong_arrays = [f"{item}/{line}" for item in ITEMS_CHECKED
                    for line in array_differences(saved.arrays[item], array_table(templates[item]))]
    if wrong_arrays:
        shown = "; ".join(wrong_arrays[:4]) + (f"; and {len(wrong_arrays) - 4} more" if len(wrong_arrays) > 4 else "")
        # Every change is listed, the likely causes first: optimizer keys (train.grad_clip, train.nonfinite) change
        # the state's tree too.
        keys = "; ".join(map(str, _likely_causes_first(changes))) or "no config key (the code changed?)"
        raise CheckpointMismatchError(
            f"{where} does not fit this config, which changed {keys}. Its arrays differ: {shown}. "
            "Nothing was moved: resume with the checkpoint's values, or start a new run.dir"
        )
    refused = [c for c in changes if c.kind != "exact"]
    if refused and not config.train.allow_config_change:
        raise CheckpointMismatchError(
            f"{where} was written under another config: {'; '.join(map(str, refused))}. Resuming would not "
            "continue the same " + ("batches" if any(c.kind == DATA for c in refused) else "model") +
            ". Nothing was moved: restore those values, or set train.allow_config_change=true to resume anyway "
            "(the data then restarts at the next epoch boundary)"
        )
    if not any(c.kind == DATA for c in changes):
        return changes, state, None
    restart = next_epoch_start(state, config)
    if restart is None:
        return changes, None, {"from": state, "to": "the beginning of Grain's stream"}
    return changes, restart, {"from": state, "to": restart}


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ...: the first that does not exist (nothing set aside is replaced)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _read_meta(step_dir: Path) -> dict[str, Any]:
    """A step folder's meta item (step, tokens seen, devices, data identity, ...)."""
    return json.loads((step_dir / "meta" / "metadata").read_text())


def _params_only(step_dir: Path) -> bool:
    """Whether a step folder is a checkpoint of parameters alone (:func:`save_params`)."""
    try:
        return bool(_read_meta(step_dir).get(PARAMS_ONLY))
    except (OSError, ValueError, AttributeError):
        return False  # unreadable: restore_latest treats it as damage


def _dir_bytes(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (whole blocks, as the file system counts them)."""
    return sum(max(f.stat().st_size, f.stat().st_blocks * 512) for f in path.rglob("*") if f.is_file())


def _from_a_closed_event_loop(unraisable: Any) -> bool:
    """An exception raised in asyncio by a callback that outlived its event loop (orbax's, after a write failed)."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(unraisable.exc_value, RuntimeError) and tb is not None
            and Path(tb.tb_frame.f_code.co_filename).parent.name == "asyncio")


def _raised_in_orbax(tb: Any) -> bool:
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _QuietOrbax(logging.Filter):
    """While a run checkpoints, orbax's noise about a failed write stays off stderr (kept at DEBUG).

    A failed background write makes orbax log one traceback per thread, and
    TensorStore callbacks that finish after orbax closed its event loop raise
    unraisable errors; :class:`Checkpointer` reports the failure once, as one
    line, from what the records say. A filter on the two loggers, and the
    unraisable hook, for as long as the checkpointer is open.
    """

    LOGGERS = ("absl", "asyncio")  # orbax logs through absl; its event loops' orphaned tasks through asyncio

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []  # orbax's error messages, for that one line
        self._previous_hook = sys.unraisablehook

    def __enter__(self) -> _QuietOrbax:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_hook

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "absl" and "orbax" in record.pathname:
            self.messages.append(record.getMessage().splitlines()[0])
        elif not (record.name == "asyncio" and record.exc_info and _raised_in_orbax(record.exc_info[2])):
            return True
        log.debug("%s: %s", record.name, record.getMessage(), exc_info=record.exc_info)
        return False

    def _unraisable(self, unraisable: Any) -> None:
        if _from_a_closed_event_loop(unraisable):
            log.debug("after a failed write: %r", unraisable.exc_value)
        else:
            self._previous_hook(unraisable)


class Checkpointer:
    """The run's CheckpointManager, the damage-or-mismatch restore, and saves that fail loudly and at once."""

    def __init__(self, run_dir: str | Path, train: TrainConfig):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINTS
        options = ocp.CheckpointManagerOptions(
            max_to_keep=train.keep_checkpoints,
            enable_async_checkpointing=train.async_checkpoint,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._quiet = _QuietOrbax().__enter__()
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: int | None = None  # a step whose background write has not been confirmed yet
        self._failed_once = False  # after a failed write, closing must not raise orbax's error a second time

    # -- saving

    def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array, data_iterator: Any, meta: dict,
             config: dict) -> None:
        """Start writing step ``step`` (in the background when async); a step already on disk is left alone.

        Raises :class:`CheckpointWriteError` when an earlier background save
        failed, when the folder cannot be written or has no room, or when
        this save fails to start.
        """
        # orbax would wait for the previous write anyway; waiting here first surfaces its failure and lets the
        # free space be measured with that checkpoint complete.
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
        """Raise :class:`CheckpointWriteError` if a background save has ended without its step on disk (no wait)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until background writes are committed; a failed one raises :class:`CheckpointWriteError`."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - reported as one line naming the folder and the OS error
            self._failed(step, err)
        if step is not None and not (self.directory / str(step)).is_dir():
            self._failed(step, None)

    def _check_room(self, step: int, state: Any) -> None:
        """Probe the folder for writing and compare its free space with what a checkpoint takes (all processes agree).

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
                problem = (f"{free / MB:.1f} MB free, a checkpoint takes about {needed / MB:.1f} MB: "
                           f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (foreseen, nothing written)")
            elif free < 2 * needed:
                log.warning("checkpoints: %.1f MB free in %s and a checkpoint takes about %.1f MB: checkpoint %d "
                            "fits, the one after it may not; free some space", free / MB, self.directory,
                            needed / MB, step)
        except OSError as err:
            problem = _os_error(err) or _first_line(err)
        failed = bool(problem)
        if jax.process_count() > 1:  # every process stops at this step, or none does
            flags = multihost_utils.process_allgather(np.int32(failed))
            if np.any(flags) and not failed:
                problem = f"process {int(np.argmax(flags))} cannot write there"
            failed = bool(np.any(flags))
        if failed:
            raise CheckpointWriteError(self._message(step, problem, removed=False))

    def _failed(self, step: int | None, err: Exception | None) -> None:
        """Remove the step's partial folder, then raise the one-line :class:`CheckpointWriteError`."""
        self._failed_once = True
        orbax_said = self._quiet.messages[0] if self._quiet.messages else ""
        reason = ((_os_error(err) if err is not None else "") or _os_error_in(orbax_said)
                  or (_os_error_in(str(err)) if err is not None else "") or orbax_said[:300]
                  or (_first_line(err) if err is not None else ""))
        removed = False
        if step is not None and jax.process_index() == 0:
            for partial in self.directory.glob(f"{step}{TMP_SUFFIX}*"):
                shutil.rmtree(partial, ignore_errors=True)
                removed = True
        try:
            self.manager.reload()
        except Exception:  # noqa: BLE001 - the listing is refreshed for the message; the error is what matters
            pass
        raise CheckpointWriteError(self._message(step, reason or "unknown error (see --log-level DEBUG)", removed))

    def _message(self, step: int | None, reason: str, removed: bool) -> str:
        kept = self.manager.latest_step()
        return (f"checkpoint {step} could not be written to {self.directory}: {reason}. The run stops here"
                + ("; its partial folder was removed" if removed else "")
                + (f". Checkpoint {kept} is intact: run the same command again to resume from it"
                   if kept is not None else ". No earlier checkpoint exists"))

    # -- restoring

    def restore_latest(self, params: Any, opt_state: Any, rng: jax.Array, config: Config,
                       identity: dict[str, Any]) -> Restored | None:
        """Restore the newest readable step into the given (sharded) templates; None when there is none.

        A mismatch (:func:`plan_resume`) raises before anything is read or
        moved; a damaged step is set aside and the previous one tried.
        """
        templates = {"params": _abstract(params), "opt_state": _abstract(opt_state),
                     "rng": _abstract({"key": rng})}
        for step in sorted(self.manager.all_steps(), reverse=True):
            if _params_only(self.directory / str(step)):  # not damage: nothing to resume, and nothing is moved
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
                params=_like(params, out["params"]),
                opt_state=_like(opt_state, out["opt_state"]),
                rng=out["rng"]["key"],
                meta=saved.meta,
                data_state=data_state,
                changes=changes,
                data_restart=data_restart,
            )
        return None

    def _set_aside(self, step: int, err: Exception) -> None:
        src = self.directory / str(step)
        dst = _free_name(self.run_dir / CORRUPT / str(step))
        log.warning("checkpoint %s is unreadable (%s); moving it to %s and trying the previous one",
                    src, _first_line(err), dst)
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
            if self._failed_once:  # orbax's orphaned tasks report at garbage collection: collect them while quiet
                gc.collect()
            self._quiet.__exit__()


# ---------------------------------------------------------------------------
# Reading a trained run: eval, generate


def save_params(run_dir: str | Path, step: int, params: Any, meta: dict[str, Any]) -> Path:
    """Write a checkpoint of parameters only (what seqjax.import writes), synchronously; returns its folder.

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


def locate(path: str | Path) -> tuple[Path, Path, int | None]:
    """(config.yaml, checkpoints folder, step or None for the latest) for a run dir or a step folder."""
    path = Path(path).absolute()
    if (path / CHECKPOINTS).is_dir():
        return path / CONFIG_FILE, path / CHECKPOINTS, None
    if path.name.isdigit() and path.parent.name == CHECKPOINTS:
        return path.parent.parent / CONFIG_FILE, path.parent, int(path.name)
    raise ConfigError(
        f"{path}: expected a run directory holding {CHECKPOINTS}/ (a train run.dir) or one checkpoint step folder "
        f"such as <run.dir>/{CHECKPOINTS}/1000"
    )


def trained_tokenizer_hash(path: str | Path) -> str | None:
    """The sha256 of the tokenizer a run (or step folder) was trained with, as its newest checkpoint records it.

    None when the folder is not a run or its checkpoints predate the record.
    """
    try:
        _, checkpoints, step = locate(path)
    except ConfigError:
        return None
    steps = [step] if step is not None else sorted((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()),
                                                   reverse=True)
    for candidate in steps:
        try:
            meta = _read_meta(checkpoints / str(candidate))
        except (OSError, ValueError):
            continue
        return (meta.get("data_identity") or {}).get("tokenizer")
    return None


def load_for_inference(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Any]:
    """(config, model with trained weights) from a run dir (its newest readable checkpoint) or a step folder.

    The config is the run's saved ``config.yaml`` (plus ``overrides``, e.g. a
    different ``model.attention`` backend for inference), with ``tokenizer.path``
    pointing at the run folder's own ``tokenizer.json`` when it has one; only the
    parameters are read, on the default device. Overrides that change the
    parameters' shapes (``model.vocab_size=1000``) are refused with the differing
    keys before any array is read.
    """
    config_file, checkpoints, step = locate(path)
    config = load_config(config_file, list(overrides))
    own_tokenizer = config_file.parent / TOKENIZER_FILE
    if own_tokenizer.is_file() and not any(o.startswith("tokenizer.path=") for o in overrides):
        config.tokenizer.path = str(own_tokenizer)  # the run's copy, wherever the run folder now is
    model = build_model(config, rngs=nnx.Rngs(config.run.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    target = _abstract(nnx.to_pure_dict(params))
    errors = []

    def restore(candidate: int) -> Any:
        saved = read_saved(checkpoints / str(candidate), config_file, items=("params",))
        wrong = array_differences(saved.arrays["params"], array_table(target))
        if wrong:
            changes = resume_changes(saved.config, config) if saved.config is not None else []
            keys = "; ".join(map(str, _likely_causes_first(changes))) or "no config key"
            raise CheckpointMismatchError(
                f"checkpoint {checkpoints / str(candidate)} does not fit the model asked for ({keys}): its "
                f"parameters differ: {'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''}"
            )
        # Only the params item is read, so no CheckpointManager (which also wants to manage the folder).
        with ocp.StandardCheckpointer() as reader:
            return reader.restore(checkpoints / str(candidate) / "params", target)

    def unreadable(candidate: int, err: Exception) -> None:
        errors.append(f"step {candidate}: {_first_line(err)}")
        log.warning("checkpoint %s is unreadable; trying an older one", checkpoints / str(candidate))

    # A step folder is named by its number only once orbax has committed it (in-progress writes carry a suffix).
    steps = [step] if step is not None else [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {checkpoints}")
    found = newest_readable(steps, restore, unreadable)
    if found is None:
        raise CheckpointError(f"no readable checkpoint in {checkpoints}: " + "; ".join(errors))
    return config, nnx.merge(graphdef, _like(target, found[1]), rest)
