"""Row plans and the one place where the batch contract is built.

Every strategy describes an epoch as a :class:`RowPlan`: for each row, the
*pieces* that fill it, each a contiguous slice of the token stream. A piece of
``m`` tokens is one sequence: it gives ``m - 1`` inputs and targets under its
own segment id, so no target ever crosses a segment boundary (DESIGN.md,
contract 1). :func:`contract_batch` turns the pieces of any set of rows into the
five contract arrays with a handful of vectorized numpy operations; nothing
else in seqjax builds those arrays (Grain's packers go through
:func:`from_grain_packed`, which only renames their fields).

Why plans and not generators: a plan is a few integer arrays computed once per
epoch from ``(seed, epoch)``, so batch ``k`` is random access (exact resume
from a step number), shards are index arithmetic (process ``p`` reads a
contiguous slice of every global batch), and statistics (padding, coverage)
are computed without reading a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIELDS = ("inputs", "targets", "segment_ids", "positions", "weights")


class DataError(ValueError):
    """The data cannot produce what the config asks for (too small, overlong document under ``error``, ...)."""


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


def ragged_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts ``[2, 3]``: owners ``[0, 0, 1, 1, 1]`` and offsets ``[0, 1, 0, 1, 2]`` (the vectorized nested loop)."""
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(len(owner), dtype=np.int64) - np.repeat(exclusive_cumsum(counts)[:-1], counts)
    return owner, offset


@dataclass
class RowPlan:
    """The rows of one epoch, in the order they are served.

    ``starts[j]`` / ``lengths[j]``: stream index and token count of piece ``j``
    (``lengths >= 2``); the pieces of row ``r`` are ``row_ptr[r]:row_ptr[r + 1]``,
    in order. ``widths``: the padded length of each global batch (all
    ``seq_len`` except for length-grouped batches). Rows past the last real row
    of the last batch are empty (all padding), so no row of the epoch is lost.
    """

    starts: np.ndarray
    lengths: np.ndarray
    row_ptr: np.ndarray
    batch_size: int
    widths: np.ndarray

    @classmethod
    def from_rows(cls, starts, lengths, row_ptr, batch_size: int, width: int | np.ndarray) -> "RowPlan":
        row_ptr = np.asarray(row_ptr, np.int64)
        n_batches = -(-(len(row_ptr) - 1) // batch_size)
        widths = np.broadcast_to(np.asarray(width, np.int64), (n_batches,)).copy()
        return cls(np.asarray(starts, np.int64), np.asarray(lengths, np.int64), row_ptr, batch_size, widths)

    @classmethod
    def from_spans(cls, starts, lengths, batch_size: int, width: int) -> "RowPlan":
        """One piece per row."""
        return cls.from_rows(starts, lengths, np.arange(len(starts) + 1), batch_size, width)

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def num_batches(self) -> int:
        return len(self.widths)

    @property
    def segments_per_row(self) -> np.ndarray:
        return np.diff(self.row_ptr)

    def take(self, rows: np.ndarray) -> "RowPlan":
        """The rows ``rows`` in that order; ``-1`` makes an empty (all padding) row."""
        starts, lengths, row_of_piece = self.pieces(rows)
        counts = np.bincount(row_of_piece, minlength=len(rows))
        width = int(self.widths[0]) if len(self.widths) else 0
        return RowPlan.from_rows(starts, lengths, exclusive_cumsum(counts), self.batch_size, width)

    def split_at(self, boundaries: np.ndarray) -> "RowPlan":
        """Split every piece at the stream positions in ``boundaries`` (sorted) that fall strictly inside it.

        Used with the EOT positions (``doc_offsets - 1``) to give each document
        its own segment: the EOT ends one piece (as the last target) and opens
        the next (as the first input), so the row keeps every input/target pair
        and only segment ids and positions change.
        """
        last = self.starts + self.lengths - 1
        lo = np.searchsorted(boundaries, self.starts, "right")
        hi = np.searchsorted(boundaries, last, "left")
        cuts = np.maximum(hi - lo, 0)
        owner, j = ragged_arange(cuts + 1)
        first = boundaries[np.clip(lo[owner] + j - 1, 0, len(boundaries) - 1)]
        end = boundaries[np.clip(lo[owner] + j, 0, len(boundaries) - 1)]
        starts = np.where(j == 0, self.starts[owner], first)
        ends = np.where(j == cuts[owner], last[owner], end)
        row_ptr = exclusive_cumsum(cuts + 1)[self.row_ptr]
        return RowPlan(starts, ends - starts + 1, row_ptr, self.batch_size, self.widths)

    def batch_rows(self, batches: np.ndarray, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Rows of global batches ``batches`` that process ``process_index`` reads: a contiguous slice of each."""
        local = self.batch_size // process_count
        first = np.asarray(batches, np.int64)[:, None] * self.batch_size + process_index * local
        return (first + np.arange(local)).reshape(-1)

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, lengths, row_of_piece)`` of rows ``rows``; a row ``-1`` or past the end is empty."""
        rows = np.asarray(rows, np.int64)
        valid = (rows >= 0) & (rows < self.num_rows)
        safe = np.where(valid, rows, 0)
        counts = np.where(valid, self.row_ptr[safe + 1] - self.row_ptr[safe], 0)
        owner, j = ragged_arange(counts)
        piece = self.row_ptr[safe][owner] + j
        return self.starts[piece], self.lengths[piece], owner


def coverage(plan: RowPlan, n_tokens: int) -> np.ndarray:
    """How many times each stream position is a target in this plan (a difference array, O(n))."""
    diff = np.zeros(n_tokens + 1, np.int64)
    np.add.at(diff, plan.starts + 1, 1)
    np.add.at(diff, plan.starts + plan.lengths, -1)
    return np.cumsum(diff[:-1])


def contract_batch(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, row_of_piece: np.ndarray,
                   n_rows: int, width: int) -> dict[str, np.ndarray]:
    """The batch contract for rows made of stream pieces: the single definition used by every strategy.

    Pieces are given in row order, and in order inside a row; each gets the next
    segment id of its row (1, 2, ...), positions restart at 0, and the row is
    right-padded with segment id 0 and weight 0.

    Speed: every prediction is computed once in row-major order and written
    with one boolean-mask assignment per field (rows are filled from column 0),
    so the cost is a few linear numpy passes over the batch.
    """
    # int32 index arithmetic whenever the stream allows it: np.repeat and friends run ~10x faster than on int64
    index = np.int32 if len(tokens) < np.iinfo(np.int32).max else np.int64
    starts = np.asarray(starts, index)
    predicted = (np.asarray(lengths) - 1).astype(np.int32)
    per_row = np.bincount(row_of_piece, weights=predicted, minlength=n_rows).astype(np.int64)
    if n_rows and per_row.max() > width:
        raise AssertionError(f"a row holds {per_row.max()} predictions, more than its width {width}")
    first_piece_of_row = np.searchsorted(row_of_piece, np.arange(n_rows), "left")
    segment = (np.arange(len(starts)) - first_piece_of_row[row_of_piece] + 1).astype(np.int32)
    piece_first = exclusive_cumsum(predicted)[:-1].astype(index)
    position = np.arange(int(per_row.sum()), dtype=index) - np.repeat(piece_first, predicted)
    source = position + np.repeat(starts, predicted)
    tokens = np.asarray(tokens)  # a plain view of a memmap: cheaper fancy indexing
    inputs = tokens[source]
    # inside a piece the target is the next input; only each piece's last target is read from the stream
    targets = np.empty_like(inputs)
    targets[:-1] = inputs[1:]
    piece_last = exclusive_cumsum(predicted)[1:] - 1
    targets[piece_last[predicted > 0]] = tokens[(starts + predicted)[predicted > 0]]
    fields = {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": np.repeat(segment, predicted),
        "positions": position,
    }
    if len(position) == n_rows * width:  # every row full (the common case): a reshape, no mask
        out = {key: np.asarray(values, np.int32).reshape(n_rows, width) for key, values in fields.items()}
        out["weights"] = np.ones((n_rows, width), np.float32)
        return out
    filled = np.arange(width) < per_row[:, None]
    out = {}
    for key, values in fields.items():
        out[key] = np.zeros((n_rows, width), np.int32)
        out[key][filled] = values
    out["weights"] = filled.astype(np.float32)
    return out


def length_grouped_order(weights: np.ndarray, batch_size: int, mega_batch_mult: int, buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF's LengthGroupedSampler idea on already shuffled rows, with padded widths from a fixed set of buckets.

    Mega-batches of ``mega_batch_mult * batch_size`` rows are each sorted
    longest first and cut into batches; the batch with the longest row moves to
    the front, so an out-of-memory shows at the first step. Returns the row
    order (``-1``: an empty row filling the last batch) and each batch's width,
    the smallest bucket holding its longest row, so jit sees at most
    ``len(buckets)`` shapes.
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


def positions_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token inside its (contiguous) segment, restarting at 0; 0 on padding."""
    segment_ids = np.asarray(segment_ids)
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts_here = np.ones(segment_ids.shape, bool)
    starts_here[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    segment_start = np.maximum.accumulate(np.where(starts_here, index, 0), axis=-1)
    return np.where(segment_ids > 0, index - segment_start, 0).astype(np.int32)


def from_grain_packed(element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Grain's packers name fields ``<key>_segment_ids`` / ``<key>_positions``; give them the contract's names.

    Positions are recomputed from the segment ids so a split continuation
    restarts at 0 as the contract says, whatever the packer did.
    """
    segment_ids = np.asarray(element["inputs_segment_ids"], np.int32)
    return {
        "inputs": np.asarray(element["inputs"], np.int32),
        "targets": np.asarray(element["targets"], np.int32),
        "segment_ids": segment_ids,
        "positions": positions_from_segments(segment_ids),
        "weights": (segment_ids > 0).astype(np.float32),
    }
