"""Which targets the loss counts, and how much: the contract's ``weights`` for instruction data.

A store of instruction examples holds a mask beside its tokens (``mask[p] = 1``
when predicting ``tokens[p]`` is scored: an answer's token; under
``data.loss_weights_dtype=float32`` any weight >= 0, the records' own). The batch builder
asks a :class:`TargetWeights` for the weight of every target it places, so each
strategy, packer and evaluation window gets the same weights without knowing
about examples.

``train.loss_normalization`` decides the weight of a scored token (docs/design.md, contract 3):

- ``tokens``: 1. Every scored token of the global batch weighs the same (the loss
  is their mean), as for text.
- ``examples``: ``1 / n``, where ``n`` is the number of scored tokens of the
  whole example the token belongs to (with fractional weights, ``w / n`` where
  ``n`` is the sum of the example's weights). Contract 3's formula
  ``sum(w * nll) / sum(w)`` is then the mean, over the examples in the global
  batch, of each example's mean loss: what an unpacked per-example mean gives,
  however the examples are packed, accumulated or spread over processes. An
  example split across rows keeps ``1 / n`` on each piece, so its pieces add up
  to one example wherever they land (pieces in two batches count a fraction in each).

For example, two examples with 2 and 4 scored tokens give weights
``[1/2, 1/2]`` and ``[1/4, 1/4, 1/4, 1/4]``: ``sum(w) = 2`` examples.
"""

from __future__ import annotations

import functools

import numpy as np

NORMALIZATIONS = ("tokens", "examples")


class TargetWeights:
    """``weights[p]``: the loss weight of predicting ``tokens[p]``, for an integer array of stream
    positions ``p``."""

    def __init__(self, mask, doc_offsets, normalization: str = "tokens"):
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"train.loss_normalization: got {normalization!r}, expected one of "
                             f"{', '.join(NORMALIZATIONS)}")
        self.mask = mask
        self.doc_offsets = doc_offsets
        self.normalization = normalization

    @functools.cached_property
    def _offsets(self) -> np.ndarray:
        return np.asarray(self.doc_offsets, np.int64)

    @functools.cached_property
    def weight_per_doc(self) -> np.ndarray:
        """The summed weights of each document's targets (its tokens and its closing EOT: with 0/1
        weights, how many are scored); read once, on first use. float64: exact for any count a store
        holds."""
        d = self._offsets
        mask = np.asarray(self.mask)
        return np.add.reduceat(mask[d[0]:].astype(np.float64), d[:-1] -
                               d[0]) if len(d) > 1 else np.zeros(0)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions)
        weights = np.asarray(self.mask[positions], np.float32)
        if self.normalization == "examples" and positions.size:
            doc = np.searchsorted(self._offsets, positions, "right") - 1
            # (the stream's first token belongs to no document)
            doc = np.clip(doc, 0, len(self._offsets) - 2)
            total = self.weight_per_doc[doc]
            weights = (weights / np.where(total > 0, total, 1)).astype(np.float32)
        return weights


def target_weights(store, normalization: str = "tokens") -> TargetWeights | None:
    """The weights of ``store``'s targets, or None when every target weighs 1 (a text store, token
    normalization).

    A text store under ``examples`` weighs each document's tokens ``1 / its length``.
    """
    mask = store.mask
    if mask is None:
        if normalization == "tokens":
            return None
        mask = np.ones(len(store.tokens), np.uint8)
        mask[0] = 0
    return TargetWeights(mask, store.doc_offsets, normalization)


def has_scored_target(mask, starts: np.ndarray, predictions: np.ndarray) -> np.ndarray:
    """For each sequence starting at stream position ``starts[i]`` and predicting the next
    ``predictions[i]`` tokens, whether any of those targets is scored (``mask`` > 0). Meant for the
    few sequences an overlong policy cut: each is read on its own."""
    return np.asarray([bool(np.any(np.asarray(mask[s + 1 : s + 1 + n]))) for s, n in zip(starts.tolist(),
                                                                                    predictions.tolist())], bool)


def scored_in(store):
    """``has_target(starts, predictions)`` over ``store``'s mask (instruction data), else None."""
    if store.mask is None:
        return None
    return lambda starts, predictions: has_scored_target(store.mask, starts, predictions)
