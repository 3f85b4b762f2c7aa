"""Several shards' token arrays read as one stream, without copying them into one array.

Each shard of a token store is a stream of the same form (``EOT doc EOT ...``),
so shard ``k + 1`` begins with the EOT that shard ``k`` ends with; the logical
stream keeps that EOT once (the layout is in :mod:`seqjax.store.reader`).
"""

from __future__ import annotations

import itertools

import numpy as np

from seqjax.core.errors import StoreError


class TokenStream:
    """Shards' token arrays read as one stream, each shard after the first losing the EOT it shares
    with the one before.

    Indexing works like a numpy array's: an int gives a token, a slice a
    numpy array, an integer array a gather. With parts ``[0 5 0]`` and
    ``[0 6 7 0]`` the stream is ``[0 5 0 6 7 0]``: part ``k``'s local index
    ``q`` is logical index ``bases[k] + q``. ``np.asarray(stream)`` copies the
    whole stream into memory; indexing reads only what it touches.
    """

    def __init__(self, parts: list[np.ndarray]):
        if not parts:
            raise StoreError("a token stream needs at least one shard")
        self.parts = parts
        sizes = np.asarray([len(p) for p in parts], np.int64)
        self.bases = np.concatenate([[0], np.cumsum(sizes[:-1] - 1)]).astype(np.int64)
        self.ends = self.bases + sizes  # exclusive
        self._lasts = self.ends - 1  # each shard's last position: the one it shares with the next
        # (a mixture's weights: byte masks beside float32 ones read as float32)
        self.dtype = np.result_type(*parts)
        self._len = int(self.ends[-1])

    def __len__(self) -> int:
        return self._len

    @property
    def shape(self) -> tuple[int]:
        return (self._len,)

    def _part_of(self, index: np.ndarray) -> np.ndarray:
        # A shared position belongs to the earlier shard, whose last entry it is (the later one
        # drops its first): for tokens both are the same EOT, but a weights stream's closing-EOT
        # weight lives only in the earlier one.
        return np.searchsorted(self._lasts, index, "left")

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._len)
            if step != 1:
                return self[np.arange(start, stop, step)]
            if stop <= start:
                return np.zeros(0, self.dtype)
            k = int(self._part_of(np.asarray(start)))
            if stop <= self.ends[k]:  # inside one shard: a view of its memmap
                return self.parts[k][start - self.bases[k] : stop - self.bases[k]]
            pieces = []  # across shards: each shard's stretch, its shared first EOT once
            while start < stop:
                end = min(stop, int(self.ends[k]))
                pieces.append(self.parts[k][start - self.bases[k] : end - self.bases[k]])
                start, k = end, k + 1
            return np.concatenate(pieces)
        index = np.asarray(key)
        if index.ndim == 0:
            i = int(index) + (self._len if int(index) < 0 else 0)
            if not 0 <= i < self._len:
                raise IndexError(
                    f"index {int(index)} is out of bounds for a stream of {self._len} tokens")
            k = int(self._part_of(np.asarray(i)))
            return self.parts[k][i - self.bases[k]]
        return self.take(index)

    def take(self, index: np.ndarray) -> np.ndarray:
        """``stream[index]`` for an integer array: one gather per shard it touches (one in the
        common case)."""
        index = np.asarray(index)
        if index.size == 0:
            return np.zeros(index.shape, self.dtype)
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self._len:
            raise IndexError(
                f"index {lo if lo < 0 else hi} is out of bounds for a stream of {self._len} tokens")
        first, last = (int(k) for k in self._part_of(np.asarray([lo, hi])))
        if first == last or hi < self.ends[first]:
            return self.parts[first][index - self.bases[first]]
        part = self._part_of(index)
        out = np.empty(index.shape, self.dtype)
        for k in range(first, last + 1):
            mask = part == k
            out[mask] = self.parts[k][index[mask] - self.bases[k]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([self.parts[0], *(p[1:] for p in self.parts[1:])])
        return whole if dtype is None else whole.astype(dtype)

    def __iter__(self):
        return itertools.chain(iter(self.parts[0]), *(iter(p[1:]) for p in self.parts[1:]))


def concat_offsets(parts: list[np.ndarray], bases: np.ndarray) -> np.ndarray:
    """Shards' local offsets as offsets into the logical stream: part ``k`` shifted by ``bases[k]``,
    shared ends once.

    Shard ``k``'s first offset (1: its first document starts after its EOT)
    is the same stream position as shard ``k - 1``'s last, so it is dropped.
    """
    pieces = [np.asarray(parts[0], np.int64) + bases[0]]
    pieces += [np.asarray(p[1:], np.int64) + b for p, b in zip(parts[1:], bases[1:])]
    return np.concatenate(pieces)
