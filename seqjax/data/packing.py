"""Packing documents into rows, each document (or piece of one) its own segment.

A document's sequence is ``[EOT] + text + [EOT]`` (``store.doc_with_context``):
it predicts ``doc_lengths[i]`` tokens. An *item* is such a sequence, or a piece
of one after the overlong policy; its *weight* is the number of tokens it
predicts, and a row holds at most ``seq_len`` of them.

The packers return, for items in the order given, the row each one goes to;
:func:`rows_from_assignment` turns that into a row plan. ``greedy`` and
``fill`` are vectorized (one binary search per row / one sort); ``first_fit``
and the ``best_fit`` family place one item at a time, but each placement is a
single numpy scan over the rows open in the current buffer.
"""

from __future__ import annotations

import numpy as np

from seqjax.data.batching import DataError, exclusive_cumsum, ragged_arange

OVERLONG = ("drop", "truncate", "split", "error")


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
    its own sequence (the piece reads the token before it as context).
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
    """Next-fit (lmms-engine): fill the current row in order, start a new one when the next item does not fit."""
    ends = exclusive_cumsum(weights)
    row = np.empty(len(weights), np.int64)
    i, r = 0, 0
    while i < len(weights):
        j = int(np.searchsorted(ends, ends[i] + capacity, "right")) - 1
        if max_segments is not None:
            j = min(j, i + max_segments)
        row[i:j] = r
        i, r = j, r + 1
    return row


def fit(weights: np.ndarray, capacity: int, max_segments: int | None, buffer: int, best: bool, decreasing: bool) -> tuple[np.ndarray, np.ndarray]:
    """First-fit or best-fit over consecutive buffers of ``buffer`` items; rows close when their buffer ends.

    Returns each item's row and its placement rank (items of a row are laid out
    in placement order; with ``decreasing`` that is longest first).
    """
    n = len(weights)
    row = np.empty(n, np.int64)
    rank = np.empty(n, np.int64)
    cap = n + 1 if max_segments is None else max_segments
    rows_before = 0
    for first in range(0, n, buffer):
        idx = np.arange(first, min(first + buffer, n))
        if decreasing:
            idx = idx[np.argsort(-weights[idx], kind="stable")]
        free = np.empty(len(idx), np.int64)
        count = np.zeros(len(idx), np.int64)
        opened = 0
        for placed, i in enumerate(idx):
            w = weights[i]
            rank[i] = first + placed
            if w == capacity:  # a full item can share no row: open one without searching
                free[opened], count[opened] = 0, 1
                row[i] = rows_before + opened
                opened += 1
                continue
            ok = (free[:opened] >= w) & (count[:opened] < cap)
            if best:
                r = int(np.argmin(np.where(ok, free[:opened], capacity + 1))) if opened else 0
            else:
                r = int(np.argmax(ok)) if opened else 0
            if not opened or not ok[r]:
                r, opened = opened, opened + 1
                free[r] = capacity
            free[r] -= w
            count[r] += 1
            row[i] = rows_before + r
        rows_before += opened
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


def pack(starts: np.ndarray, lengths: np.ndarray, packer: str, capacity: int, max_segments: int | None, buffer: int):
    """Dispatch to a seqjax packer; returns the CSR rows."""
    weights = lengths - 1
    if packer == "greedy":
        return rows_from_assignment(starts, lengths, greedy(weights, capacity, max_segments))
    if packer == "fill":
        return fill(starts, lengths, capacity)
    best = packer in ("best_fit", "best_fit_decreasing")
    row, rank = fit(weights, capacity, max_segments, buffer, best=best, decreasing=packer == "best_fit_decreasing")
    return rows_from_assignment(starts, lengths, row, rank)
