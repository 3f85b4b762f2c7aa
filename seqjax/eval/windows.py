"""Evaluation windows: the three perplexity protocols as batch-contract rows whose ``weights`` say
what each row scores.

A *unit* is a run of tokens scored on its own: the whole split's stream
(``blocks``, ``sliding``) or one document's sequence (``documents``,
``store.doc_spans()``): an article ``[EOT] + text + [EOT]``, or an instruction
example's ids. A window reads ``context``
input tokens ``u[a : a + context]`` and predicts the next ones
``u[a + 1 : a + context + 1]``; its ``weights`` mark only the targets it is
responsible for, so that across all windows

    every predicted token of the split is scored exactly once.

**The first-token rule.** The first token of every unit is context only,
never a target: it is always the ``<|endoftext|>`` that opens the stream or
the article (an instruction example's first id, which nothing precedes). So
every text token, the first word of an article included, is predicted from at
least that one token, and every mode scores exactly ``store.predicted_tokens``
tokens (for text, ``len(store.tokens) - 1``: each text token plus each
article's closing EOT).

The modes:

- ``blocks``: non-overlapping windows of ``context`` over the stream, as
  HF ``run_clm`` evaluates. (run_clm never scores the first token of a block;
  here it is scored, with one token of context, so nothing is skipped.)
- ``sliding``: windows ``stride`` apart over the stream, each scoring only the
  targets the previous window did not reach (the first window scores all of
  its own), as in HF's "perplexity of fixed-length models" guide. Every scored
  token after the first window has at least ``context - stride`` tokens of
  context. ``stride == context`` is exactly ``blocks``.
- ``documents``: each article scored on its own with disjoint rolling windows;
  the last window of an article is moved back to end at the article's end, so
  its new tokens get a full window of context (lm-evaluation-harness's
  ``loglikelihood_rolling`` wikitext protocol).

Documents see each other only if asked: by default a stream window gives each
article piece its own segment id (positions restart at the article's opening
EOT), so an article is never conditioned on the one before it, the same
isolation the packed training rows have. ``cross_document_attention=True``
gives each window one segment (the HF/GPT-2 convention).

Window bounds are computed for all windows at once (vectorized numpy, a few
small int64 arrays); rows are materialized a batch at a time, always
``[batch_size, context]``, the last batch padded with weight-0 rows, so a
jitted scorer compiles once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from seqjax.data import document_rows
from seqjax.data.contract import Batch, contract_batch
from seqjax.data.plan import RowPlan, per_document
from seqjax.data.ragged import exclusive_cumsum, ragged_arange, starts_in_groups
from seqjax.data.scored import target_weights
from seqjax.store.reader import TokenStore

MODES = ("blocks", "sliding", "documents")


@dataclass(frozen=True)
class EvalWindows:
    """Window bounds for one split and protocol; all positions are indices into ``store.tokens``.

    Window ``w`` reads inputs from ``starts[w]``, may not read past the last
    token of its unit ``ends[w]``, and scores the targets at stream positions
    ``lo[w] < p <= hi[w]``. Rows hold one window each, or, when ``row_ptr`` is
    set (:meth:`packed`), the windows ``row_ptr[r]:row_ptr[r + 1]`` side by
    side, each its own segment, as training packs examples.
    """

    store: TokenStore
    mode: str
    context: int
    stride: int
    starts: np.ndarray
    ends: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    cross_document_attention: bool = False
    row_ptr: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def num_rows(self) -> int:
        return len(self) if self.row_ptr is None else len(self.row_ptr) - 1

    def windows_in(self, rows: int) -> int:
        """How many windows the first ``rows`` rows hold."""
        rows = min(rows, self.num_rows)
        return rows if self.row_ptr is None else int(self.row_ptr[rows])

    @property
    def scored_tokens(self) -> int:
        return int(np.sum(self.hi - self.lo))

    def num_batches(self, batch_size: int) -> int:
        return -(-self.num_rows // batch_size)

    def packed(self, open_rows: int = 1024) -> "EvalWindows":
        """The windows packed into rows by best-fit decreasing (each keeps its own segment and
        positions).

        ``documents`` pads each article's windows to ``context`` otherwise: on short examples most
        of every row is padding (198k tokens of chats filled 1.02M slots). A packed row scores the
        same targets with the same context each, so the sums are those of the windows scored one per
        row.
        """
        predicted = np.minimum(self.context, self.ends - self.starts)
        order, _, row_ptr = document_rows.best_fit_decreasing_rows(np.arange(len(self)), predicted + 1,
                                                                   self.context, None, open_rows)
        return dataclasses.replace(self, starts=self.starts[order], ends=self.ends[order],
                                   lo=self.lo[order], hi=self.hi[order], row_ptr=row_ptr)

    def _windows_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the windows in ``rows``, in row order; each one's row within ``rows``)."""
        if self.row_ptr is None:
            return rows, np.arange(len(rows))
        counts = self.row_ptr[rows + 1] - self.row_ptr[rows]
        owner, offset = ragged_arange(counts)
        return self.row_ptr[rows][owner] + offset, owner

    def rows(self, index: np.ndarray) -> Batch:
        """The batch-contract rows ``index`` ([len(index), context] each), by the one contract
        builder.

        Each window is one stream span, split into a segment per article unless
        ``cross_document_attention``; the weights then keep only the targets each
        window is responsible for (stream positions ``lo < p <= hi``).
        """
        plan, row_of_piece, targets = self._layout(np.asarray(index, np.int64))
        # instruction data: only the answers' tokens count
        batch = contract_batch(self.store.tokens, plan.starts, plan.lengths, row_of_piece, len(index),
                               self.context, target_weights(self.store))
        batch["weights"] *= targets >= 0
        return batch

    def target_positions(self, index: np.ndarray) -> np.ndarray:
        """``[len(index), context]``: the stream position of the target each slot of rows ``index``
        scores (a window's own targets, ``lo < p <= hi``), or -1 where the slot scores nothing."""
        return self._layout(np.asarray(index, np.int64))[2]

    def _layout(self, index: np.ndarray) -> tuple[RowPlan, np.ndarray, np.ndarray]:
        """(the rows' pieces, each piece's row, each slot's target position or -1) of rows ``index``.

        A window's pieces sit in its row one after another from its first slot; slot ``k`` of a
        piece starting at stream position ``s`` predicts ``s + 1 + k``.
        """
        windows, row_of_window = self._windows_of(index)
        starts = self.starts[windows]
        # a window never reads past its unit
        predicted = np.minimum(self.context, self.ends[windows] - starts)
        row_ptr = exclusive_cumsum(np.bincount(row_of_window, minlength=len(index)))
        plan = RowPlan.from_rows(starts, predicted + 1, row_ptr, batch_size=max(len(index), 1),
                                 width=self.context)
        window_of_piece = np.arange(len(windows))
        if not self.cross_document_attention:
            # An input belongs to the article of the token it predicts, so the EOT between two
            # articles is the first (context-only) token of the second one's segment; an instruction
            # example is its ids alone.
            plan, parent = per_document(plan, self.store, parents=True)
            window_of_piece = window_of_piece[parent]
        row_of_piece = np.repeat(np.arange(plan.num_rows), plan.segments_per_row)
        per_piece = plan.lengths - 1
        first_slot = starts_in_groups(per_piece, row_of_piece, len(index))
        owner, k = ragged_arange(per_piece)
        target = plan.starts[owner] + 1 + k
        window = windows[window_of_piece[owner]]
        mine = (target > self.lo[window]) & (target <= self.hi[window])
        out = np.full((len(index), self.context), -1, np.int64)
        out[row_of_piece[owner], first_slot[owner] + k] = np.where(mine, target, -1)
        return plan, row_of_piece, out

    def batches(self, batch_size: int) -> Iterator[Batch]:
        """Rows in order, ``batch_size`` at a time; the last batch is padded with empty rows."""
        for begin in range(0, self.num_rows, batch_size):
            index = np.arange(begin, min(begin + batch_size, self.num_rows))
            batch = self.rows(index)
            missing = batch_size - len(index)
            if missing:
                batch = {
                    k: np.concatenate([v, np.zeros((missing, self.context), v.dtype)])
                    for k, v in batch.items()
                }
            yield batch


def unit_windows(
    unit_start: np.ndarray, unit_end: np.ndarray, context: int, stride: int, right_align_last: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Windows over each unit ``tokens[unit_start[u] : unit_end[u] + 1]`` (vectorized over units).

    Window ``k`` of a unit starts ``k * stride`` in and scores the targets after
    the previous window's last one, up to its own last target (or the unit's end).
    """
    predicted = unit_end - unit_start  # targets at unit offsets 1 .. predicted
    count = 1 + np.maximum(0, -(-(predicted - context) // stride))
    unit = np.repeat(np.arange(len(unit_start)), count)
    k = np.arange(len(unit)) - np.repeat(np.cumsum(count) - count, count)
    n = predicted[unit]
    begin = k * stride
    hi = np.minimum(begin + context, n)
    lo = np.where(k == 0, 0, np.minimum(begin - stride + context, n))
    if right_align_last:
        is_last = k == count[unit] - 1
        begin = np.where(is_last, np.maximum(0, n - context), begin)
    base = unit_start[unit]
    return base + begin, unit_end[unit], base + lo, base + hi


def resolve_stride(mode: str, context: int, stride: int | None) -> int:
    """Check the window settings and return the stride in use (``context`` except in
    ``sliding``)."""
    if mode not in MODES:
        raise ValueError(f"eval.mode: got {mode!r}, expected one of {', '.join(MODES)}")
    if context < 1:
        raise ValueError(f"eval.context: got {context}, expected at least 1")
    if mode != "sliding":
        return context
    stride = context // 2 if stride is None else stride
    if not 1 <= stride <= context:
        raise ValueError(f"eval.stride: got {stride}, expected 1 .. eval.context={context}")
    return stride


def eval_windows(
    store: TokenStore,
    mode: str,
    context: int,
    stride: int | None = None,
    *,
    cross_document_attention: bool = False,
    pack: bool = False,
) -> EvalWindows:
    """The windows of ``mode`` over ``store``; ``stride`` matters to ``sliding`` only (default
    ``context // 2``).

    ``pack`` packs ``documents``' windows into rows (:meth:`EvalWindows.packed`); the stream modes'
    windows are full rows already but the last, so they are left one per row."""
    stride = resolve_stride(mode, context, stride)
    if mode == "documents":  # each document's sequence (store.doc_spans): [EOT] + text + [EOT], or an example
        unit_start, lengths = store.doc_spans()
        unit_end = unit_start + lengths - 1
    else:
        unit_start = np.zeros(1, np.int64)
        unit_end = np.asarray([len(store.tokens) - 1], np.int64)
    starts, ends, lo, hi = unit_windows(unit_start, unit_end, context, stride,
                                        right_align_last=mode == "documents")
    windows = EvalWindows(store, mode, context, stride, starts, ends, lo, hi, cross_document_attention)
    return windows.packed() if pack and mode == "documents" else windows
