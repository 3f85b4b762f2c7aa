"""An epoch as a random-access Grain dataset, and the epochs chained into one iterator with state ``{epoch, batch}``.

``epoch_dataset(planner, epoch, ...)[k]`` is this process's slice of global
batch ``k`` of that epoch, built from the epoch's plan by the one contract
builder. :class:`EpochsIterDataset` chains the epochs; its iterator state is
two integers (JSON, saved in checkpoints), so resuming at any step replays
nothing and skips nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import grain
import numpy as np

from seqjax.data.contract import contract_batch
from seqjax.data.plan import EpochPlanner

# Batches are built this many token slots at a time: numpy's per-call overhead dominates a single batch.
BUILD_SLOTS = 1 << 18


def epoch_dataset(planner: EpochPlanner, epoch: int, process_index: int, process_count: int) -> grain.MapDataset:
    """Random access to this process's batches of one epoch: ``ds[k]`` is its slice of global batch ``k``.

    Consecutive batches are built together (a group of about ``BUILD_SLOTS``
    tokens) and the last group is kept, so sequential reads cost one
    vectorized build per group while any ``k`` can still be read directly.
    """
    plan = planner.plan(epoch)
    tokens = planner.store.tokens
    local = plan.batch_size // process_count
    group = max(1, BUILD_SLOTS // (local * int(plan.widths.max())))
    cache: dict[int, dict[str, np.ndarray]] = {}

    def build(g: int) -> dict[str, np.ndarray]:
        batches = np.arange(g * group, min((g + 1) * group, plan.num_batches))
        rows = plan.batch_rows(batches, process_index, process_count)
        width = int(plan.widths[batches].max())
        return contract_batch(tokens, *plan.pieces(rows), len(rows), width)

    def batch(k: int) -> dict[str, np.ndarray]:
        g, i = divmod(k, group)
        built = cache.get(g)
        if built is None:  # (a race between reader threads only builds a group twice)
            built = build(g)
            cache.clear()
            cache[g] = built
        width = int(plan.widths[k])
        return {key: value[i * local : (i + 1) * local, :width] for key, value in built.items()}

    return grain.MapDataset.range(plan.num_batches).map(batch)


class EpochsIterDataset(grain.IterDataset):
    """Epoch after epoch of a per-epoch ``MapDataset`` factory; state ``{"epoch", "batch"}`` for exact resumption."""

    def __init__(self, make_epoch: Callable[[int], grain.MapDataset]):
        super().__init__()
        self._make_epoch = make_epoch

    def __iter__(self) -> "_EpochsIterator":
        return _EpochsIterator(self._make_epoch)


class _EpochsIterator(grain.DatasetIterator):
    def __init__(self, make_epoch: Callable[[int], grain.MapDataset]):
        super().__init__()
        self._make_epoch = make_epoch
        self._epoch, self._batch = 0, 0
        self._current: tuple[int, grain.MapDataset] | None = None

    def _dataset(self) -> grain.MapDataset:
        if self._current is None or self._current[0] != self._epoch:
            self._current = (self._epoch, self._make_epoch(self._epoch))
        return self._current[1]

    def __next__(self) -> dict[str, np.ndarray]:
        ds = self._dataset()
        while self._batch >= len(ds):
            self._epoch, self._batch = self._epoch + 1, 0
            ds = self._dataset()
        item = ds[self._batch]
        self._batch += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batch": self._batch}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
