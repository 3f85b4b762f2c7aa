"""Length-grouped batches (``data.strategy=length_grouped``): rows of similar length together, a few padded widths.

One document per row wastes slots on padding unless rows of similar length
share a batch, and a jitted step recompiles for every new width unless the
widths come from a small fixed set. :func:`length_grouped_order` does both;
:func:`bucket_lengths` is that set.
"""

from __future__ import annotations

import numpy as np

from seqjax.config import Config


def bucket_lengths(config: Config) -> np.ndarray:
    """length_grouped widths: ``data.bucket_lengths`` or powers of two, always with ``seq_len`` as the last.

    ``data.seq_len=100`` and no buckets give ``[2, 4, 8, 16, 32, 64, 100]``.
    """
    d = config.data
    chosen = d.bucket_lengths or [1 << k for k in range(1, d.seq_len.bit_length()) if 1 << k < d.seq_len]
    return np.unique(np.asarray([*chosen, d.seq_len], np.int64))


def length_grouped_order(
    weights: np.ndarray, batch_size: int, mega_batch_mult: int, buckets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """HF's LengthGroupedSampler idea on already shuffled rows, with padded widths from a fixed set of buckets.

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
