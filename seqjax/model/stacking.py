"""The blocks' parameters in their two layouts, and the one conversion between them.

``model.scan_layers: false`` keeps one subtree per block, ``{"blocks": {0: {...}, 1: {...}}}``
(``nnx.to_pure_dict`` keys layers by index); ``true`` keeps one subtree whose
arrays carry a leading layer axis, ``{"blocks": {"attn": {"wq": [L, D, H, Dh]}, ...}}``,
which :class:`seqjax.model.transformer.TransformerLM` runs under ``jax.lax.scan``.

Checkpoints are saved in the layout their run trained with; everything that
reads parameters from elsewhere (an HF folder, another run, a checkpoint saved
the other way) passes them through :func:`blocks_layout`, so a run saved one
way is evaluated, exported or fine-tuned the other way. HF tensors are always
per layer (:mod:`seqjax.hf.families` converts to and from the unrolled layout).

The leaves may be arrays or ``jax.ShapeDtypeStruct`` s (an abstract restore
target), so a checkpoint can be read in its own layout and converted after.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def saved_stacked(paths) -> bool:
    """Whether a checkpoint's parameter paths (``blocks/0/attn/wq`` or ``blocks/attn/wq``) hold
    stacked blocks."""
    paths = [p for p in paths if p.startswith("blocks/")]
    return bool(paths) and not any(p.split("/")[1].isdigit() for p in paths)


def is_stacked(params: dict[str, Any]) -> bool:
    """Whether ``params["blocks"]`` is one stacked subtree (scanned layers) rather than one subtree
    per layer."""
    blocks = params.get("blocks", {})
    return bool(blocks) and not all(isinstance(k, int) or str(k).isdigit() for k in blocks)


def _stack(leaves: list[Any]) -> Any:
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        sharding = first.sharding if isinstance(first.sharding,
                                                jax.sharding.SingleDeviceSharding) else None
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    return np.stack([np.asarray(x)
                     for x in leaves]) if isinstance(first, np.ndarray) else jax.numpy.stack(leaves)


def _layer(leaf: Any, i: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = leaf.sharding if isinstance(leaf.sharding,
                                               jax.sharding.SingleDeviceSharding) else None
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[i]


def blocks_layout(params: dict[str, Any], stacked: bool) -> dict[str, Any]:
    """``params`` with its blocks in the asked layout (unchanged when they already are).

    ``{"blocks": {0: {"attn": {"wq": A}}, 1: {"attn": {"wq": B}}}}`` stacked is
    ``{"blocks": {"attn": {"wq": stack([A, B])}}}``, and back.
    """
    if "blocks" not in params or is_stacked(params) == stacked:
        return params
    blocks = params["blocks"]
    if stacked:
        layers = [blocks[k] for k in sorted(blocks, key=int)]
        merged = jax.tree.map(lambda *leaves: _stack(list(leaves)), *layers)
        return {**params, "blocks": merged}
    n = jax.tree.leaves(blocks)[0].shape[0]
    return {
        **params, "blocks": {
            i: jax.tree.map(lambda leaf, i=i: _layer(leaf, i), blocks)
            for i in range(n)
        }
    }
