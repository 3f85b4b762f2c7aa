"""The one place that wires a config and a token store into a Grain pipeline of contract batches.

It reads as four steps, each in its own module:

1. **check** (:func:`seqjax.data.strategies.check`): the store can give what the
   config asks for, or a :class:`~seqjax.core.errors.DataError` says why, before any work;
2. **plan** (:class:`seqjax.data.plan.EpochPlanner`): each epoch's rows, a
   window at a time, as :class:`~seqjax.data.plan.RowPlan` s, a pure function of
   ``(run.seed, epoch, window)`` computed with vectorized numpy;
3. **window dataset** (:func:`seqjax.data.epochs.window_dataset`): a random-access
   ``grain.MapDataset`` of *batch index -> this process's slice of that global
   batch*, built by the one contract builder (:mod:`seqjax.data.contract`);
4. **iterator** (:class:`seqjax.data.epochs.EpochsIterDataset`): windows and epochs
   chained; its state is ``{"epoch", "batch", "window", "window_batch"}`` (JSON),
   so resuming replays nothing and skips nothing.

A mixture store (``data.sources``) goes to :class:`seqjax.data.mixture.MixtureIterDataset`:
steps 2-4 for each source, and a schedule that shares each batch's rows out by weight.

Grain's own packers (``packer=grain_*``, :mod:`seqjax.data.grain_packing`) are
the exception: a Grain ``IterDataset`` transform whose state is Grain's own.
"""

from __future__ import annotations

from typing import Any

import grain

from seqjax.config.tree import Config, ConfigError
from seqjax.data import epochs, mixture, strategies
from seqjax.data.epochs import EpochsIterDataset
from seqjax.data.mixture import MixtureIterDataset
from seqjax.data.plan import EpochPlanner
from seqjax.store.reader import TokenStore


def build_pipeline(
    config: Config, store: TokenStore, *, process_index: int = 0, process_count: int = 1
) -> grain.IterDataset:
    """An infinite ``grain.IterDataset`` of this process's batches: dicts of the five contract
    arrays.

    Local shape ``[data.batch_size // process_count, L]`` (``L = data.seq_len``,
    or a bucket length for ``length_grouped``). Batches are a pure function of
    ``(run.seed, step, process_index, process_count)``; processes read disjoint
    slices of every global batch. For example, with ``data.batch_size=8`` and two
    processes, process 1 reads rows 4..7 of every global batch.
    """
    if not 0 <= process_index < process_count:
        raise ConfigError(
            f"process_index: got {process_index}, expected 0 <= index < process_count={process_count}"
        )
    d = config.data
    strategies.check_config(config)
    strategies.check(config, store, process_count)
    if strategies.uses_grain_packer(d):
        return strategies.grain_packed(config, store, process_index=process_index,
                                       process_count=process_count)
    # a mixture: every strategy runs within each source, the schedule shares out the rows
    if store.sources:
        planners = []
        for source in store.source_stores:
            strategies.check(config, source, process_count)
            planners.append(EpochPlanner(config, source))
            planners[-1].check_rows(whole_batch=False)
        return MixtureIterDataset(config, store, planners, process_index, process_count)
    planner = EpochPlanner(config, store)
    planner.check_rows()
    return EpochsIterDataset(planner, process_index, process_count)


def next_epoch_start(state: dict[str, Any] | None, config: Config) -> dict[str, Any] | None:
    """The data position to resume from when a resume changes how batches are cut
    (``train.allow_config_change``).

    The old position means nothing under the new cut, so the run goes on at the start of the next
    epoch of the pipeline that ``config`` builds. None for Grain's packers: their state is Grain's
    own, and their stream starts again from its beginning.
    """
    if strategies.uses_grain_packer(config.data):
        return None
    if config.data.sources:
        return mixture.next_epoch_start(state, len(config.data.sources))
    return epochs.next_epoch_start(state)
