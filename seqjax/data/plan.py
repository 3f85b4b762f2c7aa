"""The plan of an epoch: which stream pieces fill which row, as a pure function of ``(config, store, run.seed, epoch)``.

Stream strategies (window, random_offset, ...) give one span per row, then
shuffle the rows and split them at document boundaries; document strategies
(pack, length_grouped) order the documents, apply ``data.overlong``, and pack
or length-group them. Which of the two a strategy is, its spans function, and
whether it shuffles come from the table in :mod:`seqjax.data.strategies`.
"""

from __future__ import annotations

import functools

import numpy as np

from seqjax.config import Config
from seqjax.data import packing
from seqjax.data.batching import bucket_lengths, length_grouped_order
from seqjax.data.rows import RowPlan
from seqjax.data.store import TokenStore
from seqjax.data.strategies import STRATEGIES
from seqjax.errors import DataError


class EpochPlanner:
    """Plans of epochs for one (config, store): ``plan(epoch)`` is a pure function of ``(seed, epoch)``."""

    def __init__(self, config: Config, store: TokenStore):
        self.config = config
        self.data = config.data
        self.strategy = STRATEGIES[config.data.strategy]
        self.store = store
        self.seed = config.run.seed
        self.document_ends = np.asarray(store.doc_offsets, np.int64) - 1  # EOT positions: segment boundaries
        self._plans: dict[int, RowPlan] = {}

    def rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    @functools.cached_property
    def static_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """The spans of a strategy whose spans do not depend on the epoch (only their order does)."""
        return self.strategy.spans(self.store, self.data, self.seed, 0, self.rng(0))

    def spans(self, epoch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.strategy.per_epoch:
            return self.strategy.spans(self.store, self.data, self.seed, epoch, rng)
        return self.static_spans

    def plan(self, epoch: int) -> RowPlan:
        """The epoch's plan, kept for the current and the previous epoch (an iterator and a resume may both ask)."""
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = self._plan(epoch)
        return self._plans[epoch]

    def _plan(self, epoch: int) -> RowPlan:
        d = self.data
        rng = self.rng(epoch)
        plan = self._document_rows(rng) if self.strategy.documents else self._span_rows(epoch, rng)
        if plan.num_rows == 0:
            why = (
                " (data.overlong=drop dropped every document)"
                if d.overlong == "drop" and self.strategy.documents
                else ""
            )
            raise DataError(f"data.strategy={d.strategy}: the store gives no rows at data.seq_len={d.seq_len}{why}")
        return plan

    def _span_rows(self, epoch: int, rng: np.random.Generator) -> RowPlan:
        """One span per row, shuffled where the strategy allows, one segment per document piece unless asked not to."""
        d = self.data
        starts, lengths = self.spans(epoch, rng)
        plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len)
        if d.shuffle and self.strategy.shuffles:
            plan = plan.take(rng.permutation(plan.num_rows))
        if not d.cross_document_attention:
            plan = plan.split_at(self.document_ends)
        return plan

    def _document_rows(self, rng: np.random.Generator) -> RowPlan:
        """Documents in (shuffled) order after data.overlong, then packed (pack) or length-grouped (length_grouped)."""
        d = self.data
        order = rng.permutation(self.store.num_docs) if d.shuffle else np.arange(self.store.num_docs)
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
