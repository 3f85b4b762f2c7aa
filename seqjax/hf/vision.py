"""Qwen3-VL and Qwen2.5-VL from a Hugging Face ``config.json`` and tensors: the text model as a
Qwen3 or a Qwen2 (the family table's row, its tensors renamed), the vision tower (``model.visual.*``)
as the ``vision`` subtree of a TransformerLM's ``nnx.to_pure_dict`` layout
(:class:`seqjax.model.vision.VisionTower`). :mod:`seqjax.hf.folders` reads such a folder through
here.

Names: transformers 5 calls the text model ``model.language_model.*`` and the tower
``model.visual.*``; the Hub's Qwen2.5-VL checkpoints (and what ``save_pretrained`` writes for them)
keep the older ``model.*`` and ``visual.*``. Both are read.

transformers stores a linear layer as ``weight [out, in]`` (seqjax: ``kernel [in, out]``), a
LayerNorm as ``weight``/``bias`` (seqjax: ``scale``/``bias``), and the patch embedding as a 3-D
convolution whose kernel equals its stride, ``[D, C, t, p, p]``: on one patch flattened in that (C,
t, p, p) order it is a linear layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import numpy as np

from seqjax.config.model import ModelConfig
from seqjax.config.vision import VisionConfig, vision_from_hf
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf.families import model_config_from_hf
from seqjax.hf.tensors import from_hf

PREFIX = "model.visual."
PREFIXES = (PREFIX, "visual.")  # the tower's names, transformers 5's and the older checkpoints'
TEXT_PREFIX = "model.language_model."
# model_type -> (the text model's family, M-RoPE's frequencies interleaved: transformers' rule for each)
FAMILIES = {"qwen3_vl": ("qwen3", True), "qwen2_5_vl": ("qwen2", False)}
ARCHITECTURES = {"Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}


def _linear(read: Callable[[str], np.ndarray], name: str) -> dict[str, np.ndarray]:
    weight = read(f"{name}.weight")
    return {"kernel": np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T), "bias": read(f"{name}.bias")}


def _norm(read: Callable[[str], np.ndarray], name: str, cfg: VisionConfig) -> dict[str, np.ndarray]:
    if cfg.norm == "rms_norm":
        return {"scale": read(f"{name}.weight")}
    return {"scale": read(f"{name}.weight"), "bias": read(f"{name}.bias")}


def _merger(read: Callable[[str], np.ndarray], name: str, cfg: VisionConfig) -> dict[str, Any]:
    if cfg.norm == "rms_norm":  # Qwen2.5-VL's names
        return {"norm": _norm(read, f"{name}.ln_q", cfg), "fc1": _linear(read, f"{name}.mlp.0"),
                "fc2": _linear(read, f"{name}.mlp.2")}
    return {"norm": _norm(read, f"{name}.norm", cfg), "fc1": _linear(read, f"{name}.linear_fc1"),
            "fc2": _linear(read, f"{name}.linear_fc2")}


def _block(get: Callable[[str], np.ndarray], name: str, cfg: VisionConfig) -> dict[str, Any]:
    block = {"norm1": _norm(get, f"{name}.norm1", cfg), "norm2": _norm(get, f"{name}.norm2", cfg),
             "qkv": _linear(get, f"{name}.attn.qkv"), "proj": _linear(get, f"{name}.attn.proj")}
    if cfg.gated_mlp:
        return {**block, **{key: _linear(get, f"{name}.mlp.{key}_proj") for key in ("gate", "up", "down")}}
    return {**block, "fc1": _linear(get, f"{name}.mlp.linear_fc1"), "fc2": _linear(get, f"{name}.mlp.linear_fc2")}


def vision_prefix(names: Iterable[str]) -> str:
    """Where a checkpoint keeps its tower: ``model.visual.`` (transformers 5) or ``visual.``."""
    names = set(names)
    return next((p for p in PREFIXES if f"{p}patch_embed.proj.weight" in names), PREFIX)


def vision_params(read: Callable[[str], np.ndarray], names: set[str], cfg: VisionConfig, prefix: str | None = None,
                  source: str = "the checkpoint") -> dict[str, Any]:
    """The tower's parameters (float32): ``read(name)`` gives a tensor of the checkpoint, ``names``
    are those it holds (the tower under ``prefix``; by default where :func:`vision_prefix` finds
    it); a missing tensor or a wrong shape is one line naming it."""
    prefix = vision_prefix(names) if prefix is None else prefix

    def get(name: str) -> np.ndarray:
        full = prefix + name
        if full not in names:
            raise CheckpointError(f"{source}: tensor {full} is missing; expected the vision tower model.vision "
                                  "describes")
        return np.asarray(read(full), np.float32)

    patch = get("patch_embed.proj.weight")
    if patch.shape != (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size):
        raise CheckpointError(f"{source}: tensor {prefix}patch_embed.proj.weight has shape {patch.shape}, expected "
                              f"{(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size)} "
                              f"+ ({cfg.patch_size},) from vision_config")
    out = {"patch_embed": _linear(get, "patch_embed.proj") if cfg.patch_bias else {
               "kernel": np.ascontiguousarray(patch.reshape(patch.shape[0], -1).T)},
           "blocks": {i: _block(get, f"blocks.{i}", cfg) for i in range(cfg.depth)}, "merger": _merger(get, "merger", cfg),
           "deepstack": {j: _merger(get, f"deepstack_merger_list.{j}", cfg)
                         for j in range(len(cfg.deepstack_visual_indexes))}}
    if cfg.num_position_embeddings:
        out["pos_embed"] = get("pos_embed.weight")
    return out


@dataclasses.dataclass(frozen=True)
class VisionLanguage:
    """A Qwen3-VL or Qwen2.5-VL ``config.json`` as seqjax reads it: the model (a Qwen3 or Qwen2 row
    of the family table with ``model.vision`` and ``model.mrope_section`` set) and the special
    tokens."""

    text: ModelConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def vision_language_config(config: dict[str, Any], source: str = "config.json") -> VisionLanguage:
    """Qwen3-VL's or Qwen2.5-VL's ``config.json`` (a dict): its text_config read as Qwen3's or
    Qwen2's (every field read or refused there), its vision_config by :func:`vision_from_hf`; a
    missing field is one line. M-RoPE's layout follows the model type, as transformers' does (it
    reads no ``mrope_interleaved``)."""
    model_type = vision_language_type(config)
    if model_type is None:
        raise CheckpointError(f"{source}: model_type {config.get('model_type')!r}; expected qwen3_vl or qwen2_5_vl")
    family, interleaved = FAMILIES[model_type]
    text = dict(config.get("text_config") or flat_text(config))
    field = "rope_parameters" if text.get("rope_parameters") is not None else "rope_scaling"
    rope = dict(text.pop(field, None) or {})
    section = rope.pop("mrope_section", None)
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise CheckpointError(f"{source}: text_config.{field}.mrope_section is {section!r}; expected three sizes "
                              "(time, height, width)")
    rope.pop("mrope_interleaved", None)
    if rope.pop("type", None) == "mrope" or rope.get("rope_type") == "mrope":  # (older configs' default)
        rope["rope_type"] = "default"
    text.update(architectures=[f"{family.capitalize()}ForCausalLM"], model_type=family, rope_parameters=rope,
                tie_word_embeddings=config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    model = model_config_from_hf(text, f"{source} text_config")
    try:
        vision = vision_from_hf({"model_type": model_type, **(config.get("vision_config") or {})},
                                f"{source} vision_config")
    except ConfigError as err:  # (a folder's fault, not a run's settings)
        raise CheckpointError(str(err)) from None
    if vision.out_hidden_size != model.d_model:
        raise CheckpointError(f"{source}: vision_config.out_hidden_size {vision.out_hidden_size}; expected the text "
                              f"model's hidden_size {model.d_model}")
    model = dataclasses.replace(model, vision=vision, mrope_section=list(section), mrope_interleaved=interleaved)
    try:
        model.check_vision()
    except ConfigError as err:
        raise CheckpointError(f"{source}: {err}") from None
    tokens = {}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if not isinstance(config.get(key), int):
            raise CheckpointError(f"{source}: {key} is {config.get(key)!r}; expected a token id")
        tokens[key] = config[key]
    return VisionLanguage(model, **tokens)


def flat_text(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a config.json without a text_config (the Hub's Qwen2.5-VL
    checkpoints keep them beside vision_config, and transformers reads them so)."""
    return {k: v for k, v in config.items() if k not in ("vision_config", "architectures", "model_type")
            and not k.endswith("_token_id") or k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def vision_language_type(config: dict[str, Any]) -> str | None:
    """``qwen3_vl`` or ``qwen2_5_vl`` when a ``config.json`` (a dict) is that model's (by its
    model_type or architectures), else None."""
    if config.get("model_type") in FAMILIES:
        return config["model_type"]
    return next((ARCHITECTURES[a] for a in config.get("architectures") or () if a in ARCHITECTURES), None)


def is_vision_language(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (a dict) is Qwen3-VL's or Qwen2.5-VL's."""
    return vision_language_type(config) is not None


def text_name(name: str) -> str:
    """A VL tensor's name as its text model's (``model.language_model.X`` -> ``model.X``); others
    (the older ``model.X``, ``lm_head.weight``) unchanged."""
    return "model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def vision_language_params(read: Callable[[str], np.ndarray], names: Iterable[str], cfg: ModelConfig,
                           source: str, dtype: Any = np.float32) -> dict[str, Any]:
    """A VL checkpoint's tensors as the ``nnx.to_pure_dict`` layout of a TransformerLM with a tower:
    the text model's read as a Qwen3's or Qwen2's (:func:`seqjax.hf.tensors.from_hf`, every tensor
    checked there), ``vision`` the tower's (float32)."""
    names = set(names)
    words = {text_name(n): n for n in names if not n.startswith(PREFIXES)}
    text = from_hf(lambda name: read(words[name]), words, cfg, source, dtype)
    return {**text, "vision": vision_params(read, names, cfg.vision, source=source)}
