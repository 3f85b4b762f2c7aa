"""Row plans: an epoch as integer arrays, so batch ``k`` is random access and statistics need no token read.

Every strategy describes an epoch as a :class:`RowPlan`: for each row, the
*pieces* that fill it, each a contiguous slice of the token stream. A piece of
``m`` tokens is one sequence: it gives ``m - 1`` inputs and targets under its
own segment id, so no target ever crosses a segment boundary (docs/design.md,
contract 1). :func:`seqjax.data.contract.contract_batch` turns the pieces of
any set of rows into the batch arrays.

Why plans and not generators: a plan is a few integer arrays computed once per
epoch from ``(seed, epoch)``, so batch ``k`` is random access (exact resume
from a step number), shards are index arithmetic (process ``p`` reads a
contiguous slice of every global batch), and statistics (padding, coverage)
are computed without reading a token.

A worked example: rows ``[piece 0 | piece 1]`` and ``[piece 2]`` are
``starts=[10, 20, 40]``, ``lengths=[5, 4, 9]``, ``row_ptr=[0, 2, 3]``; with
``seq_len=8`` row 0 holds 4 + 3 = 7 predictions (one slot of padding) and
row 1 holds 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqjax.data.arrays import exclusive_cumsum, ragged_arange


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
