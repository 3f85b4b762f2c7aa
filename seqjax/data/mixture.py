"""Mixtures (``data.sources``): every global batch draws rows from each source in proportion to its
weight.

Each source is cut by the configured strategy on its own (its own
:class:`~seqjax.data.plan.EpochPlanner`, windows and epochs), so every
strategy applies within each source; a source's rows are read in its own
order, one after another, as the batches ask for them.

Which source fills which row is a pure function of ``(run.seed, step)``:
steps are grouped in blocks of :data:`BLOCK_BATCHES`; a block's
``BLOCK_BATCHES * batch_size`` rows are shared out by weight (largest
remainders, so each source gets its exact share up to one row per block), and
their order is shuffled from ``(seed, block)``. For example, weights 3 and 1
with ``batch_size=4`` give each block of 16 batches 48 rows of the first source
and 16 of the second, in a shuffled order: a batch may hold 2 of one and 2 of
the other, or 4 of the first.

The iterator's state is the step and each source's position (epoch, window,
row): resuming plans one window per source and replays nothing. Process
``p`` of ``P`` builds only its slice of each global batch, but moves every
source's position by the whole batch, so all processes agree.
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import numpy as np

from seqjax.config.tree import Config
from seqjax.data.contract import Batch, contract_batch
from seqjax.data.epochs import started
from seqjax.data.plan import EpochPlanner, RowPlan
from seqjax.data.scored import target_weights
from seqjax.data.strategies import batch_widths
from seqjax.store.reader import TokenStore

# Batches per block of the source schedule: the proportions are exact over each block.
BLOCK_BATCHES = 16


def shares(weights: list[float], total: int) -> np.ndarray:
    """``total`` split by ``weights``, largest remainders first: ``shares([3, 1, 1], 8)`` is ``[5,
    2, 1]``."""
    w = np.asarray(weights, np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]] += 1
    return counts


class Schedule:
    """Which source fills each row of each global batch: ``sources(step)`` is an int array of
    ``batch_size``."""

    def __init__(self, weights: list[float], batch_size: int, seed: int):
        self.batch_size, self.seed = batch_size, seed
        self.counts = shares(weights, BLOCK_BATCHES * batch_size)

    @functools.lru_cache(maxsize=4)
    def _block(self, block: int) -> np.ndarray:
        slots = np.repeat(np.arange(len(self.counts)), self.counts)
        return slots[np.random.default_rng([self.seed, 1 << 30, block]).permutation(len(slots))]

    def sources(self, step: int) -> np.ndarray:
        block, k = divmod(step, BLOCK_BATCHES)
        return self._block(block)[k * self.batch_size : (k + 1) * self.batch_size]


class _SourceRows:
    """One source's rows in its own serving order (epochs, windows, non-empty rows), read ``n`` at a
    time."""

    def __init__(self, planner: EpochPlanner):
        self.planner = planner
        self.epoch = self.window = self.row = 0
        self._last: tuple[tuple[int, int], RowPlan, np.ndarray] | None = None

    def _real(self, epoch: int, window: int) -> tuple[RowPlan, np.ndarray]:
        """The window's plan and its non-empty rows (the rows that complete its last batch are
        skipped)."""
        if self._last is None or self._last[0] != (epoch, window):
            plan = self.planner.window_plan(epoch, window)
            self._last = ((epoch, window), plan, np.flatnonzero(plan.segments_per_row > 0))
        return self._last[1], self._last[2]

    def take(self, n: int) -> list[tuple[RowPlan, np.ndarray]]:
        """The next ``n`` rows, as (plan, row ids) pieces, and move past them."""
        out, empty = [], 0
        while n > 0:
            if self.window >= len(self.planner.windows(self.epoch)):
                self.epoch, self.window, self.row = self.epoch + 1, 0, 0
                continue
            plan, real = self._real(self.epoch, self.window)
            rows = real[self.row : self.row + n]
            if len(rows):
                out.append((plan, rows))
                n -= len(rows)
                self.row += len(rows)
            empty = 0 if len(real) else empty + 1
            if empty > len(self.planner.windows(self.epoch)):
                # check_rows refused such a source before
                raise RuntimeError("a mixture source gives no rows")
            if self.row >= len(real):
                self.window, self.row = self.window + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "window": self.window, "row": self.row}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.window, self.row = int(state["epoch"]), int(state["window"]), int(state["row"])


def next_epoch_start(state: dict[str, Any] | None, n_sources: int) -> dict[str, Any]:
    """The mixture's state with every source at the start of its own next epoch; the step is kept.

    When the number of sources changed, or the run turns into a mixture, every source starts from
    epoch 0.
    """
    saved = state.get("sources") if state is not None else None
    if saved is not None and len(saved) == n_sources:
        return {
            "step": int(state["step"]),
            "sources": [{"epoch": int(s["epoch"]) + started(s), "window": 0, "row": 0}
                        for s in saved]
        }
    return {"step": 0, "sources": [{"epoch": 0, "window": 0, "row": 0} for _ in range(n_sources)]}


class MixtureIterDataset(grain.IterDataset):
    """Batches of a mixture store (``TokenStore.concat``), this process's slice of each; state
    ``{step, sources}``."""

    def __init__(self, config: Config, store: TokenStore, planners: list[EpochPlanner],
                 process_index: int = 0, process_count: int = 1):
        super().__init__()
        self._args = (config, store, planners, process_index, process_count)

    def __iter__(self) -> "_MixtureIterator":
        return _MixtureIterator(*self._args)


class _MixtureIterator(grain.DatasetIterator):

    def __init__(self, config: Config, store: TokenStore, planners: list[EpochPlanner],
                 process_index: int, process_count: int):
        super().__init__()
        d = config.data
        self.schedule = Schedule([w for _, w, _, _ in store.sources], d.batch_size, config.run.seed)
        self.readers = [_SourceRows(p) for p in planners]
        self.tokens = store.tokens
        self.scores = target_weights(store, config.train.loss_normalization)
        ends = np.cumsum([len(p.store.tokens) for p in planners]) - np.arange(len(planners))
        # where each source's stream starts in the mixture's
        self.bases = np.concatenate([[0], ends[:-1] - 1])
        local = d.batch_size // process_count
        self.slots = slice(process_index * local, (process_index + 1) * local)
        self.buckets = batch_widths(config)
        self.step = 0

    def __next__(self) -> Batch:
        sources = self.schedule.sources(self.step)
        starts, lengths, rows = [], [], []
        for s, reader in enumerate(self.readers):
            slot_of = np.flatnonzero(sources == s)  # the batch rows this source fills, in order
            taken = reader.take(len(slot_of))
            j = 0
            for plan, plan_rows in taken:
                p_starts, p_lengths, owner = plan.pieces(plan_rows)
                slot = slot_of[j + owner]
                mine = (slot >= self.slots.start) & (slot < self.slots.stop)
                starts.append(p_starts[mine] + self.bases[s])
                lengths.append(p_lengths[mine])
                rows.append(slot[mine] - self.slots.start)
                j += len(plan_rows)
        self.step += 1
        starts, lengths, rows = (np.concatenate(a) for a in (starts, lengths, rows))
        # pieces in row order, each row's pieces kept in their order
        order = np.argsort(rows, kind="stable")
        n_rows = self.slots.stop - self.slots.start
        longest = int(np.bincount(rows, weights=lengths -
                                  1, minlength=n_rows).max()) if len(rows) else 0
        width = int(self.buckets[np.searchsorted(self.buckets, longest)]) if len(self.buckets) > 1 \
            else int(self.buckets[0])
        return contract_batch(self.tokens, starts[order], lengths[order], rows[order], n_rows,
                              width, self.scores)

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step, "sources": [r.state() for r in self.readers]}

    def set_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        for reader, saved in zip(self.readers, state["sources"]):
            reader.restore(saved)
