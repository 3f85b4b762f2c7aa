"""A model as a run computes with it, from its parts: the base weights, stored as
``model.lora.quantize`` says, and ``model.lora``'s adapters on top; and back again, the whole
weights with the adapters folded in.

Training, inference (eval, generate, ``train.init_from`` of a run) and export all go through here,
so a QLoRA base is quantized the same way everywhere and an adapter folds into its weight by one
formula:

    W' = W + (alpha / r) A B     (A [in, r], B [r, out], both flattened to the weight's own layout)

:func:`stored_base` is the frozen base a run keeps; :func:`assemble` puts parts together into a
module; :func:`full_weights` takes a module apart into plain weights (dequantized, adapters folded
in) for ``export --merge`` and for starting a new run from a LoRA run's weights. Under DoRA
(``model.lora.dora``) the folded weight is m (W + s A B) / ||W + s A B||, and
:func:`dora_magnitudes` starts m at the base's own norms.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from seqjax.config.model import ModelConfig
from seqjax.model import quant
from seqjax.model.deltanet import DELTANET_TARGETS
from seqjax.model.lora import BASE_PARAMS, column_norms
from seqjax.model.stacking import blocks_layout

# Each model.lora target: (the block's module holding it, the base weight it adapts).
ADAPTED = {"q": ("attn", "wq"), "k": ("attn", "wk"), "v": ("attn", "wv"), "o": ("attn", "wo"),
           "gate": ("mlp", "w_gate"), "up": ("mlp", "w_up"), "down": ("mlp", "w_down"),
           **{name: ("attn", name) for name in DELTANET_TARGETS}}


def module_of(target: str) -> str:
    return "mlp" if target.startswith("experts_") else ADAPTED[target][0]


def holds(cfg: ModelConfig, layer: int, target: str) -> bool:
    """Whether layer ``layer`` has the projection ``target`` adapts: the attention's where it
    attends, a Gated DeltaNet's where it is one, the gated MLP's or the experts' where it has
    them."""
    if target.startswith("experts_"):
        return cfg.mlp_of(layer) == "experts"
    if target in DELTANET_TARGETS:
        return cfg.mixer_of(layer) == "deltanet"
    if ADAPTED[target][0] == "attn":
        return cfg.mixer_of(layer) == "attention"
    return cfg.mlp_of(layer) == "gated"


def layer_targets(cfg: ModelConfig, layer: int) -> list[str]:
    """The model.lora targets layer ``layer`` holds (:func:`holds`)."""
    return [t for t in cfg.lora.targets if holds(cfg, layer, t)]


def fold_experts(experts: dict[str, Any], adapters: dict[str, Any], scale: float) -> dict[str, Any]:
    """A layer's experts (w_gate, w_up [E, D, F], w_down [E, F, D]) with their adapters folded
    in, in float64, stored in each weight's dtype (seqjax.model.lora.ExpertAdapters: gate_up's B
    holds gate's F columns, then up's)."""
    out = dict(experts)

    def delta(target):
        a, b = (np.asarray(adapters[f"{target}_{s}"], np.float64) for s in ("a", "b"))
        return scale * np.einsum("eir,ero->eio", a, b)

    if "experts_gate_up_a" in adapters:
        d, f = delta("experts_gate_up"), np.shape(experts["w_gate"])[-1]
        for name, part in (("w_gate", d[..., :f]), ("w_up", d[..., f:])):
            out[name] = (np.asarray(experts[name], np.float64) + part).astype(np.asarray(experts[name]).dtype)
    if "experts_down_a" in adapters:
        w = np.asarray(experts["w_down"])
        out["w_down"] = (w.astype(np.float64) + delta("experts_down")).astype(w.dtype)
    return out


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
    """The base weights with every adapter folded in: W + s A B (under DoRA scaled to m per output),
    in W's own layout (unrolled), computed in float64 and stored in W's dtype; ``modules_to_save``
    in ``adapters`` (what trains) replace the base's."""
    base = blocks_layout(base, stacked=False)
    blocks = blocks_layout(adapters, stacked=False)["blocks"]
    out = {**base, **{k: v for k, v in adapters.items() if k != "blocks"}, "blocks": {}}
    for i in range(cfg.n_layers):
        block = {k: dict(v) if isinstance(v, dict) else v for k, v in base["blocks"][i].items()}
        if cfg.mlp_of(i) == "experts" and "lora" in blocks[i]["mlp"]["experts"]:
            block["mlp"] = {**block["mlp"], "experts": fold_experts(block["mlp"]["experts"],
                                                                    blocks[i]["mlp"]["experts"]["lora"],
                                                                    cfg.lora.scale)}
        for target in layer_targets(cfg, i):
            if target.startswith("experts_"):
                continue
            module, weight = ADAPTED[target]
            lora = blocks[i][module]["lora"][target]
            w = np.asarray(block[module][weight])
            a, b = np.asarray(lora["lora_a"], np.float64), np.asarray(lora["lora_b"], np.float64)
            merged = w.astype(np.float64).reshape(a.shape[0], b.shape[1]) + cfg.lora.scale * (a @ b)
            if cfg.lora.dora:
                merged *= np.asarray(lora["magnitude"], np.float64) / np.linalg.norm(merged, axis=0)
            block[module][weight] = merged.reshape(w.shape).astype(w.dtype)
        out["blocks"][i] = block
    return out


def dora_magnitudes(trained: dict[str, Any], frozen: dict[str, Any],
                    cfg: ModelConfig) -> dict[str, Any]:
    """``trained`` with each DoRA magnitude set to ||W + s A B|| of the base it sits on (QLoRA's
    read back): what DoRA starts from once its base's weights are read, so g = 1 and a new
    adapter changes nothing (PEFT's initialisation). Unchanged without ``model.lora.dora``."""
    if not cfg.lora.dora:
        return trained

    def norms(w, a, b):
        w = qwix.dequantize(w) if isinstance(w, qwix.QArray) else w
        return column_norms(w, a, b, cfg.lora.scale)

    def set_block(block: dict, base_block: dict, fn) -> dict:
        block = jax.tree.map(lambda x: x, block)  # a new tree: the caller's stays as it was
        for target in cfg.lora.targets:
            if target not in block.get(module_of(target), {}).get("lora", {}):
                continue  # (a layer without it: experts for the gated MLP, a Gated DeltaNet)
            module, weight = ADAPTED[target]
            lora = block[module]["lora"][target]
            m = fn(base_block[module][weight], lora["lora_a"], lora["lora_b"])
            lora["magnitude"] = jnp.asarray(m, jnp.asarray(lora["magnitude"]).dtype)
        return block

    if cfg.scan_layers:  # every layer at once, the layer axis first
        blocks = set_block(trained["blocks"], frozen["blocks"], jax.vmap(norms))
    else:
        blocks = {
            i: set_block(trained["blocks"][i], frozen["blocks"][i], norms)
            for i in trained["blocks"]
        }
    return {**trained, "blocks": blocks}


def full_weights(model: nnx.Module, dtype: str | None = None) -> dict[str, Any]:
    """Every base weight of ``model`` as plain arrays (a QLoRA base read back), the adapters folded
    in and ``modules_to_save`` as trained: the model without ``model.lora``, computing what this one
    computes. ``dtype``: cast every weight to it (None: keep)."""
    cfg = model.cfg
    params = quant.dequantize_base(nnx.to_pure_dict(nnx.state(model, BASE_PARAMS)), cfg.param_dtype)
    if cfg.lora.rank:
        params = fold(params, nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), cfg)
    if dtype is not None:
        params = jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)
    return params
