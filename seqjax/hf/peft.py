"""PEFT LoRA adapters <-> seqjax's (``model.lora``), and folding adapters into their base, as pure
functions.

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors``, whose tensors are named after the base
model's modules, per layer i and target (q_proj ... down_proj):

==========================================================================  ==========  ========================
PEFT tensor                                                                 shape       seqjax (blocks.i.)
==========================================================================  ==========  ========================
base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight              [r, in]     attn.lora.q.lora_a [in, r]
base_model.model.model.layers.i.self_attn.q_proj.lora_B.weight              [out, r]    attn.lora.q.lora_b [r, out]
... k_proj, v_proj, o_proj (self_attn); gate_proj, up_proj, down_proj (mlp)
==========================================================================  ==========  ========================

A projection's output is x W + (lora_alpha / r) x A B in both: PEFT's default scaling (no rsLoRA, no
DoRA), which is what seqjax reads and writes; anything else is refused naming the field. ``in`` and
``out`` are the HF projection's features: q's out is heads x head_dim, in the order seqjax's [D, H,
Dh] flattens to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from seqjax.config.model import LORA_TARGETS, LoraConfig, ModelConfig
from seqjax.core.errors import CheckpointError
from seqjax.model.assembly import ADAPTED
from seqjax.model.stacking import blocks_layout

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# seqjax target -> (HF module, seqjax module holding the adapter, the base weight it adapts)
HF_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"
}
MODULES = {target: (HF_MODULES[target], *ADAPTED[target]) for target in HF_MODULES}
TARGET_OF = {hf.rsplit(".", 1)[1]: target for target, (hf, _, _) in MODULES.items()}
# adapter_config.json fields that change what an adapter computes, and the one value seqjax
# computes.
_MUST_BE = {"peft_type": ("LORA",), "use_rslora": (False, None), "use_dora": (False, None),
            "fan_in_fan_out": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
            "layers_to_transform": (None,), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
            "lora_bias": (False, None), "layer_replication": (None,), "target_parameters": (None,)}


def _name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MODULES[target][0]}.lora_{which}.weight"


def adapter_config(lora: LoraConfig, base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT writes for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(MODULES[t][0].rsplit(".", 1)[1]
                                 for t in lora.targets), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True
    }


def lora_from_adapter_config(config: dict[str, Any], source: str) -> LoraConfig:
    """``model.lora`` of a PEFT ``adapter_config.json``, or a CheckpointError naming the field it
    cannot compute."""
    for field, allowed in _MUST_BE.items():
        if config.get(field) not in allowed:
            raise CheckpointError(
                f"{source}: {field}: got {config.get(field)!r}, expected {allowed[0]!r}; seqjax "
                "cannot compute it")
    modules = config.get("target_modules")
    modules = [modules] if isinstance(modules, str) else list(modules or [])
    unknown = [m for m in modules if m not in TARGET_OF]
    if unknown:
        raise CheckpointError(f"{source}: target_modules: got {unknown[0]!r}, expected names from "
                              f"{sorted(TARGET_OF)}")
    return LoraConfig(rank=int(config["r"]), alpha=float(config.get("lora_alpha", 8)),
                      dropout=float(config.get("lora_dropout") or 0.0),
                      targets=[t for t in LORA_TARGETS if MODULES[t][0].rsplit(".", 1)[1] in modules])


def to_peft(adapters: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """seqjax adapter parameters (the pure dict of the model's ``nnx.LoRAParam``) -> PEFT tensors by
    name."""
    blocks = blocks_layout(adapters, stacked=False)["blocks"]
    out = {}
    for i in range(cfg.n_layers):
        for target in cfg.lora.targets:
            module = blocks[i][MODULES[target][1]]["lora"][target]
            out[_name(i, target, "A")] = np.ascontiguousarray(np.asarray(module["lora_a"]).T)
            out[_name(i, target, "B")] = np.ascontiguousarray(np.asarray(module["lora_b"]).T)
    return out


def from_peft(tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """PEFT tensors -> seqjax adapter parameters (unrolled layout); a missing, extra or misshapen
    one is refused."""
    expected = {_name(i, t, w) for i in range(cfg.n_layers) for t in cfg.lora.targets for w in "AB"}
    extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
    if extra or missing:
        what = f"tensor {missing[0]} is missing" if missing else f"holds {extra[0]}, which this model has no place for"
        raise CheckpointError(f"{source}: {what} (rank {cfg.lora.rank}, targets {cfg.lora.targets})")
    blocks: dict[int, Any] = {}
    for i in range(cfg.n_layers):
        for target in cfg.lora.targets:
            a, b = tensors[_name(i, target, "A")], tensors[_name(i, target, "B")]
            if a.shape[0] != cfg.lora.rank or b.shape[1] != cfg.lora.rank:
                raise CheckpointError(
                    f"{source}: {_name(i, target, 'A')} has rank {a.shape[0]}, expected "
                    f"{cfg.lora.rank} (adapter_config.json's r)")
            module = blocks.setdefault(i, {}).setdefault(MODULES[target][1], {}).setdefault("lora", {})
            module[target] = {
                "lora_a": np.asarray(a, np.float32).T, "lora_b": np.asarray(b, np.float32).T
            }
    return {"blocks": blocks}
