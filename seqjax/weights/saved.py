"""Resume planning: what a checkpoint says about itself, and whether (and how) this run may continue
from it.

Before any array is read, a step's own config and orbax's metadata (every
array's shape and dtype) are compared with what the current run would restore
into (:func:`plan_resume`): arrays that do not fit, or a config change that
alters the batches or the model, is a *mismatch* (nothing on disk is touched);
a step that cannot describe itself is *damaged*
(:class:`seqjax.train.checkpoint.Checkpointer` sets it aside). The guarantees
are in docs/training.md ("Resuming") and docs/design.md, contract 4.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from seqjax.config.diff import ConfigChange, resume_changes
from seqjax.config.fields import DATA
from seqjax.config.load import load_config
from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import CheckpointMismatchError
from seqjax.data.pipeline import next_epoch_start

CHECKPOINTS = "checkpoints"
CORRUPT = "checkpoints_corrupt"
CONFIG_FILE = "config.yaml"
# The run's own copy of its tokenizer: a run folder copied to another machine still has it.
TOKENIZER_FILE = "tokenizer.json"
# the arrays whose shapes and dtypes a restore must match
ITEMS_CHECKED = ("params", "opt_state", "rng")
PARAMS_ONLY = "params_only"  # the meta key of a checkpoint of parameters alone (seqjax.import's)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Restored:
    """What a resume continues from; ``data_state`` is None when the data restarts from its
    beginning."""

    step: int
    params: Any
    opt_state: Any
    rng: jax.Array
    meta: dict[str, Any]
    data_state: dict[str, Any] | None
    changes: list[ConfigChange] = field(default_factory=list)
    # set when a changed config restarted the data (the position used)
    data_restart: dict[str, Any] | None = None


@dataclass
class Saved:
    """What a checkpoint says about itself, read without loading any array."""

    step: int
    path: Path
    config: dict[str, Any] | None
    meta: dict[str, Any]
    arrays: dict[str, dict[str, tuple[tuple[int, ...], str]]]  # item -> {tree path: (shape, dtype)}
    data_states: dict[str, dict[str, Any]]  # file name (process_i-of-n.json) -> state


def abstract(tree: Any) -> Any:
    """Shape/dtype/sharding of every leaf: the target orbax restores into (already sharded)."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def like_target(target: Any, restored: Any) -> Any:
    """Give restored leaves the target's tree structure (orbax returns optax's NamedTuples as plain
    tuples)."""
    return jax.tree.unflatten(jax.tree.structure(target), jax.tree.leaves(restored))


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def array_table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"blocks/0/mlp/w_up": ((32, 64), "float32"), ...}`` for a pytree of arrays or of orbax
    array metadata.

    Paths are written the same way for both (a NamedTuple field, a dict key
    and a list index all become one path part), so a template and a
    checkpoint's metadata compare directly.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(_key_name(k) for k in path): (tuple(int(d) for d in leaf.shape),
                                               str(np.dtype(leaf.dtype)))
        for path, leaf in leaves
    }


def array_differences(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    """Each array whose presence, shape or dtype differs: ``path: checkpoint (64, 32) float32, now
    (128, 32) ...``."""
    def show(entry):
        return "absent" if entry is None else f"{entry[0]} {entry[1]}"

    return [f"{path}: checkpoint {show(saved.get(path))}, now {show(wanted.get(path))}"
            for path in sorted(set(saved) | set(wanted)) if saved.get(path) != wanted.get(path)]


def newest_readable(steps: Iterable[int], restore: Callable[[int], T],
                    unreadable: Callable[[int, Exception], None]) -> tuple[int, T] | None:
    """``(step, restore(step))`` for the first step, newest first, that restores; None when none
    does.

    Each step that fails is handed to ``unreadable`` (which reports it, and may
    move it aside) before the next older one is tried. A
    :class:`~seqjax.core.errors.CheckpointMismatchError` is not a failure to read:
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


def first_line(err: BaseException) -> str:
    """The error's type and first line, without the TensorStore spec orbax appends to a failed
    read."""
    line = (str(err).splitlines() or [""])[0].split(" See full TensorStore details")[0]
    return f"{type(err).__name__}: {line[:300]}"


def read_saved(step_dir: Path, fallback_config: Path | None = None,
               items: tuple[str, ...] = ITEMS_CHECKED) -> Saved:
    """A step folder's config, meta, array table (of ``items``) and data positions; raises if any of
    them is unreadable. A parameters-only checkpoint (:func:`save_params`) has no data positions: it
    reads with ``items=("params",)`` and gives none."""
    meta = read_meta(step_dir)
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
    data_states = {
        p.name: json.loads(p.read_text())
        for p in sorted((step_dir / "data").glob("process_*.json"))
    }
    if not data_states and not meta.get(PARAMS_ONLY):
        raise FileNotFoundError(f"{step_dir / 'data'}: no data position (process_*.json)")
    return Saved(int(step_dir.name), step_dir, config, meta, arrays, data_states)


def _data_state(saved: Saved, process_index: int, process_count: int) -> dict[str, Any] | None:
    """This process's saved position; a position of seqjax's epochs ({epoch, batch}) is global, so
    any file serves."""
    own = f"process_{process_index}-of-{process_count}.json"
    if own in saved.data_states:
        return saved.data_states[own]
    first = next(iter(saved.data_states.values()))
    return first if "epoch" in first else None


def likely_causes_first(changes: list[ConfigChange]) -> list[ConfigChange]:
    # stable: config order within each group
    return sorted(changes, key=lambda c: c.kind == "exact")


def plan_resume(
        saved: Saved, config: Config, templates: dict[str, Any], identity: dict[str, Any],
        process_index: int, process_count: int
) -> tuple[list[ConfigChange], dict[str, Any] | None, dict[str, Any] | None]:
    """Decide how ``saved`` resumes under ``config``: (changes, data state to set, data restart or
    None).

    Raises :class:`~seqjax.core.errors.CheckpointMismatchError`, touching nothing,
    when the arrays do not fit ``templates`` (shape, dtype or tree), or when a
    change alters the batches or the model and ``train.allow_config_change``
    is off. ``identity`` is the current run's training data identity
    (tokenizer and source hashes), compared with the checkpoint's.

    With the override and a change to the batches, the data restarts at the next epoch boundary
    (:func:`seqjax.data.pipeline.next_epoch_start`; the rule is contract 4 in docs/design.md).
    """
    changes = resume_changes(saved.config, config) if saved.config is not None else []
    if saved.config is None:
        log.warning(
            "checkpoint %s carries no config (no config/metadata, and no config.yaml beside checkpoints/ "
            "that loads): no change to the batches or the model since it can be seen, so none is refused. "
            "The run resumes its parameters, optimizer and data position under the config given now",
            saved.path)
    old_identity = saved.meta.get("data_identity")
    if old_identity is not None:
        for name, label in (("tokenizer", "tokenizer (sha256)"),
                            ("sources", "training text (xxh3 of each file)")):
            if old_identity.get(name) != identity.get(name):
                changes.append(ConfigChange(label, old_identity.get(name), identity.get(name), DATA))
    state = _data_state(saved, process_index, process_count)
    # Grain's packers keep one position per process: another process count cannot continue it
    if state is None:
        old = len(saved.data_states)
        changes.append(
            ConfigChange("processes (Grain packer positions are per process)", old, process_count,
                         DATA))
    where = f"checkpoint {saved.path}"
    wrong_arrays = [f"{item}/{line}" for item in ITEMS_CHECKED
                    for line in array_differences(saved.arrays[item], array_table(templates[item]))]
    if wrong_arrays:
        shown = "; ".join(wrong_arrays[:4]) + (f"; and {len(wrong_arrays) - 4} more"
                                               if len(wrong_arrays) > 4 else "")
        # Every change is listed, the likely causes first: optimizer keys (train.grad_clip,
        # train.nonfinite) change the state's tree too.
        keys = "; ".join(map(str, likely_causes_first(changes))) or "no config key (the code changed?)"
        raise CheckpointMismatchError(
            f"{where} does not fit this config, which changed {keys}. Its arrays differ: {shown}. "
            "Nothing was moved: resume with the checkpoint's values, or start a new run.dir"
        )
    refused = [c for c in changes if c.kind != "exact"]
    if refused and not config.train.allow_config_change:
        raise CheckpointMismatchError(
            f"{where} was written under another config: {'; '.join(map(str, refused))}. Resuming would not "
            "continue the same " + ("batches" if any(c.kind == DATA
                                                     for c in refused) else "model") +
            ". Nothing was moved: restore those values, or set train.allow_config_change=true to resume anyway "
            "(the data then restarts at the next epoch boundary)")
    if not any(c.kind == DATA for c in changes):
        return changes, state, None
    restart = next_epoch_start(state, config)
    if restart is None:
        return changes, None, {"from": state, "to": "the beginning of Grain's stream"}
    return changes, restart, {"from": state, "to": restart}



def read_meta(step_dir: Path) -> dict[str, Any]:
    """A step folder's meta item (step, tokens seen, devices, data identity, ...)."""
    return json.loads((step_dir / "meta" / "metadata").read_text())


def params_only(step_dir: Path) -> bool:
    """Whether a step folder is a checkpoint of parameters alone (:func:`save_params`)."""
    try:
        return bool(read_meta(step_dir).get(PARAMS_ONLY))
    except (OSError, ValueError, AttributeError):
        return False  # unreadable: restore_latest treats it as damage
