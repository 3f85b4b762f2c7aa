"""The plan of an epoch, a window at a time: which stream pieces fill which row, a pure function of ``(seed, epoch)``.

An epoch is cut into *windows* of about ``data.plan_window_tokens`` tokens, and
only the window being read is planned, so planning memory follows the window,
not the corpus (a billion tokens plan like sixteen million). The shuffle has
two levels: the windows' order, from ``(seed, epoch)``, then the rows inside a
window, from ``(seed, epoch, window)``.

- **Stream strategies** (window, random_offset, sequential, random_window,
  concat_chunk) have arithmetic rows (:class:`seqjax.data.strategies.Rows`):
  the epoch's rows are exactly those of a whole-epoch plan, and a window is a
  range of ``C`` of them, ``C`` a multiple of ``data.batch_size``. Only the
  last window may be partial, and it is always served last, so only the
  epoch's last batch can hold empty rows, as before. random_offset still
  draws one offset per epoch, so every token after it is predicted exactly
  once per epoch.
- **Document strategies** (pack, length_grouped) and **block** plan each
  window of whole documents as they would plan a store of only those
  documents: documents are shuffled and packed (or grouped, or cut into
  blocks) inside their window. Each document is still used exactly once per
  epoch; a window's last batch is completed with empty rows.

A store that fits one window (WikiText-2's 3M tokens, at the default) is
planned in one piece: its epoch is one window, shuffled as one.

Which kind a strategy is, its rows function, and whether it shuffles come from
the table in :mod:`seqjax.data.strategies`.
"""

from __future__ import annotations

import functools

import numpy as np

from seqjax.config import Config
from seqjax.data import packing
from seqjax.data.batching import bucket_lengths, length_grouped_order
from seqjax.data.rows import RowPlan
from seqjax.data.store import TokenStore
from seqjax.data.strategies import STRATEGIES, Rows
from seqjax.errors import DataError


class EpochPlanner:
    """Plans of epochs for one (config, store), a window at a time; every plan is a pure function of its arguments.

    ``windows(e)`` is the serving order of epoch ``e``'s windows,
    ``window_plan(e, w)`` the rows of window ``w`` (in serving order), and
    ``plan(e)`` the whole epoch joined (for reports and tests; it holds the
    epoch in memory). For example, with 10 full windows of 4 batches each,
    batch 13 of an epoch is batch 1 of the fourth window served.
    """

    def __init__(self, config: Config, store: TokenStore):
        self.config = config
        self.data = config.data
        self.strategy = STRATEGIES[config.data.strategy]
        self.store = store
        self.seed = config.run.seed
        d = self.data
        if self.strategy.rows is not None:
            per_window = -(-d.plan_window_tokens // (d.seq_len * d.batch_size))
            self.window_rows = max(1, per_window) * d.batch_size
        else:  # windows of whole documents, cut where the stream passes each multiple of plan_window_tokens
            cuts = np.searchsorted(store.doc_offsets, np.arange(1, store.num_tokens // d.plan_window_tokens + 1)
                                   * d.plan_window_tokens)
            self.doc_bounds = np.unique(np.concatenate([[0], cuts[(cuts > 0) & (cuts < store.num_docs)],
                                                        [store.num_docs]]))
        self._plans: dict[tuple[int, int], RowPlan] = {}
        self._epochs: dict[int, tuple[Rows | None, np.ndarray]] = {}

    def rng(self, epoch: int, window: int | None = None) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch] if window is None else [self.seed, epoch, window])

    @functools.cached_property
    def _static_rows(self) -> Rows:
        return self.strategy.rows(self.store, self.data, self.seed, 0, self.rng(0))

    def _epoch(self, epoch: int) -> tuple[Rows | None, np.ndarray]:
        """The epoch's rows (stream strategies) and its windows' serving order, both from ``(seed, epoch)``."""
        if epoch not in self._epochs:
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}  # an iterator and a resume
            self._epochs[epoch] = self._new_epoch(epoch)
        return self._epochs[epoch]

    def _new_epoch(self, epoch: int) -> tuple[Rows | None, np.ndarray]:
        rng = self.rng(epoch)
        rows = None
        if self.strategy.rows is not None:
            rows = self.strategy.rows(self.store, self.data, self.seed, epoch, rng) if self.strategy.per_epoch \
                else self._static_rows
            full, partial = divmod(rows.count, self.window_rows)
            order = np.arange(full)
            if self.data.shuffle and self.strategy.shuffles:
                order = rng.permutation(full)
            return rows, np.append(order, [full] if partial else []).astype(np.int64)
        count = len(self.doc_bounds) - 1
        shuffle = self.data.shuffle and self.strategy.shuffles
        return None, rng.permutation(count) if shuffle else np.arange(count)

    def windows(self, epoch: int) -> np.ndarray:
        """The ids of epoch ``epoch``'s windows in the order they are served."""
        return self._epoch(epoch)[1]

    def window_plan(self, epoch: int, position: int) -> RowPlan:
        """The rows of the window served at ``position`` in epoch ``epoch``; the current and previous are kept."""
        key = (epoch, position)
        if key not in self._plans:
            self._plans = {k: p for k, p in self._plans.items() if k == max(self._plans, default=key)}
            self._plans[key] = self._window_plan(epoch, position)
        return self._plans[key]

    def window_batches(self, epoch: int, position: int) -> int:
        """Global batches in that window; arithmetic for stream strategies, planned for the others."""
        rows, order = self._epoch(epoch)
        if rows is not None:
            w = int(order[position])
            return -(-(min((w + 1) * self.window_rows, rows.count) - w * self.window_rows) // self.data.batch_size)
        return self.window_plan(epoch, position).num_batches

    def plan(self, epoch: int) -> RowPlan:
        """The whole epoch, its windows joined in serving order (each window's rows padded to whole batches)."""
        plans = [self.window_plan(epoch, i) for i in range(len(self.windows(epoch)))]
        return join(plans, self.data.batch_size) if plans else self._empty()

    def _empty(self) -> RowPlan:
        return RowPlan.from_rows([], [], [0], self.data.batch_size, self.data.seq_len)

    def _window_plan(self, epoch: int, position: int) -> RowPlan:
        rows, order = self._epoch(epoch)
        w = int(order[position])
        rng = self.rng(epoch, w)
        if rows is not None:
            return self._span_rows(rows.spans(w * self.window_rows, min((w + 1) * self.window_rows, rows.count)), rng)
        first, end = int(self.doc_bounds[w]), int(self.doc_bounds[w + 1])
        if self.strategy.window_spans is not None:
            return self._span_rows(self.strategy.window_spans(self.store, self.data, first, end), rng)
        return self._document_rows(first, end, rng)

    def _span_rows(self, spans: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> RowPlan:
        """One span per row, shuffled where the strategy allows, one segment per document piece unless asked not to."""
        d = self.data
        starts, lengths = spans
        plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len)
        if d.shuffle and self.strategy.shuffles:
            plan = plan.take(rng.permutation(plan.num_rows))
        if not d.cross_document_attention and len(starts):
            # the EOTs (segment boundaries) inside this window's stretch of the stream, not the whole store's
            offsets = self.store.doc_offsets
            lo, hi = np.searchsorted(offsets, [starts.min(), (starts + lengths).max()])
            plan = plan.split_at(np.asarray(offsets[max(lo - 1, 0) : hi + 1], np.int64) - 1)
        return plan

    def _document_rows(self, first: int, end: int, rng: np.random.Generator) -> RowPlan:
        """Documents first..end-1 in (shuffled) order after data.overlong, then packed or length-grouped."""
        d = self.data
        count = end - first
        order = first + (rng.permutation(count) if d.shuffle else np.arange(count))
        fill_splits = d.strategy == "pack" and d.packer == "fill" and d.overlong == "split"  # fill splits them itself
        starts, lengths = packing.document_items(self.store.doc_offsets, order, d.seq_len,
                                                 "keep" if fill_splits else d.overlong)
        if d.strategy == "pack":
            rows = packing.pack(starts, lengths, d.packer, d.seq_len, d.max_segments_per_row, d.pack_buffer)
            plan = RowPlan.from_rows(*rows, d.batch_size, d.seq_len)
            return plan.take(rng.permutation(plan.num_rows)) if d.shuffle else plan
        rows, widths = length_grouped_order(lengths - 1, d.batch_size, d.mega_batch_mult, bucket_lengths(self.config))
        plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len).take(rows)
        plan.widths = widths
        return plan

    def check_rows(self, whole_batch: bool = True) -> None:
        """Refuse a strategy that gives no row, or (``whole_batch``) an epoch smaller than a batch, before any work.

        A mixture's source only needs rows: the batch draws them from every source.
        """
        d = self.data
        rows, order = self._epoch(0)
        if rows is not None:
            count = rows.count
        elif len(order) == 1:
            count = self.window_plan(0, 0).num_rows
        else:  # many windows: a corpus this large holds a batch; the first window must give rows
            count = max(self.window_plan(0, 0).num_rows, d.batch_size)
        if count == 0:
            why = " (data.overlong=drop dropped every document)" if d.overlong == "drop" and self.strategy.documents \
                else ""
            raise DataError(f"data.strategy={d.strategy}: the store gives no rows at data.seq_len={d.seq_len}{why}")
        if whole_batch and count < d.batch_size and self.strategy.has_epochs:
            raise DataError(
                f"data.batch_size={d.batch_size} is larger than one epoch of data: data.strategy={d.strategy} gives "
                f"{count} rows of data.seq_len={d.seq_len} "
                f"from {self.store.num_tokens} tokens in {self.store.num_docs} documents"
            )


def join(plans: list[RowPlan], batch_size: int) -> RowPlan:
    """Plans one after another, each padded with empty rows to whole batches (as the iterator serves them)."""
    starts, lengths, counts, widths = [], [], [], []
    for plan in plans:
        starts.append(plan.starts)
        lengths.append(plan.lengths)
        padded = plan.num_batches * batch_size
        counts.append(np.concatenate([plan.segments_per_row, np.zeros(padded - plan.num_rows, np.int64)]))
        widths.append(plan.widths)
    row_ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
    joined = RowPlan(np.concatenate(starts), np.concatenate(lengths), row_ptr.astype(np.int64), batch_size,
                     np.concatenate(widths).astype(np.int64))
    last = plans[-1]
    if last.num_rows % batch_size:  # the epoch's last rows stay past the end, as a one-window plan has them
        keep = len(row_ptr) - 1 - (last.num_batches * batch_size - last.num_rows)
        joined.row_ptr = joined.row_ptr[: keep + 1]
    return joined
