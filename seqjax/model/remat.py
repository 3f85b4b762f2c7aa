"""``model.remat``: which activations of a block the backward pass keeps; the rest it recomputes.

Each block is one rematerialized unit (``nnx.remat`` around its call). The
policies: ``full`` keeps only the block's input, ``dots`` every matmul's
output, ``names`` the activations the block tags with ``checkpoint_name``
that ``model.remat_names`` lists (q, k, v, attn_out, mlp_in, mlp_out).
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


def _call_block(block, x, positions, segment_ids, rope_freq, window, metadata, key, prefix_ids=None):
    return block(x, positions, segment_ids, rope_freq, window, metadata=metadata, dropout_key=key,
                 prefix_ids=prefix_ids)


def remat_policy(remat: str, names: tuple[str, ...]):
    """model.remat as a jax.checkpoint policy: what the backward pass keeps (the rest is
    recomputed)."""
    if remat == "full":
        return None  # jax.checkpoint's default: keep nothing but the block's inputs
    if remat == "dots":
        return jax.checkpoint_policies.dots_saveable
    return jax.checkpoint_policies.save_only_these_names(*names)


@functools.lru_cache(maxsize=None)
def remat_block(remat: str, names: tuple[str, ...]):
    """``(block, x, positions, segment_ids, rope_freq, window, metadata, key, prefix_ids) -> x`` for one block,
    rematerialized as model.remat says."""
    if remat == "none":
        return _call_block
    return nnx.remat(_call_block, policy=remat_policy(remat, names), prevent_cse=True)
