"""PEFT LoRA adapters <-> seqjax's (``model.lora``), as pure functions.

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors``, whose tensors are named after the base
model's modules, per layer i and target (q_proj ... down_proj):

=====================================================================  ========  ==========================
PEFT tensor (base_model.model.model.layers.i.)                         shape     seqjax (blocks.i.)
=====================================================================  ========  ==========================
self_attn.q_proj.lora_A.weight                                         [r, in]   attn.lora.q.lora_a [in, r]
self_attn.q_proj.lora_B.weight                                         [out, r]  attn.lora.q.lora_b [r, out]
self_attn.q_proj.lora_magnitude_vector (use_dora)                      [out]     attn.lora.q.magnitude
... k_proj, v_proj, o_proj (self_attn); gate_proj, up_proj, down_proj (mlp)
base_model.model.model.embed_tokens.weight (modules_to_save)           [V, D]    embed.embedding
base_model.model.lm_head.weight (modules_to_save)                      [V, D]    lm_head [D, V]
=====================================================================  ========  ==========================

A VL base (``model.vision``: Qwen3-VL, Qwen2.5-VL) has its text model under
``model.language_model`` (so ``base_model.model.model.language_model.layers.i.``); its tower holds
no adapters: target_modules is written as a pattern of the language model's layers, and one that
selects a module of the tower is refused.

``in`` and ``out`` are the HF projection's features: q's out is heads x head_dim, in the order
seqjax's [D, H, Dh] flattens to. A projection computes what :mod:`seqjax.model.lora` says, with
PEFT's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` under ``use_rslora``) and DoRA under
``use_dora``.

Reading an ``adapter_config.json`` (:func:`lora_from_adapter_config`) goes field by field: the
fields seqjax computes (``r``, ``lora_alpha``, ``target_modules`` as PEFT matches it: names, full
module paths, ``all-linear`` or a regular expression; ``exclude_modules``, ``use_rslora``,
``use_dora``, ``modules_to_save``, ``ensure_weight_tying``), bookkeeping it ignores, and every
other field, which must be unset: an adapter of any other PEFT variant (aLoRA, ``rank_pattern``,
``layers_to_transform``, LoRA on the embeddings, ...) is refused naming its field, never read as
plain LoRA.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from seqjax.config.model import PEFT_SAVED, LoraConfig, ModelConfig
from seqjax.core.errors import CheckpointError
from seqjax.hf.vision import PREFIX, tower_tensors
from seqjax.model.assembly import ADAPTED, holds, layer_targets
from seqjax.model.deltanet import DELTANET_TARGETS
from seqjax.model.stacking import blocks_layout

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# seqjax target -> (HF module, seqjax module holding the adapter, the base weight it adapts)
HF_MODULES = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
    # Qwen3.5's Gated DeltaNet layers
    **{name: f"linear_attn.{name}" for name in DELTANET_TARGETS}
}
MODULES = {target: (HF_MODULES[target], *ADAPTED[target]) for target in HF_MODULES}
# a mixture of experts' experts: seqjax target -> PEFT's target_parameters entry (a fused [E, ...]
# tensor of the layer's mlp.experts module)
EXPERT_PARAMETERS = {"experts_gate_up": "mlp.experts.gate_up_proj", "experts_down": "mlp.experts.down_proj"}
DENSE_TARGETS = tuple(HF_MODULES)
TARGET_OF = {hf.rsplit(".", 1)[1]: target for target, (hf, _, _) in MODULES.items()}
# adapter_config.json fields that say nothing about what the adapter computes.
BOOKKEEPING = ("task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
               "inference_mode", "megatron_core", "runtime_config", "qalora_group_size",
               "layers_pattern", "lora_dropout")
# Fields with one value seqjax computes.
_MUST_BE = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False}
# init_lora_weights values that start from the base as saved (the others rewrite the base weights).
_PLAIN_INITS = (True, False, "gaussian")
_READ = ("r", "lora_alpha", "target_modules", "exclude_modules", "use_rslora", "use_dora",
         "modules_to_save", "ensure_weight_tying", "init_lora_weights", "target_parameters")


def text_root(cfg: ModelConfig) -> str:
    """The HF module path of the text model's layers and embeddings: ``model``, or Qwen3-VL's
    ``model.language_model`` (its tower, ``model.visual``, holds no adapters)."""
    return "model.language_model" if cfg.vision.depth else "model"


def _name(layer: int, target: str, which: str, cfg: ModelConfig) -> str:
    suffix = "lora_magnitude_vector" if which == "m" else f"lora_{which}.weight"
    if target in EXPERT_PARAMETERS:
        # PEFT wraps each targeted parameter of one module around the last, in the module's own
        # order (its gate_up_proj, then its down_proj): the first is innermost
        order = [t for t in EXPERT_PARAMETERS if t in cfg.lora.targets]
        module = EXPERT_PARAMETERS[target].rsplit(".", 1)[0]
        return (f"base_model.model.{text_root(cfg)}.layers.{layer}.{module}."
                f"{'base_layer.' * (len(order) - 1 - order.index(target))}{suffix}")
    return f"base_model.model.{text_root(cfg)}.layers.{layer}.{MODULES[target][0]}.{suffix}"


def saved_name(module: str, cfg: ModelConfig) -> str:
    """A modules_to_save module's tensor in an adapter file (embed, head)."""
    if module == "head":
        return "base_model.model.lm_head.weight"
    return f"base_model.model.{text_root(cfg)}.embed_tokens.weight"


def target_modules(cfg: ModelConfig) -> str | list[str]:
    """``target_modules`` for ``cfg.lora``'s targets: their module names, or on a VL base a regular
    expression of the language model's layers (Qwen2.5-VL's tower has gate_proj, up_proj and
    down_proj too, which the names would select; LLaMA-Factory writes such a pattern too)."""
    names = sorted(MODULES[t][0].rsplit(".", 1)[1] for t in cfg.lora.targets if t in MODULES)
    if not cfg.vision.depth:
        return names
    return rf"{re.escape(text_root(cfg))}\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(names)})"


def adapter_config(cfg: ModelConfig, base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` PEFT writes for ``cfg.lora``'s adapters."""
    lora, tied = cfg.lora, cfg.tie_embeddings
    saved = [PEFT_NAME[m] for m in lora.modules_to_save]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": target_modules(cfg),
        "target_parameters": [EXPERT_PARAMETERS[t] for t in EXPERT_PARAMETERS if t in lora.targets] or None,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": lora.rslora, "use_dora": lora.dora,
        "modules_to_save": saved or None, "ensure_weight_tying": bool(tied and saved),
        "init_lora_weights": "gaussian" if lora.init == "gaussian" else True,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True
    }


PEFT_NAME = {ours: theirs for theirs, ours in PEFT_SAVED.items()}


def _unset(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


def _names(value: Any, source: str, field: str) -> str | list[str] | None:
    """A target_modules-like field: null, one string (a regex, or all-linear) or a list of names."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise CheckpointError(f"{source}: {field}: got {value!r}, expected a module name, a regular "
                          "expression, all-linear, or a list of module names")


def _matches(pattern: str | list[str], module: str) -> bool:
    """Whether PEFT's target_modules (or exclude_modules) ``pattern`` selects ``module``: a string
    is a regular expression matched against the whole path; a list names modules by their path or
    its last parts."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, module) is not None
    return any(module == name or module.endswith("." + name) for name in pattern)


def _targets(config: dict[str, Any], cfg: ModelConfig, source: str) -> list[str]:
    """The seqjax targets PEFT's target_modules (less exclude_modules) selects on a base of
    ``cfg.n_layers`` layers: a projection in every layer or in none, and no other module."""
    targets = _names(config.get("target_modules"), source, "target_modules")
    excluded = _names(config.get("exclude_modules"), source, "exclude_modules") or []
    if targets is None:
        raise CheckpointError(
            f"{source}: target_modules: got null, expected the modules that hold adapters")
    root = text_root(cfg)
    linear = [f"{root}.layers.{i}.{HF_MODULES[t]}" for i in range(cfg.n_layers) for t in DENSE_TARGETS
              if holds(cfg, i, t)]
    others = ["lm_head", f"{root}.embed_tokens", *tower_modules(cfg)]
    if targets == "all-linear" and cfg.vision.depth:
        raise CheckpointError(f"{source}: target_modules: got all-linear on a vision-language "
                              "base, which selects the vision tower's layers too; seqjax adapts "
                              "the language model's projections only")
    if targets == "all-linear":  # PEFT: every linear layer but the output layer
        chosen = list(linear)
    else:
        chosen = [m for m in linear + others if _matches(targets, m)]
    chosen = [m for m in chosen if not _matches(excluded, m)]
    other = [m for m in chosen if m in others]
    if other:
        raise CheckpointError(f"{source}: target_modules: selects {other[0]}; seqjax puts adapters "
                              "on the language model's projections (q, k, v, o, gate, up, down, "
                              "and a Gated DeltaNet's five) only")
    parameters = _expert_targets(config, cfg, source)
    if not chosen and not parameters:
        raise CheckpointError(f"{source}: target_modules: got {targets!r}, which selects none of "
                              f"the projections {sorted(TARGET_OF)} of a {cfg.n_layers}-layer base")
    found = []
    for target in DENSE_TARGETS:
        holders = [i for i in range(cfg.n_layers) if holds(cfg, i, target)]
        layers = [i for i in holders if f"{root}.layers.{i}.{HF_MODULES[target]}" in chosen]
        if layers and len(layers) < len(holders):
            raise CheckpointError(
                f"{source}: target_modules: selects {HF_MODULES[target]} in layers {layers} of "
                f"{cfg.n_layers}; seqjax puts an adapter on a projection in every layer or in none")
        if layers:
            found.append(target)
    return found + parameters


def _expert_targets(config: dict[str, Any], cfg: ModelConfig, source: str) -> list[str]:
    """PEFT's target_parameters as seqjax's expert targets; a parameter other than an expert
    layer's gate_up_proj or down_proj is one line."""
    listed = config.get("target_parameters") or []
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise CheckpointError(f"{source}: target_parameters: got {listed!r}, expected a list of "
                              "parameter names")
    out = []
    for name in listed:
        target = next((t for t, p in EXPERT_PARAMETERS.items() if name == p or name.endswith("." + p)), None)
        if target is None or not cfg.experts.enabled:
            raise CheckpointError(f"{source}: target_parameters: got {name!r}; seqjax adapts a "
                                  f"mixture of experts' {' and '.join(EXPERT_PARAMETERS.values())} "
                                  "and no other parameter")
        out.append(target)
    # (in the experts modules' own order, gate_up_proj registered before down_proj: peft wraps the
    # parameters of one module in that order, the first innermost, whatever order its config lists
    # them in)
    return [t for t in EXPERT_PARAMETERS if t in out]


def tower_modules(cfg: ModelConfig) -> list[str]:
    """The vision tower's linear layers as transformers 5 names its modules (``model.visual.*``);
    none for a text model."""
    if not cfg.vision.depth:
        return []
    weights = (name for name, _, linear in tower_tensors(cfg.vision) if linear)
    return [PREFIX + name.removesuffix(".weight") for name in weights]


def _saved(config: dict[str, Any], cfg: ModelConfig, source: str) -> list[str]:
    """modules_to_save as seqjax's names (embed, head)."""
    names = config.get("modules_to_save") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(
            f"{source}: modules_to_save: got {names!r}, expected a list of module names")
    saved = []
    for name in names:
        ours = PEFT_SAVED.get(name.rsplit(".", 1)[-1])
        if ours is None:
            raise CheckpointError(f"{source}: modules_to_save: got {name!r}; seqjax trains "
                                  f"{sorted(PEFT_SAVED)} whole, and no other module")
        if ours not in saved:
            saved.append(ours)
    if cfg.tie_embeddings and saved:
        if not config.get("ensure_weight_tying"):
            raise CheckpointError(
                f"{source}: modules_to_save: got {names!r} on a base with tied embeddings and "
                "ensure_weight_tying false, where PEFT trains one of the two alone; seqjax keeps "
                "them tied (ensure_weight_tying: true)")
        saved = ["embed"]
    return saved


def lora_from_adapter_config(config: Any, source: str, cfg: ModelConfig) -> LoraConfig:
    """``model.lora`` of a PEFT ``adapter_config.json`` for a base of ``cfg``'s shape, or a
    CheckpointError naming the field it cannot compute."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: got a JSON {type(config).__name__}, expected an object "
                              "of PEFT's LoraConfig fields")
    for field, value in _MUST_BE.items():
        if field in config and config[field] != value:
            raise CheckpointError(
                f"{source}: {field}: got {config[field]!r}, expected {value!r}; seqjax cannot "
                "compute it"
            )
    if config.get("peft_type") is None:
        raise CheckpointError(f"{source}: peft_type: missing, expected 'LORA'")
    for field, value in config.items():
        if field not in _MUST_BE and field not in BOOKKEEPING and field not in _READ and not _unset(
                value):
            raise CheckpointError(
                f"{source}: {field}: got {value!r}; seqjax computes LoRA, rsLoRA and DoRA adapters "
                f"({', '.join(_READ[:-1])}) and cannot compute an adapter with this setting")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise CheckpointError(
            f"{source}: init_lora_weights: got {init!r}, an initialisation that rewrites the "
            "base's weights; seqjax reads adapters on the base as saved (expected true, false or "
            "'gaussian')")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise CheckpointError(f"{source}: r: got {rank!r}, expected a positive integer rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise CheckpointError(f"{source}: lora_alpha: got {alpha!r}, expected a non-negative "
                              "number")
    flags = {}
    for field in ("use_rslora", "use_dora", "ensure_weight_tying"):
        flags[field] = config.get(field) or False
        if not isinstance(flags[field], bool):
            raise CheckpointError(f"{source}: {field}: got {config[field]!r}, expected true or "
                                  "false")
    dropout = config.get("lora_dropout") or 0.0
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise CheckpointError(f"{source}: lora_dropout: got {dropout!r}, expected a rate in [0, 1)")
    return LoraConfig(rank=rank, alpha=float(alpha), dropout=float(dropout),
                      targets=_targets(config, cfg, source), rslora=flags["use_rslora"],
                      dora=flags["use_dora"], modules_to_save=_saved(config, cfg, source),
                      init="gaussian" if init == "gaussian" else "peft")


def to_peft(trained: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """What a ``model.lora`` run trains (the pure dict of its adapters and ``modules_to_save``) ->
    PEFT tensors by name."""
    trained = blocks_layout(trained, stacked=False)
    blocks = trained["blocks"]
    out = {}
    for i in range(cfg.n_layers):
        for target in layer_targets(cfg, i):
            if target in EXPERT_PARAMETERS:
                adapter = blocks[i]["mlp"]["experts"]["lora"]
                a, b = _expert_to_peft(np.asarray(adapter[f"{target}_a"]), np.asarray(adapter[f"{target}_b"]),
                                       target, cfg)
                out[_name(i, target, "A", cfg)], out[_name(i, target, "B", cfg)] = a, b
                continue
            module = blocks[i][MODULES[target][1]]["lora"][target]
            out[_name(i, target, "A", cfg)] = np.ascontiguousarray(np.asarray(module["lora_a"]).T)
            out[_name(i, target, "B", cfg)] = np.ascontiguousarray(np.asarray(module["lora_b"]).T)
            if cfg.lora.dora:
                out[_name(i, target, "m", cfg)] = np.asarray(module["magnitude"])
    if "embed" in cfg.lora.modules_to_save:
        out[saved_name("embed", cfg)] = np.asarray(trained["embed"]["embedding"])
        if cfg.tie_embeddings:  # PEFT's ensure_weight_tying writes the tied head too
            out[saved_name("head", cfg)] = out[saved_name("embed", cfg)]
    if "head" in cfg.lora.modules_to_save:
        out[saved_name("head", cfg)] = np.ascontiguousarray(np.asarray(trained["lm_head"]).T)
    return out


def _interleaved(cfg: ModelConfig, target: str) -> bool:
    """gpt-oss keeps gate and up interleaved in its fused gate_up_proj (column 2j gate j, 2j + 1
    up j)."""
    return target == "experts_gate_up" and cfg.experts.activation == "clamped_swiglu"


def _expert_to_peft(a: np.ndarray, b: np.ndarray, target: str, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """seqjax's stacked factors (a [E, in, r], b [E, r, out], gate's columns then up's) -> PEFT's
    lora_A [E r, in] (rows expert by expert) and lora_B [out, r E] (column i E + e: expert e's
    rank i), as its ParamWrapper reshapes them."""
    e, _, r = a.shape
    if _interleaved(cfg, target):
        f = b.shape[-1] // 2
        b = np.stack([b[..., :f], b[..., f:]], axis=-1).reshape(e, r, 2 * f)
    lora_a = np.transpose(a, (0, 2, 1)).reshape(e * r, -1)
    lora_b = np.transpose(b, (2, 1, 0)).reshape(b.shape[-1], r * e)
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def _expert_from_peft(lora_a: np.ndarray, lora_b: np.ndarray, target: str, cfg: ModelConfig):
    """PEFT's lora_A, lora_B of a fused expert tensor -> seqjax's stacked (a, b)
    (:func:`_expert_to_peft`)."""
    e, r = cfg.experts.count, cfg.lora.rank
    a = np.transpose(lora_a.reshape(e, r, -1), (0, 2, 1))
    b = np.transpose(lora_b.reshape(lora_b.shape[0], r, e), (2, 1, 0))
    if _interleaved(cfg, target):
        b = np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1)
    return a.astype(np.float32), b.astype(np.float32)


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each tensor an adapter of ``cfg.lora`` on a base of ``cfg`` holds, and its shape."""
    lora, shapes = cfg.lora, {}
    net = cfg.deltanet
    qkv, value = net.qkv_width, net.value_width
    widths = {
        # (Qwen3.5's q: [query | gate])
        "q": (cfg.d_model, cfg.n_heads * cfg.head_dim * (1 + cfg.attention_gate)),
        "in_proj_qkv": (cfg.d_model, qkv), "in_proj_z": (cfg.d_model, value),
        "in_proj_b": (cfg.d_model, net.value_heads), "in_proj_a": (cfg.d_model, net.value_heads),
        "out_proj": (value, cfg.d_model),
        "k": (cfg.d_model, cfg.kv_heads * cfg.head_dim),
        "v": (cfg.d_model, cfg.kv_heads * cfg.head_dim),
        "o": (cfg.n_heads * cfg.head_dim, cfg.d_model), "gate": (cfg.d_model, cfg.d_ff),
        "up": (cfg.d_model, cfg.d_ff), "down": (cfg.d_ff, cfg.d_model)
    }
    f = cfg.experts.d_ff or cfg.d_ff
    widths |= {"experts_gate_up": (cfg.d_model, 2 * f), "experts_down": (f, cfg.d_model)}
    for i in range(cfg.n_layers):
        for target in layer_targets(cfg, i):
            n_in, n_out = widths[target]
            if target in EXPERT_PARAMETERS:
                n = lora.rank * cfg.experts.count
                shapes[_name(i, target, "A", cfg)], shapes[_name(i, target, "B", cfg)] = (n, n_in), (n_out, n)
                continue
            shapes[_name(i, target, "A", cfg)] = (lora.rank, n_in)
            shapes[_name(i, target, "B", cfg)] = (n_out, lora.rank)
            if lora.dora:
                shapes[_name(i, target, "m", cfg)] = (n_out, )
    for module in lora.modules_to_save:
        shapes[saved_name(module, cfg)] = (cfg.vocab_size, cfg.d_model)
    return shapes


def from_peft(tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """PEFT tensors -> what a ``model.lora`` run trains (unrolled layout); a missing, extra or
    misshapen tensor is refused in one line."""
    expected = _expected(cfg)
    if cfg.tie_embeddings and "embed" in cfg.lora.modules_to_save:
        tensors = {k: v for k, v in tensors.items() if k != saved_name("head", cfg)}  # the tied copy
    extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if extra or missing:
        what = f"tensor {missing[0]} is missing" if missing else f"holds {extra[0]}, which this model has no place for"
        raise CheckpointError(f"{source}: {what} (rank {cfg.lora.rank}, targets "
                              f"{cfg.lora.targets}, dora {cfg.lora.dora}, modules_to_save "
                              f"{cfg.lora.modules_to_save})")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"{source}: {name} has shape {list(tensors[name].shape)}, expected {list(shape)} "
                f"for a base of d_model {cfg.d_model}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size} at "
                f"rank {cfg.lora.rank}: an adapter of another base or rank")
    blocks: dict[int, Any] = {}
    for i in range(cfg.n_layers):
        for target in layer_targets(cfg, i):
            if target in EXPERT_PARAMETERS:
                adapter = blocks.setdefault(i, {}).setdefault("mlp", {}).setdefault("experts", {}).setdefault(
                    "lora", {})
                adapter[f"{target}_a"], adapter[f"{target}_b"] = _expert_from_peft(
                    np.asarray(tensors[_name(i, target, "A", cfg)], np.float32),
                    np.asarray(tensors[_name(i, target, "B", cfg)], np.float32), target, cfg)
                continue
            module = blocks.setdefault(i, {}).setdefault(MODULES[target][1], {}).setdefault("lora", {})
            module[target] = {"lora_a": np.asarray(tensors[_name(i, target, "A", cfg)], np.float32).T,
                              "lora_b": np.asarray(tensors[_name(i, target, "B", cfg)], np.float32).T}
            if cfg.lora.dora:
                module[target]["magnitude"] = np.asarray(tensors[_name(i, target, "m", cfg)], np.float32)
    out: dict[str, Any] = {"blocks": blocks}
    if "embed" in cfg.lora.modules_to_save:
        out["embed"] = {"embedding": np.asarray(tensors[saved_name("embed", cfg)], np.float32)}
    if "head" in cfg.lora.modules_to_save:
        out["lm_head"] = np.asarray(tensors[saved_name("head", cfg)], np.float32).T
    return out
