"""How whole documents become rows: packed several to a row, or one to a row grouped by length.

Two ways to keep documents whole (``data.strategy`` pack and length_grouped),
one module, because both start from the same *items* and end in the same CSR
rows (starts, lengths, row_ptr) that :class:`seqjax.data.plan.RowPlan` holds.

Items. A document's sequence is ``[EOT] + text + [EOT]``, or an instruction
example's ids (``store.doc_spans``); it predicts one token fewer than it holds.
An *item* is such a sequence, or a piece of one after the overlong policy; its
*weight* is the number of tokens it predicts, and a row holds at most
``seq_len`` of them.

Packing (``pack``). The packers return, for items in the order given, the row
each one goes to; :func:`rows_from_assignment` turns that into CSR rows.
``greedy`` and ``fill`` are vectorized (one binary search per row / one sort);
``first_fit`` and the ``best_fit`` family place one item at a time, but each
placement is a single numpy scan over the (at most ``pack_buffer``) rows open
at the time. Each item is its own segment: its positions restart at 0, and it
attends only to itself (contract 2).

Length grouping (``length_grouped``). One document per row wastes slots on
padding unless rows of similar length share a batch, and a jitted step
recompiles for every new width unless the widths come from a small fixed set.
:func:`length_grouped_order` does both; :func:`bucket_lengths` is that set.

:mod:`seqjax.data.strategies` holds the table that names them: each packer's
row points at its function here (``greedy_rows``, ``best_fit_rows``, ...,
all of one signature), and :func:`grouped_rows` is length_grouped's entry;
both give :class:`Arranged` rows.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from seqjax.config.tree import Config
from seqjax.core.errors import DataError
from seqjax.data.ragged import exclusive_cumsum, ragged_arange


class Arranged(NamedTuple):
    """Items arranged into rows, as CSR arrays: the pieces of row ``r`` are ``row_ptr[r]:row_ptr[r +
    1]``.

    ``widths``: each global batch's padded width, or None for ``seq_len`` everywhere.
    """

    starts: np.ndarray
    lengths: np.ndarray
    row_ptr: np.ndarray
    widths: np.ndarray | None = None


def check_overlong(predictions: np.ndarray, seq_len: int, overlong: str) -> None:
    """Under ``error``, refuse the store before any work, naming the first overlong document
    (``predictions``: each document's targets, ``store.doc_predictions``)."""
    if overlong != "error":
        return
    over = np.flatnonzero(predictions > seq_len)
    if len(over):
        i = int(over[0])
        raise DataError(
            f"data.overlong=error: document {i} predicts {int(predictions[i])} tokens, "
            f"more than data.seq_len={seq_len} "
            f"({len(over)} documents are too long); choose data.overlong=drop, truncate or split"
        )


def dropped_as_overlong(predictions: np.ndarray, seq_len: int, overlong: str) -> np.ndarray:
    """Which documents the overlong policy leaves out: under ``drop``, those predicting more than
    ``seq_len``."""
    predictions = np.asarray(predictions)
    return predictions > seq_len if overlong == "drop" else np.zeros(len(predictions), bool)


def document_items(spans: tuple[np.ndarray, np.ndarray], order: np.ndarray, seq_len: int,
                   overlong: str, has_target=None) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the sequences of documents ``order`` after the overlong policy;
    ``spans`` is every document's sequence (``store.doc_spans()``).

    ``split`` cuts a long document into pieces of ``seq_len`` predictions, each its own sequence
    (the piece reads the token before it as context); ``keep`` leaves documents whole (the ``fill``
    packer splits them itself). ``has_target(starts, predictions)`` (instruction data:
    :func:`seqjax.data.scored.has_scored_target`) says which cut items still hold a scored target: a
    truncated chat that lost every answer, or a split piece with none, would train nothing and is
    left out (:func:`overlong_report` counts them)."""
    starts = np.asarray(spans[0], np.int64)[order]
    weights = np.asarray(spans[1], np.int64)[order] - 1
    starts, weights = starts[weights > 0], weights[weights > 0]  # (a one-token example has no target)
    cut = weights > seq_len
    if overlong == "drop":
        keep = ~dropped_as_overlong(weights, seq_len, overlong)
        starts, weights, cut = starts[keep], weights[keep], cut[keep]
    elif overlong == "truncate":
        weights = np.minimum(weights, seq_len)
    elif overlong == "split":
        owner, j = ragged_arange(-(-weights // seq_len))
        starts = starts[owner] + j * seq_len
        weights = np.minimum(seq_len, weights[owner] - j * seq_len)
        cut = cut[owner]
    else:
        check_overlong(weights, seq_len, overlong)
    if has_target is not None and overlong in ("truncate", "split") and cut.any():
        keep = np.ones(len(starts), bool)
        keep[cut] = has_target(starts[cut], weights[cut])
        starts, weights = starts[keep], weights[keep]
    return starts, weights + 1


def overlong_report(predictions: np.ndarray, seq_len: int, overlong: str, spans=None,
                    has_target=None) -> dict[str, int | str]:
    """What ``overlong`` does to the documents longer than a row, for the train log and the data report:
    how many there are, and how many it drops, truncates or splits (into how many pieces); with
    ``has_target``, how many cut items hold no scored target and are left out."""
    predictions = np.asarray(predictions, np.int64)
    over = predictions > seq_len
    report: dict[str, int | str] = {"policy": overlong, "longer_than_a_row": int(over.sum()),
                                    "seq_len": seq_len}
    if not over.any() or overlong not in ("truncate", "split", "drop"):
        return report
    report[{"drop": "dropped", "truncate": "truncated", "split": "split"}[overlong]] = int(over.sum())
    if overlong == "split":
        report["pieces"] = int((-(-predictions[over] // seq_len)).sum())
    if has_target is not None and spans is not None and overlong != "drop":
        starts, lengths = document_items(spans, np.flatnonzero(over), seq_len, overlong)
        report["left_out_without_answer"] = int((~has_target(starts, lengths - 1)).sum())
    return report


def greedy(weights: np.ndarray, capacity: int, max_segments: int | None) -> np.ndarray:
    """Next-fit (lmms-engine): fill the current row in order, start a new one when the next item
    does not fit.

    One binary search per row over the items' running sum (Python's bisect on a
    list: numpy's per-call overhead would dominate these scalar searches).
    """
    ends = exclusive_cumsum(weights).tolist()
    cuts = [0]
    while cuts[-1] < len(weights):
        i = cuts[-1]
        j = bisect.bisect_right(ends, ends[i] + capacity) - 1
        cuts.append(j if max_segments is None else min(j, i + max_segments))
    return np.repeat(np.arange(len(cuts) - 1), np.diff(cuts))


class _BestSlots:
    """Open rows that can take more, as a sorted list of ``(free, slot)``: the tightest fit is one
    bisect."""

    def __init__(self, size: int):
        self.items: list[tuple[int, int]] = []
        self.listed = [0] * size

    def find(self, w: int) -> int:
        k = bisect.bisect_left(self.items, (w, -1))
        return self.items[k][1] if k < len(self.items) else -1

    def set(self, slot: int, free: int) -> None:
        if self.listed[slot]:
            self.items.pop(bisect.bisect_left(self.items, (self.listed[slot], slot)))
        if free:
            bisect.insort(self.items, (free, slot))
        self.listed[slot] = free


class _FirstSlots:
    """A max-segment-tree over slots: the first slot with enough room is one O(log n) descent."""

    def __init__(self, size: int):
        self.size = 1 << max(0, (size - 1).bit_length())
        self.tree = [0] * (2 * self.size)

    def find(self, w: int) -> int:
        tree, i = self.tree, 1
        if tree[1] < w:
            return -1
        while i < self.size:
            i = 2 * i if tree[2 * i] >= w else 2 * i + 1
        return i - self.size

    def set(self, slot: int, free: int) -> None:
        tree, i = self.tree, slot + self.size
        tree[i] = free
        while i > 1:
            i //= 2
            tree[i] = max(tree[2 * i], tree[2 * i + 1])


def fit(weights: np.ndarray, capacity: int, max_segments: int | None, open_rows: int, best: bool,
        decreasing: bool) -> tuple[np.ndarray, np.ndarray]:
    """First-fit or best-fit, online, with at most ``open_rows`` rows open at once.

    Each item goes to the first open row it fits (first-fit) or to the one it
    leaves fullest (best-fit); when none fits and ``open_rows`` are open, the
    fullest row is closed to make room. An item that fills a row alone never
    occupies a slot. With ``decreasing``, each window of ``open_rows`` items is
    sorted longest first before placement (best-fit decreasing over a buffer).
    Returns each item's row (rows numbered in opening order) and its placement
    rank (the order of items inside a row). Each placement is O(log open_rows).
    """
    n = len(weights)
    order = np.arange(n)
    if decreasing:
        order = np.lexsort((-weights, order // open_rows))
    row = np.empty(n, np.int64)
    rank = np.empty(n, np.int64)
    cap = n + 1 if max_segments is None else max_segments
    free, count, slot_row = [0] * open_rows, [0] * open_rows, [0] * open_rows
    # rows that can still take an item
    slots = _BestSlots(open_rows) if best else _FirstSlots(open_rows)
    used = next_row = 0
    for placed, (i, w) in enumerate(zip(order.tolist(), weights[order].tolist())):
        rank[i] = placed
        if w == capacity:  # a full item shares no row: give it one without searching
            row[i], next_row = next_row, next_row + 1
            continue
        r = slots.find(w)
        if r < 0:
            if used < open_rows:
                r, used = used, used + 1
            else:
                r = min(range(open_rows), key=free.__getitem__)  # close the fullest open row
            slot_row[r], next_row = next_row, next_row + 1
            free[r], count[r] = capacity, 0
        free[r] -= w
        count[r] += 1
        row[i] = slot_row[r]
        slots.set(r, free[r] if count[r] < cap else 0)
    return row, rank


def rows_from_assignment(starts: np.ndarray, lengths: np.ndarray, row: np.ndarray,
                         rank: np.ndarray | None = None):
    """CSR ``(starts, lengths, row_ptr)`` from each item's row (and order inside the row)."""
    order = np.lexsort((np.arange(len(row)) if rank is None else rank, row))
    n_rows = int(row.max()) + 1 if len(row) else 0
    row_ptr = exclusive_cumsum(np.bincount(row, minlength=n_rows))
    return starts[order], lengths[order], row_ptr


def fill_rows(starts: np.ndarray, lengths: np.ndarray, capacity: int, max_segments: int | None = None,
              open_rows: int = 0):
    """``fill``: concatenate the items and cut every ``capacity`` predictions: rows are full,
    documents split across rows (so no segment cap: ``max_segments`` must be None, as the strategies
    table checks).

    A continuation piece reads the token before it as context and restarts its
    positions as a new segment, so no prediction is lost; only the last row is short.
    """
    item_first = exclusive_cumsum(lengths - 1)
    total = int(item_first[-1])
    cuts = np.union1d(item_first, np.arange(0, total, capacity))
    item = np.searchsorted(item_first, cuts[:-1], "right") - 1
    piece_starts = starts[item] + cuts[:-1] - item_first[item]
    row = cuts[:-1] // capacity
    return rows_from_assignment(piece_starts, np.diff(cuts) + 1, row)


def greedy_rows(starts: np.ndarray, lengths: np.ndarray, capacity: int, max_segments: int | None = None,
                open_rows: int = 0):
    """``greedy``: next-fit in the order given (:func:`greedy`); CSR rows."""
    return rows_from_assignment(starts, lengths, greedy(lengths - 1, capacity, max_segments))


def _fit_rows(best: bool, decreasing: bool):
    def rows(starts: np.ndarray, lengths: np.ndarray, capacity: int, max_segments: int | None = None,
             open_rows: int = 1024):
        row, rank = fit(lengths - 1, capacity, max_segments, open_rows, best=best,
                        decreasing=decreasing)
        return rows_from_assignment(starts, lengths, row, rank)

    name = f"{'best' if best else 'first'}_fit{'_decreasing' if decreasing else ''}"
    rows.__doc__ = f"``{name}`` (:func:`fit`); CSR rows."
    return rows


first_fit_rows = _fit_rows(best=False, decreasing=False)
best_fit_rows = _fit_rows(best=True, decreasing=False)
best_fit_decreasing_rows = _fit_rows(best=True, decreasing=True)


def bucket_lengths(config: Config) -> np.ndarray:
    """length_grouped widths: ``data.bucket_lengths`` or powers of two, always with ``seq_len`` as
    the last.

    ``data.seq_len=100`` and no buckets give ``[2, 4, 8, 16, 32, 64, 100]``.
    """
    d = config.data
    chosen = d.bucket_lengths or [
        1 << k for k in range(1, d.seq_len.bit_length()) if 1 << k < d.seq_len
    ]
    return np.unique(np.asarray([*chosen, d.seq_len], np.int64))


def length_grouped_order(
    weights: np.ndarray, batch_size: int, mega_batch_mult: int, buckets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """HF's LengthGroupedSampler idea on already shuffled rows, with padded widths from a fixed set
    of buckets.

    Mega-batches of ``mega_batch_mult * batch_size`` rows are each sorted
    longest first and cut into batches; the batch with the longest row moves to
    the front, so an out-of-memory shows at the first step. Returns the row
    order (``-1``: an empty row filling the last batch) and each batch's width,
    the smallest bucket holding its longest row, so jit sees at most
    ``len(buckets)`` shapes.

    Rows of weights ``[3, 9, 4, 1, 7]`` in batches of 2, mega-batches of 2 rows,
    buckets ``[2, 4, 8, 16]``: rows ``[1, 0 | 2, 3 | 4, -1]``, widths ``[16, 4, 8]``.
    """
    n = len(weights)
    mega = np.arange(n) // (batch_size * mega_batch_mult)
    order = np.lexsort((-weights, mega))
    n_batches = -(-n // batch_size)
    rows = np.full(n_batches * batch_size, -1, np.int64)
    rows[:n] = order
    longest = np.zeros(n_batches * batch_size, np.int64)
    longest[:n] = weights[order]
    batch_longest = longest.reshape(n_batches, batch_size).max(axis=1)
    first = int(np.argmax(batch_longest))
    batch_order = np.concatenate([[first], np.delete(np.arange(n_batches), first)])
    rows = rows.reshape(n_batches, batch_size)[batch_order].reshape(-1)
    widths = buckets[np.searchsorted(buckets, batch_longest[batch_order])]
    return rows, widths


def grouped_rows(starts: np.ndarray, lengths: np.ndarray, config: Config) -> Arranged:
    """``data.strategy=length_grouped``: one item per row, rows of similar length in one batch of a
    bucket's width.

    Rows ``-1`` from :func:`length_grouped_order` (filling the last batch) are empty rows: no piece.
    """
    d = config.data
    rows, widths = length_grouped_order(lengths - 1, d.batch_size, d.mega_batch_mult,
                                        bucket_lengths(config))
    pieces = rows[rows >= 0]
    return Arranged(starts[pieces], lengths[pieces], exclusive_cumsum((rows >= 0).astype(np.int64)),
                    widths)
