"""Cutting the token stream into rows: windows, random offsets, sequential streams,
concatenate-and-chunk, blocks.

Each function returns the spans of one epoch as ``(starts, lengths)``: span
``r`` is the sequence ``tokens[starts[r] : starts[r] + lengths[r]]``, which
gives ``lengths[r] - 1`` inputs and targets (so a full row of ``seq_len``
inputs reads ``seq_len + 1`` tokens). All of it is index arithmetic on the
store's offsets: vectorized numpy, no token is read here.

Stream positions: the store's stream is ``EOT d0 EOT d1 ... EOT``; position
``p`` is predicted (is a target) by a span that holds both ``p - 1`` and ``p``.
"""

from __future__ import annotations

import bisect

import numpy as np

from seqjax.core.errors import DataError
from seqjax.data.ragged import ragged_arange

# HF run_clm applies group_texts through datasets.map(batched=True), whose
# default batch holds 1000 examples: each batch's remainder is dropped on its own.
HF_MAP_BATCH = 1000


def chunk_spans(n_tokens: int, seq_len: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping chunks of ``seq_len`` predictions starting at ``offset``; the last may be
    shorter.

    Chunk ``j`` reads ``tokens[offset + j*seq_len : offset + (j+1)*seq_len + 1]``:
    consecutive chunks share one token, so every position after ``offset`` is
    predicted exactly once (d2l's random partitioning, without dropping the tail).
    """
    starts = np.arange(offset, n_tokens - 1, seq_len, dtype=np.int64)
    return starts, np.minimum(seq_len + 1, n_tokens - starts)


def random_window_spans(
    n_tokens: int, seq_len: int, batch_size: int, seed: int, steps: range
) -> tuple[np.ndarray, np.ndarray]:
    """The CS336 loader: each step draws ``batch_size`` window starts uniformly (with replacement)
    from its seed."""
    starts = np.concatenate([
        np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len, size=batch_size)
        for step in steps
    ]).astype(np.int64)
    return starts, np.full(len(starts), seq_len + 1, np.int64)


def _line_units(line_offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Boundaries of lines, with lines longer than ``seq_len`` tokens cut into ``seq_len``-token
    units."""
    lengths = np.diff(line_offsets)
    owner, j = ragged_arange(-(-lengths // seq_len))
    return np.append(line_offsets[:-1][owner] + j * seq_len, line_offsets[-1])


def block_spans(
    line_offsets: np.ndarray, doc_offsets: np.ndarray, n_tokens: int, seq_len: int, break_mode: str
) -> tuple[np.ndarray, np.ndarray]:
    """fairseq TokenBlockDataset's break modes, with blocks of at most ``seq_len`` predicted tokens.

    - ``none``: the stream cut every ``seq_len`` tokens (the last block may be short);
    - ``complete``: as many whole lines as fit, crossing documents;
    - ``complete_doc``: as many whole lines as fit, never crossing a document;
    - ``eos``: one line per block.

    A block of lines ``[a, b)`` predicts exactly their tokens and reads the one
    token before them as context (the EOT, at a document's start). fairseq lets
    a line longer than the block size overflow its block; rows here have a fixed
    width, so such a line is cut into ``seq_len``-token pieces instead.
    """
    if break_mode == "none":
        return chunk_spans(n_tokens, seq_len)
    bounds = _line_units(line_offsets, seq_len)
    if break_mode == "eos":
        cut = np.arange(len(bounds))
    else:
        barriers = doc_offsets if break_mode == "complete_doc" else doc_offsets[-1:]
        cut = _next_fit(bounds, seq_len, np.searchsorted(bounds, barriers))
    first, last = bounds[cut[:-1]], bounds[cut[1:]]
    return first - 1, last - first + 1


def _next_fit(bounds: np.ndarray, capacity: int, barrier_index: np.ndarray) -> np.ndarray:
    """Indices into ``bounds`` where next-fit blocks of at most ``capacity`` tokens end; never past
    a barrier.

    One binary search per block (not per line): O(blocks * log n), with Python's
    bisect on lists since numpy's per-call overhead dominates scalar searches.
    """
    positions, barriers = bounds.tolist(), np.asarray(barrier_index).tolist()
    cut = [0]
    while cut[-1] < len(positions) - 1:
        i = cut[-1]
        fit = bisect.bisect_right(positions, positions[i] + capacity) - 1
        barrier = barriers[bisect.bisect_right(barriers, i)]
        cut.append(min(fit, barrier))
    return np.asarray(cut, np.int64)


def check_fits(n_tokens: int, seq_len: int, strategy: str) -> None:
    if n_tokens < seq_len + 1:
        raise DataError(
            f"data.strategy={strategy}: the token store holds {n_tokens} tokens, fewer than one row needs "
            f"(data.seq_len + 1 = {seq_len + 1}); use a smaller data.seq_len or more data")
