"""Where a run's batches come from: the seam beside the objective's (docs/design.md), one row of
:data:`SOURCES` per kind of data, so that setting a run up asks the table once (:func:`source_row`)
and never tests the format.

==============  =============================================================================================
source          ``next(params, step)``
==============  =============================================================================================
offline         the store's batches (:func:`seqjax.data.pipeline.build_pipeline`), built ahead on a thread and
                put on the device (:class:`~seqjax.train.prefetch.DevicePrefetch`); blind to the
                parameters
rollouts        an RL run's (``data.format=prompt``): completions the policy samples, scored, laid out in rows
                (:class:`seqjax.train.rollouts.RolloutSource`)
==============  =============================================================================================

Each gives ``(batch on the device, position, host metrics)``: ``position`` is what a checkpoint
keeps of where the source is (``get_state()``), and :meth:`set_state` puts a resumed source there;
the host metrics (an RL generation's rewards and lengths) join the step's row in metrics.jsonl.

A row (:class:`SourceRow`) says what setting a run up needs of its data, in the order it is
needed: the token stores to prepare (``splits``), what to check and plan before any weight is
read (``plan``), whether a reference model is wanted (``wants_reference``), and the source itself
once the policy is placed (``open``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax

from seqjax.config.tree import Config
from seqjax.data.pairs import with_reference
from seqjax.data.pipeline import build_pipeline
from seqjax.data.stats import overlong_counts, overlong_line
from seqjax.store.splits import has_split
from seqjax.train import rollouts
from seqjax.train.prefetch import DevicePrefetch

log = logging.getLogger(__name__)


class OfflineSource:
    """Today's pipeline: ``iterator``'s batches, ``depth`` of them built ahead and placed on the
    device."""

    def __init__(self, iterator: Any, to_device: Callable[[dict], dict], depth: int = 2):
        self.iterator, self.to_device, self.depth = iterator, to_device, depth
        self.prefetch: DevicePrefetch | None = None

    def __enter__(self) -> OfflineSource:
        self.prefetch = DevicePrefetch(self.iterator, self.to_device, depth=self.depth)
        return self

    def __exit__(self, *exc) -> None:
        if self.prefetch is not None:
            self.prefetch.close()

    def next(self, params, step: int) -> tuple[dict, Any, dict[str, float]]:
        batch, position = next(self.prefetch)
        return batch, position, {}

    def set_state(self, state: dict[str, Any], step: int) -> None:
        self.iterator.set_state(state)


@dataclasses.dataclass
class Opening:
    """What a source is opened with once the policy is placed (:func:`seqjax.train.setup.setup`)."""

    config: Config
    prepared: Any  # seqjax.store.build.Prepared: the tokenizer and the stores
    plan: Any  # what the row's plan gave
    policy: Any  # seqjax.train.policy.Policy
    params: Any
    frozen: Any  # seqjax.train.policy.Frozen
    mesh: Any
    to_device: Callable[[dict], dict]
    tables: dict | None  # train.precompute_reference's tables (offline rows only)


@dataclasses.dataclass(frozen=True)
class SourceRow:
    """One kind of batch source: ``splits(config)`` the token stores it reads; ``plan(config,
    prepared, mesh)`` its checks and plans before any weight is read (a batch larger than an
    epoch, a bad prompt or rollouts file: one line before the model is built), with the config as
    its data settle it (an RL run's rows); ``overlong(config, prepared)`` what ``data.overlong``
    did (None: not its concern); ``wants_reference(config, objective)``; ``precomputes``: it
    reads train.precompute_reference's tables; ``open(opening)`` the source."""

    name: str
    serves: Callable[[Config], bool]
    splits: Callable[[Config], tuple[str, ...]]
    plan: Callable[[Config, Any, Any], tuple[Config, Any]]
    overlong: Callable[[Config, Any], dict | None]
    wants_reference: Callable[[Config, Any], bool]
    precomputes: bool
    open: Callable[[Opening], Any]


def _offline_splits(config: Config) -> tuple[str, ...]:
    if has_split(config, config.eval.split):
        return ("train", config.eval.split)
    log.warning("no %s split (no %s_files, and data.validation_split_percentage is 0): training "
                "without validation",
                config.eval.split, config.eval.split)
    return ("train",)


def _offline_plan(config: Config, prepared, mesh) -> tuple[Config, Any]:
    stats = prepared.stores["train"].manifest.get("stats", {})
    if stats.get("pairs_dropped"):  # (said by every run, the store's build or its reuse)
        log.info("data.degenerate_pairs=drop: %d pair(s) left out of the train split (%d with equal completions, %d "
                 "with an empty one)", stats["pairs_dropped"], stats.get("pairs_identical", 0),
                 stats.get("pairs_empty", 0))
    # the data's plan before any weight is read: a batch larger than an epoch is one line at once
    return config, build_pipeline(config, prepared.stores["train"], process_index=jax.process_index(),
                                  process_count=jax.process_count())


def _offline_overlong(config: Config, prepared) -> dict | None:
    """What data.overlong did to the train split, said in one line (instruction data: a warning;
    long text documents are usual)."""
    store = prepared.stores["train"]
    overlong = overlong_counts(config, store)
    examples = store.mask is not None
    line = overlong and overlong_line(overlong, "examples" if examples else "documents")
    if line and jax.process_index() == 0:
        log.log(logging.WARNING if examples else logging.INFO, "%s", line)
    return overlong


def _offline_open(opening: Opening) -> OfflineSource:
    """The store's batches (with each pair's precomputed reference log-probabilities, when there
    are any)."""
    data = opening.plan
    if opening.tables is not None:
        data = data.map(functools.partial(with_reference, logps=opening.tables["train"]))
    return OfflineSource(iter(data), opening.to_device, depth=opening.config.train.prefetch)


def _rollouts_splits(config: Config) -> tuple[str, ...]:
    log.info("an RL run: no validation split (the rewards of its rollouts are its measure)")
    return ()


SOURCES: dict[str, SourceRow] = {row.name: row for row in (
    SourceRow("rollouts", lambda config: config.data.format == "prompt", _rollouts_splits, rollouts.plan,
              lambda config, prepared: None, lambda config, objective: config.rl.beta > 0, False, rollouts.open_source),
    SourceRow("offline", lambda config: True, _offline_splits, _offline_plan, _offline_overlong,
              lambda config, objective: objective.reference, True, _offline_open),
)}


def source_row(config: Config) -> SourceRow:
    """The row that serves ``config``'s data: the first whose ``serves`` holds (offline serves
    any)."""
    return next(row for row in SOURCES.values() if row.serves(config))
