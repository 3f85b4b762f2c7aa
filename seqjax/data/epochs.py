"""A window of an epoch as a random-access Grain dataset, and the windows and epochs chained into
one iterator.

``window_dataset(planner, epoch, position, ...)[k]`` is this process's slice
of global batch ``k`` of the window served at ``position`` of that epoch,
built from the window's plan by the one contract builder.
:class:`EpochsIterDataset` chains windows and epochs; its iterator state is
``{epoch, batch, window, window_batch}`` (JSON, saved in checkpoints):
``batch`` counts the epoch's batches, ``window`` and ``window_batch`` say
where they are, so resuming plans one window (O(1) in the corpus size) and
replays nothing and skips nothing. A state with only ``epoch`` and ``batch``
(an older checkpoint, or a position chosen by hand) is found by counting
the epoch's windows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import grain
import numpy as np

from seqjax.config.tree import Config
from seqjax.core.errors import DataError
from seqjax.data import image_rows, pairs
from seqjax.data.contract import Batch, contract_batch
from seqjax.data.plan import EpochPlanner
from seqjax.data.scored import target_weights

# Batches are built this many token slots at a time: numpy's per-call overhead dominates a single
# batch.
BUILD_SLOTS = 1 << 18


def next_epoch_start(state: dict[str, Any] | None) -> dict[str, Any]:
    """The iterator state at the start of the next epoch after ``state`` (``state`` itself at an
    epoch's start).

    ``{"epoch": e, "batch": k, ...}`` becomes ``{"epoch": e + 1, "batch": 0}`` (``e`` itself when
    ``k = 0``); no state, or one of another iterator, starts at epoch 0. A resume under a config
    that changes the batches goes on from here: the new config's cut of a whole epoch, never the
    middle of one.
    """
    if state is None or "epoch" not in state:
        return {"epoch": 0, "batch": 0}
    return {"epoch": int(state["epoch"]) + started(state), "batch": 0}


def started(position: dict[str, Any]) -> bool:
    """Whether a saved position is past its epoch's first batch (any of the iterators' counters
    above 0)."""
    return any(int(position.get(key, 0)) > 0 for key in ("batch", "window", "window_batch", "row"))


def window_dataset(planner: EpochPlanner, epoch: int, position: int, process_index: int,
                   process_count: int) -> grain.MapDataset:
    """Random access to this process's batches of one window: ``ds[k]`` is its slice of the window's
    batch ``k``.

    Consecutive batches are built together (a group of about ``BUILD_SLOTS``
    tokens) and the last group is kept, so sequential reads cost one
    vectorized build per group while any ``k`` can still be read directly.
    """
    plan = planner.window_plan(epoch, position)
    tokens = planner.store.tokens
    d = planner.config.data
    # pairs: the raw 0/1 weights (a preference objective sums log-probabilities by them)
    normalization = "tokens" if d.format == "preference" else planner.config.train.loss_normalization
    scores = target_weights(planner.store, normalization)
    local = plan.batch_size // process_count
    group = max(1, BUILD_SLOTS // (local * int(plan.widths.max()))) if plan.num_batches else 1
    if planner.image_spec is not None:  # a batch's patches weigh more than a group of token rows: one at a time
        group = 1
    cache: dict[int, Batch] = {}

    def build(g: int) -> Batch:
        batches = np.arange(g * group, min((g + 1) * group, plan.num_batches))
        rows = plan.batch_rows(batches, process_index, process_count)
        width = int(plan.widths[batches].max())
        starts, lengths, row_of_piece = plan.pieces(rows)
        if d.format != "preference":
            built = contract_batch(tokens, starts, lengths, row_of_piece, len(rows), width, scores)
            if planner.image_spec is not None:  # chats with images: each row's own patches beside its tokens
                built.update(image_rows.stored_image_fields(planner.store, planner.image_spec, starts, lengths,
                                                            row_of_piece, len(rows), width, d.patches_per_row))
            return built
        offsets, fields = pairs.piece_labels(planner.store, starts, lengths, row_of_piece, d.shared_prompt)
        return contract_batch(tokens, starts, lengths, row_of_piece, len(rows), width, scores, offsets, fields)

    def batch(k: int) -> Batch:
        g, i = divmod(k, group)
        built = cache.get(g)
        if built is None:  # (a race between reader threads only builds a group twice)
            built = build(g)
            cache.clear()
            cache[g] = built
        width = int(plan.widths[k])
        return {key: value[i * local : (i + 1) * local] if key in image_rows.PATCH_FIELDS else
                value[i * local : (i + 1) * local, :width] for key, value in built.items()}

    return grain.MapDataset.range(plan.num_batches).map(batch)


def epoch_in_order(config: Config, store: Any, start: int = 0) -> tuple[int, Iterator[Batch]]:
    """``(batches in the epoch, an iterator over them from batch start)``: every global batch of
    one unshuffled epoch of ``store`` (``data.shuffle`` off), in order. What scores or precomputes
    over a whole split (every pair once) reads."""
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, shuffle=False))
    planner = EpochPlanner(config, store)
    windows = len(planner.windows(0))
    total = sum(planner.window_batches(0, w) for w in range(windows))

    def batches() -> Iterator[Batch]:
        k = 0
        for position in range(windows):
            dataset = window_dataset(planner, 0, position, 0, 1)
            for i in range(len(dataset)):
                if k >= start:
                    yield dataset[i]
                k += 1

    return total, batches()


class EpochsIterDataset(grain.IterDataset):
    """Window after window, epoch after epoch, of a planner; state ``{epoch, batch, window,
    window_batch}``."""

    def __init__(self, planner: EpochPlanner, process_index: int = 0, process_count: int = 1):
        super().__init__()
        self._args = (planner, process_index, process_count)

    def __iter__(self) -> "_EpochsIterator":
        return _EpochsIterator(*self._args)


class _EpochsIterator(grain.DatasetIterator):
    def __init__(self, planner: EpochPlanner, process_index: int, process_count: int):
        super().__init__()
        self._planner, self._shard = planner, (process_index, process_count)
        self._epoch = self._batch = self._window = self._window_batch = 0
        self._current: tuple[tuple[int, int], grain.MapDataset] | None = None

    def _dataset(self) -> grain.MapDataset:
        key = (self._epoch, self._window)
        if self._current is None or self._current[0] != key:
            self._current = (key, window_dataset(self._planner, *key, *self._shard))
        return self._current[1]

    def __next__(self) -> Batch:
        empty = 0  # windows in a row that gave no batch: a whole epoch of them means none ever will
        while True:
            windows = len(self._planner.windows(self._epoch))
            if self._window >= windows:
                self._epoch, self._batch, self._window, self._window_batch = self._epoch + 1, 0, 0, 0
                continue
            ds = self._dataset()
            if self._window_batch < len(ds):
                break
            empty = empty + 1 if len(ds) == 0 else 0
            if empty > windows:
                raise DataError(f"epoch {self._epoch} gives no batch: every window of it is empty")
            self._window, self._window_batch = self._window + 1, 0
        item = ds[self._window_batch]
        self._window_batch += 1
        self._batch += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batch": self._batch, "window": self._window,
                "window_batch": self._window_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])
        if "window" in state:
            self._window, self._window_batch = int(state["window"]), int(state["window_batch"])
            return
        self._window, left = 0, self._batch  # find batch k by counting the windows before it
        while self._window < len(self._planner.windows(self._epoch)):
            size = self._planner.window_batches(self._epoch, self._window)
            if left < size:
                break
            self._window, left = self._window + 1, left - size
        self._window_batch = left
