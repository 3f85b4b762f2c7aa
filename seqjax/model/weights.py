"""Loaded weights are checked once, where they are read: a NaN or inf in any tensor is refused,
naming it.

Non-finite weights do not fail loudly later: an import exits 0, generation
returns an empty completion, evaluation reports null perplexities, and a
fine-tune stops at step 1 blaming the learning rate. So every reader of
weights (a Hugging Face folder, a seqjax checkpoint) calls :func:`check_finite`
on each tensor as it arrives.
"""

from __future__ import annotations

import numpy as np

from seqjax.core.errors import CheckpointError


def check_finite(array, name: str, where: str) -> None:
    """Raise CheckpointError when ``array`` holds NaN or inf: ``where: tensor NAME holds N
    non-finite values``."""
    values = np.asarray(array)
    if values.dtype.kind in "iub":
        return
    bad = ~np.isfinite(values.astype(np.float32, copy=False))
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(
            f"{where}: tensor {name} holds {int(bad.sum()):,} non-finite value(s) (the first, {values[first]}, at "
            f"index {first}); expected finite weights: the checkpoint is damaged or was saved after a divergence"
        )
