"""Packing documents into rows, each document (or piece of one) its own segment.

A document's sequence is ``[EOT] + text + [EOT]`` (``store.doc_with_context``):
it predicts ``doc_lengths[i]`` tokens. An *item* is such a sequence, or a piece
of one after the overlong policy; its *weight* is the number of tokens it
predicts, and a row holds at most ``seq_len`` of them.

The packers return, for items in the order given, the row each one goes to;
:func:`rows_from_assignment` turns that into a row plan. ``greedy`` and
``fill`` are vectorized (one binary search per row / one sort); ``first_fit``
and the ``best_fit`` family place one item at a time, but each placement is a
single numpy scan over the (at most ``pack_buffer``) rows open at the time.
"""

from __future__ import annotations

import bisect

import numpy as np

from seqjax.data.batching import DataError, exclusive_cumsum, ragged_arange


def check_overlong(doc_lengths: np.ndarray, seq_len: int, overlong: str) -> None:
    """Under ``error``, refuse the store before any work, naming the first overlong document."""
    if overlong != "error":
        return
    over = np.flatnonzero(doc_lengths > seq_len)
    if len(over):
        i = int(over[0])
        raise DataError(
            f"data.overlong=error: document {i} predicts {int(doc_lengths[i])} tokens, more than data.seq_len={seq_len} "
            f"({len(over)} documents are too long); choose data.overlong=drop, truncate or split"
        )


def document_items(doc_offsets: np.ndarray, order: np.ndarray, seq_len: int, overlong: str) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` of the sequences of documents ``order`` after the overlong policy.

    ``split`` cuts a long document into pieces of ``seq_len`` predictions, each
    its own sequence (the piece reads the token before it as context);
    ``keep`` leaves documents whole (the ``fill`` packer splits them itself).
    """
    starts = np.asarray(doc_offsets[:-1], np.int64)[order] - 1
    weights = np.diff(doc_offsets)[order]
    if overlong == "drop":
        keep = weights <= seq_len
        starts, weights = starts[keep], weights[keep]
    elif overlong == "truncate":
        weights = np.minimum(weights, seq_len)
    elif overlong == "split":
        owner, j = ragged_arange(-(-weights // seq_len))
        starts = starts[owner] + j * seq_len
        weights = np.minimum(seq_len, weights[owner] - j * seq_len)
    else:
        check_overlong(weights, seq_len, overlong)
    return starts, weights + 1


def greedy(weights: np.ndarray, capacity: int, max_segments: int | None) -> np.ndarray:
    """Next-fit (lmms-engine): fill the current row in order, start a new one when the next item does not fit.

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


def fit(weights: np.ndarray, capacity: int, max_segments: int | None, open_rows: int, best: bool, decreasing: bool) -> tuple[np.ndarray, np.ndarray]:
    """First-fit or best-fit, online, with at most ``open_rows`` rows open at once.

    Each item goes to the first open row it fits (first-fit) or to the one it
    leaves fullest (best-fit); when none fits and ``open_rows`` are open, the
    fullest row is closed to make room. An item that fills a row alone never
    occupies a slot. With ``decreasing``, each window of ``open_rows`` items is
    sorted longest first before placement (best-fit decreasing over a buffer).
    Returns each item's row (rows numbered in opening order) and its placement
    rank (the order of items inside a row).
    """
    n = len(weights)
    order = np.arange(n)
    if decreasing:
        window = order // open_rows
        order = np.lexsort((-weights, window))
    row = np.empty(n, np.int64)
    rank = np.empty(n, np.int64)
    cap = n + 1 if max_segments is None else max_segments
    free = np.zeros(open_rows, np.int64)
    count = np.zeros(open_rows, np.int64)
    slot_row = np.zeros(open_rows, np.int64)
    # best-fit: open rows that can still take an item, as a sorted list of (free, slot): one bisect per item
    candidates: list[tuple[int, int]] = []
    used = next_row = 0
    for placed, i in enumerate(order.tolist()):
        w = int(weights[i])
        rank[i] = placed
        if w == capacity:  # a full item shares no row: give it one without searching
            row[i], next_row = next_row, next_row + 1
            continue
        if best:
            k = bisect.bisect_left(candidates, (w, -1))
            r = candidates.pop(k)[1] if k < len(candidates) else -1
        else:
            ok = free[:used] >= w
            if max_segments is not None:
                ok &= count[:used] < cap
            r = int(np.argmax(ok)) if used and ok.any() else -1
        if r < 0:
            if used < open_rows:
                r, used = used, used + 1
            else:
                r = int(np.argmin(free))  # close the fullest open row
                if best and (int(free[r]), r) in candidates:
                    candidates.remove((int(free[r]), r))
            slot_row[r], next_row = next_row, next_row + 1
            free[r], count[r] = capacity, 0
        free[r] -= w
        count[r] += 1
        row[i] = slot_row[r]
        if best and free[r] > 0 and count[r] < cap:
            bisect.insort(candidates, (int(free[r]), r))
    return row, rank


def rows_from_assignment(starts: np.ndarray, lengths: np.ndarray, row: np.ndarray, rank: np.ndarray | None = None):
    """CSR ``(starts, lengths, row_ptr)`` from each item's row (and order inside the row)."""
    order = np.lexsort((np.arange(len(row)) if rank is None else rank, row))
    n_rows = int(row.max()) + 1 if len(row) else 0
    row_ptr = exclusive_cumsum(np.bincount(row, minlength=n_rows))
    return starts[order], lengths[order], row_ptr


def fill(starts: np.ndarray, lengths: np.ndarray, capacity: int):
    """Concatenate the items and cut every ``capacity`` predictions: rows are full, documents split across rows.

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


def pack(starts: np.ndarray, lengths: np.ndarray, packer: str, capacity: int, max_segments: int | None, open_rows: int):
    """Dispatch to a seqjax packer; returns the CSR rows."""
    weights = lengths - 1
    if packer == "greedy":
        return rows_from_assignment(starts, lengths, greedy(weights, capacity, max_segments))
    if packer == "fill":
        return fill(starts, lengths, capacity)
    best = packer in ("best_fit", "best_fit_decreasing")
    row, rank = fit(weights, capacity, max_segments, open_rows, best=best, decreasing=packer == "best_fit_decreasing")
    return rows_from_assignment(starts, lengths, row, rank)
