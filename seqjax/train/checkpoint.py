"""Checkpoints with orbax's CheckpointManager: what a run needs to continue exactly where it stopped.

A checkpoint is one step folder under ``<run.dir>/checkpoints/`` with five items:

- ``params``, ``opt_state``: the sharded pytrees (each process writes its shards);
- ``rng``: the run's PRNG key (saved so stochastic layers resume their stream);
- ``data``: the Grain iterator state, one JSON file per process (Grain's own
  orbax handler), so the next batch after a restore is the one that would
  have come next: none repeated, none skipped (docs/design.md, contract 4);
- ``meta``: JSON with the step and the running counters (tokens_seen).

orbax writes a step into a temporary folder and renames it when every item is
committed, so a run killed mid-write leaves no folder that looks complete.
A folder that is complete but unreadable (a truncated file) is reported,
moved aside to ``<run.dir>/checkpoints_corrupt/``, and the previous step is
used instead.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx
from grain.checkpoint import CheckpointRestore, CheckpointSave
from jax.experimental import multihost_utils

from seqjax.config import Config, ConfigError, TrainConfig, load_config
from seqjax.errors import CheckpointError
from seqjax.model import build_model

CHECKPOINTS = "checkpoints"
CORRUPT = "checkpoints_corrupt"
CONFIG_FILE = "config.yaml"
# The run's own copy of its tokenizer: a run folder copied to another machine still has it.
TOKENIZER_FILE = "tokenizer.json"

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    rng: jax.Array
    meta: dict[str, Any]


def _abstract(tree: Any) -> Any:
    """Shape/dtype/sharding of every leaf: the target orbax restores into (already sharded)."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _like(target: Any, restored: Any) -> Any:
    """Give restored leaves the target's tree structure (orbax returns optax's NamedTuples as plain tuples)."""
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored))


def newest_readable(steps: Iterable[int], restore: Callable[[int], T],
                    unreadable: Callable[[int, Exception], None]) -> tuple[int, T] | None:
    """``(step, restore(step))`` for the first step, newest first, that restores; None when none does.

    Each step that fails is handed to ``unreadable`` (which reports it, and may
    move it aside) before the next older one is tried.
    """
    for step in sorted(steps, reverse=True):
        try:
            return step, restore(step)
        except Exception as err:  # noqa: BLE001 - any unreadable checkpoint is skipped, and said so
            unreadable(step, err)
    return None


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


class Checkpointer:
    """The run's CheckpointManager plus the fallback-on-corruption restore."""

    def __init__(self, run_dir: str | Path, train: TrainConfig):
        self.run_dir = Path(run_dir).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=train.keep_checkpoints,
            enable_async_checkpointing=train.async_checkpoint,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.run_dir / CHECKPOINTS, options=options)

    def save(self, step: int, params: Any, opt_state: Any, rng: jax.Array, data_iterator: Any, meta: dict) -> None:
        """Start writing step ``step`` (in the background when async); a step already on disk is left alone."""
        if step in self.manager.all_steps():
            return
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                rng=ocp.args.StandardSave({"key": rng}),
                data=CheckpointSave(data_iterator),
                meta=ocp.args.JsonSave({**meta, "step": step}),
            ),
            force=True,
        )

    def restore_latest(self, params: Any, opt_state: Any, rng: jax.Array, data_iterator: Any) -> Restored | None:
        """Restore the newest readable step into the given (sharded) templates; None when there is none.

        ``data_iterator`` is set to the saved position in place.
        """

        def restore(step: int) -> dict[str, Any]:
            return self.manager.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(_abstract(params)),
                    opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
                    rng=ocp.args.StandardRestore(_abstract({"key": rng})),
                    data=CheckpointRestore(data_iterator),
                    meta=ocp.args.JsonRestore(),
                ),
            )

        found = newest_readable(self.manager.all_steps(), restore, self._set_aside)
        if found is None:
            return None
        step, out = found
        return Restored(
            step=step,
            params=_like(params, out["params"]),
            opt_state=_like(opt_state, out["opt_state"]),
            rng=out["rng"]["key"],
            meta=dict(out["meta"]),
        )

    def _set_aside(self, step: int, err: Exception) -> None:
        src = self.run_dir / CHECKPOINTS / str(step)
        dst = self.run_dir / CORRUPT / str(step)
        log.warning("checkpoint %s is unreadable (%s); moving it to %s and trying the previous one",
                    src, _first_line(err), dst)
        if jax.process_index() == 0:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.move(src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"seqjax: checkpoint {step} set aside")
        self.manager.reload()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def wait(self) -> None:
        """Block until background writes are committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def save_params(run_dir: str | Path, step: int, params: Any, meta: dict[str, Any]) -> Path:
    """Write a checkpoint of parameters only (what seqjax.import writes), synchronously; returns its folder.

    :func:`load_for_inference` and ``train.init_from`` read it; training cannot
    resume from it (no optimizer state), so a fine-tune starts in another run.dir.
    """
    folder = Path(run_dir).absolute() / CHECKPOINTS
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(folder, options=options) as manager:
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                   meta=ocp.args.JsonSave({**meta, "step": step})), force=True)
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


def load_for_inference(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Any]:
    """(config, model with trained weights) from a run dir (its newest readable checkpoint) or a step folder.

    The config is the run's saved ``config.yaml`` (plus ``overrides``, e.g. a
    different ``model.attention`` backend for inference), with ``tokenizer.path``
    pointing at the run folder's own ``tokenizer.json`` when it has one; only the
    parameters are read, on the default device.
    """
    config_file, checkpoints, step = locate(path)
    config = load_config(config_file, list(overrides))
    own_tokenizer = config_file.parent / TOKENIZER_FILE
    if own_tokenizer.is_file() and not any(o.startswith("tokenizer.path=") for o in overrides):
        config.tokenizer.path = str(own_tokenizer)  # the run's copy, wherever the run folder now is
    model = build_model(config, rngs=nnx.Rngs(config.run.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    target = _abstract(nnx.to_pure_dict(params))
    manager = ocp.CheckpointManager(checkpoints, options=ocp.CheckpointManagerOptions(read_only=True))
    errors = []

    def unreadable(candidate: int, err: Exception) -> None:
        errors.append(f"step {candidate}: {_first_line(err)}")
        log.warning("checkpoint %s is unreadable; trying an older one", checkpoints / str(candidate))

    try:
        steps = [step] if step is not None else manager.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {checkpoints}")
        found = newest_readable(
            steps, lambda s: manager.restore(s, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))),
            unreadable)
        if found is None:
            raise CheckpointError(f"no readable checkpoint in {checkpoints}: " + "; ".join(errors))
        return config, nnx.merge(graphdef, _like(target, found[1]["params"]), rest)
    finally:
        manager.close()
