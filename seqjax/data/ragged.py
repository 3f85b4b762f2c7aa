"""Ragged-array arithmetic without Python loops: where items start, nested aranges, positions in
segments.

They replace the nested Python loops that cutting a stream into rows would
otherwise need; each docstring shows what it computes on a small input.
"""

from __future__ import annotations

import numpy as np


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """``[2, 3, 1]`` -> ``[0, 2, 5, 6]``: where each item starts, plus the total (int64, one longer
    than ``x``)."""
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


def ragged_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The vectorized nested loop: counts ``[2, 3]`` give owners ``[0, 0, 1, 1, 1]`` and offsets
    ``[0, 1, 0, 1, 2]``."""
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(len(owner), dtype=np.int64) - np.repeat(exclusive_cumsum(counts)[:-1], counts)
    return owner, offset


def starts_in_groups(sizes: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """Where each item starts inside its group, items already in group order: sizes ``[2, 3, 4]`` in
    groups ``[0, 0, 1]`` start at ``[0, 2, 0]`` (a piece's first slot in its row, say)."""
    sizes = np.asarray(sizes, np.int64)
    per_group = np.bincount(group, sizes, n_groups).astype(np.int64)
    return exclusive_cumsum(sizes)[:-1] - exclusive_cumsum(per_group)[group]


def positions_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token inside its (contiguous) segment, restarting at 0; 0 on padding.

    ``[[1, 1, 1, 2, 2, 0]]`` -> ``[[0, 1, 2, 0, 1, 0]]``.
    """
    segment_ids = np.asarray(segment_ids)
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts_here = np.ones(segment_ids.shape, bool)
    starts_here[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    segment_start = np.maximum.accumulate(np.where(starts_here, index, 0), axis=-1)
    return np.where(segment_ids > 0, index - segment_start, 0).astype(np.int32)
