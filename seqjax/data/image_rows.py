"""Packing with two budgets: image-and-text examples into batches of ``rows`` rows of ``seq_len`` tokens whose
images together take at most ``patch_budget`` patches, both static shapes for XLA.

An example is ``(tokens, patches)``: its text with one image-pad token per merged patch group, and the patches of
its images. A batch is full when either budget is; the packer fills both:

1. examples by decreasing tokens, then decreasing patches (the large first, as best-fit decreasing);
2. each into the tightest place among the open batches' rows with room for its tokens and patches: the one
   leaving the least of both budgets free, each counted as a fraction of its own (best fit in two dimensions);
3. none fits: a new batch opens. At most ``open_batches`` stay open; the fullest is closed when a new one would
   exceed that (a stream's memory stays bounded).

For example, rows=2, seq_len=10, patch_budget=8 and examples (tokens, patches) (6, 8), (5, 0), (4, 4), (4, 0):
(6, 8) opens batch 0; (5, 0) joins it in row 1; (4, 4) needs 4 patches, batch 0 has none left: batch 1;
(4, 0) fits row 0 of batch 0 (6 + 4 = 10 tokens, no patches). Batch 0 then holds 20 of 20 tokens and 8 of 8
patches.

lmms-engine packs by text length alone, so the patches a batch holds vary and a static budget must be the
largest any batch reaches (scripts/bench_vision.py measures the padding both leave).
"""

from __future__ import annotations

import numpy as np


def pack_two_budgets(tokens: np.ndarray, patches: np.ndarray, rows: int, seq_len: int, patch_budget: int,
                     open_batches: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """``(batch, row)`` of each example (batches numbered in the order they close or end open).

    >>> pack_two_budgets(np.array([6, 5, 4, 4]), np.array([8, 0, 4, 0]), 2, 10, 8)
    (array([0, 0, 1, 0]), array([0, 1, 0, 0]))
    """
    tokens, patches = np.asarray(tokens, np.int64), np.asarray(patches, np.int64)
    over = np.flatnonzero((tokens > seq_len) | (patches > patch_budget))
    if len(over):
        i = int(over[0])
        raise ValueError(f"example {i}: {tokens[i]} tokens and {patches[i]} patches, more than a row's {seq_len} "
                         f"tokens or a batch's {patch_budget} patches")
    order = np.lexsort((-patches, -tokens))
    free_tokens = np.zeros((0, rows), np.int64)  # [open, rows]
    free_patches = np.zeros(0, np.int64)
    ids = np.zeros(0, np.int64)  # each open batch's provisional id
    batch_of, row_of = np.empty(len(tokens), np.int64), np.empty(len(tokens), np.int64)
    opened, closed, final = 0, [], {}
    for i in order:
        t, p = tokens[i], patches[i]
        fits = (free_tokens >= t) & (free_patches >= p)[:, None]
        if fits.any():  # the tightest place: the least left of both budgets, each as a fraction of its own
            key = (free_tokens - t) * patch_budget + (free_patches - p)[:, None] * seq_len
            b, r = np.unravel_index(np.argmin(np.where(fits, key, np.iinfo(np.int64).max)), key.shape)
        else:
            if len(free_patches) >= open_batches:  # close the fullest open batch
                full = int(np.argmin(free_tokens.sum(1) * (patch_budget + 1) + free_patches))
                closed.append(ids[full])
                keep = np.arange(len(ids)) != full
                free_tokens, free_patches, ids = free_tokens[keep], free_patches[keep], ids[keep]
            free_tokens = np.vstack([free_tokens, np.full((1, rows), seq_len)])
            free_patches = np.append(free_patches, patch_budget)
            ids = np.append(ids, opened)
            opened += 1
            b, r = len(ids) - 1, 0
        free_tokens[b, r] -= t
        free_patches[b] -= p
        batch_of[i], row_of[i] = ids[b], r
    for provisional in [*closed, *ids]:  # number the batches in the order they closed, then the open ones
        final[int(provisional)] = len(final)
    return np.asarray([final[int(b)] for b in batch_of]), row_of
