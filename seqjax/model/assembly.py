"""A model as a run computes with it, from its parts: the base weights, stored as
``model.lora.quantize`` says, and ``model.lora``'s adapters on top; and back again, the whole
weights with the adapters folded in.

Training, inference (eval, generate, ``train.init_from`` of a run) and export all go through here,
so a QLoRA base is quantized the same way everywhere and an adapter folds into its weight by one
formula:

    W' = W + (alpha / r) A B     (A [in, r], B [r, out], both flattened to the weight's own layout)

:func:`stored_base` is the frozen base a run keeps; :func:`assemble` puts parts together into a
module; :func:`full_weights` takes a module apart into plain weights (dequantized, adapters folded
in) for ``export --merge`` and for starting a new run from a LoRA run's weights.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from seqjax.config.model import ModelConfig
from seqjax.model import quant
from seqjax.model.lora import BASE_PARAMS
from seqjax.model.stacking import blocks_layout

# Each model.lora target: (the block's module holding it, the base weight it adapts).
ADAPTED = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down")}


def stored_base(base: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The frozen base as a run keeps it: as given, or with its projections quantized (QLoRA), in
    the blocks' layout of ``model.scan_layers``."""
    lora = cfg.lora
    return quant.quantize_base(base, lora.quantize, lora.quant_block, cfg.scan_layers)


def assemble(graphdef: nnx.GraphDef, trained: Any, frozen: Any | None, rest: Any) -> nnx.Module:
    """The module from ``split_params``' parts: what trains (every weight, or the adapters), the
    frozen base under adapters (as :func:`stored_base` keeps it), and the rest of the state."""
    return nnx.merge(graphdef, trained, *([] if frozen is None else [frozen]), rest)


def fold(base: dict[str, Any], adapters: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The base weights with every adapter folded in: W + (alpha / r) A B, in W's own layout
    (unrolled), computed in float64 and stored in W's dtype."""
    base = blocks_layout(base, stacked=False)
    blocks = blocks_layout(adapters, stacked=False)["blocks"]
    out = {**base, "blocks": {}}
    for i in range(cfg.n_layers):
        block = {k: dict(v) if isinstance(v, dict) else v for k, v in base["blocks"][i].items()}
        for target in cfg.lora.targets:
            module, weight = ADAPTED[target]
            lora = blocks[i][module]["lora"][target]
            w = np.asarray(block[module][weight])
            delta = cfg.lora.scale * (
                np.asarray(lora["lora_a"], np.float64) @ np.asarray(lora["lora_b"], np.float64))
            block[module][weight] = (w.astype(np.float64) + delta.reshape(w.shape)).astype(w.dtype)
        out["blocks"][i] = block
    return out


def full_weights(model: nnx.Module, dtype: str | None = None) -> dict[str, Any]:
    """Every base weight of ``model`` as plain arrays (a QLoRA base read back), the adapters folded
    in: the model without ``model.lora``, computing what this one computes. ``dtype``: cast every
    weight to it (None: keep)."""
    cfg = model.cfg
    params = quant.dequantize_base(nnx.to_pure_dict(nnx.state(model, BASE_PARAMS)), cfg.param_dtype)
    if cfg.lora.rank:
        params = fold(params, nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), cfg)
    if dtype is not None:
        params = jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)
    return params
