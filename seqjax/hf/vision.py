"""Qwen3-VL and Qwen2.5-VL from a Hugging Face ``config.json`` and tensors: the text model as a
Qwen3 or a Qwen2 (the family table's row, its tensors renamed), the vision tower
(``model.visual.*``) as the ``vision`` subtree of a TransformerLM's ``nnx.to_pure_dict`` layout
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
from seqjax.config.vision import OWN, VisionConfig, vision_from_hf
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf.families import model_config_from_hf
from seqjax.hf.tensors import from_hf, tree_get, tree_put

PREFIX = "model.visual."
PREFIXES = (PREFIX, "visual.")  # the tower's names, transformers 5's and the older checkpoints'
TEXT_PREFIX = "model.language_model."
# model_type -> (the text model's family, M-RoPE's frequencies interleaved: transformers' rule for
# each)
FAMILIES = {"qwen3_vl": ("qwen3", True), "qwen2_5_vl": ("qwen2", False)}
ARCHITECTURES = {
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"
}
# where save_pretrained puts each model's text model and tower (Qwen2.5-VL keeps the Hub's older
# names)
LAYOUT = {"qwen3_vl": (TEXT_PREFIX, PREFIX), "qwen2_5_vl": ("model.", "visual.")}
# the special tokens of a VL config.json, by the names Qwen-VL's tokenizers give them (the image's
# is data.image_token)
TOKENS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
          "video_token_id": "<|video_pad|>"}
VISION_FIELDS = ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads",
                 "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size",
                 "out_hidden_size")


Entry = tuple[str, tuple, bool]  # (HF name, path in the parameters, a linear layer's weight)


def _linear(name: str, path: tuple, bias: bool = True) -> list[Entry]:
    weight = [(f"{name}.weight", (*path, "kernel"), True)]
    return weight + [(f"{name}.bias", (*path, "bias"), False)] if bias else weight


def _norm(name: str, path: tuple, cfg: VisionConfig) -> list[Entry]:
    scale = [(f"{name}.weight", (*path, "scale"), False)]
    return scale + [(f"{name}.bias", (*path, "bias"), False)] if cfg.norm == "layer_norm" else scale


def _merger(name: str, path: tuple, cfg: VisionConfig) -> list[Entry]:
    norm, fc1, fc2 = (("ln_q", "mlp.0", "mlp.2") if cfg.norm == "rms_norm"  # Qwen2.5-VL's names
                      else ("norm", "linear_fc1", "linear_fc2"))
    return (_norm(f"{name}.{norm}", (*path, "norm"), cfg) + _linear(f"{name}.{fc1}", (*path, "fc1"))
            + _linear(f"{name}.{fc2}", (*path, "fc2")))


def _block(i: int, cfg: VisionConfig) -> list[Entry]:
    name, path = f"blocks.{i}", ("blocks", i)
    out = [t for norm in ("norm1", "norm2") for t in _norm(f"{name}.{norm}", (*path, norm), cfg)]
    for key in ("qkv", "proj"):
        out += _linear(f"{name}.attn.{key}", (*path, key))
    mlp = ({k: f"{k}_proj" for k in ("gate", "up", "down")} if cfg.gated_mlp
           else {"fc1": "linear_fc1", "fc2": "linear_fc2"})
    for key, hf_name in mlp.items():
        out += _linear(f"{name}.mlp.{hf_name}", (*path, key))
    return out


def tower_tensors(cfg: VisionConfig) -> list[Entry]:
    """The tower's tensors, one entry each: (its Hugging Face name under the tower's prefix, its
    path in seqjax's parameters, whether it is a linear layer's weight, ``[out, in...]`` there and
    ``kernel [in, out]`` here). Both directions read this one table."""
    out = _linear("patch_embed.proj", ("patch_embed",), bias=cfg.patch_bias)
    if cfg.num_position_embeddings:
        out.append(("pos_embed.weight", ("pos_embed",), False))
    for i in range(cfg.depth):
        out += _block(i, cfg)
    out += _merger("merger", ("merger",), cfg)
    for j in range(len(cfg.deepstack_visual_indexes)):
        out += _merger(f"deepstack_merger_list.{j}", ("deepstack", j), cfg)
    return out


def vision_prefix(names: Iterable[str]) -> str:
    """Where a checkpoint keeps its tower: ``model.visual.`` (transformers 5) or ``visual.``."""
    names = set(names)
    return next((p for p in PREFIXES if f"{p}patch_embed.proj.weight" in names), PREFIX)


def _patch_shape(cfg: VisionConfig) -> tuple[int, ...]:
    """The patch embedding's 3-D convolution kernel: [D, C, t, p, p]."""
    return cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size


def vision_params(read: Callable[[str], np.ndarray], names: set[str], cfg: VisionConfig,
                  prefix: str | None = None, source: str = "the checkpoint") -> dict[str, Any]:
    """The tower's parameters (float32): ``read(name)`` gives a tensor of the checkpoint, ``names``
    are those it holds (the tower under ``prefix``; by default where :func:`vision_prefix` finds
    it); a missing tensor or a wrong shape is one line naming it."""
    prefix = vision_prefix(names) if prefix is None else prefix
    params: dict[str, Any] = {}
    for name, path, linear in tower_tensors(cfg):
        full = prefix + name
        if full not in names:
            raise CheckpointError(f"{source}: tensor {full} is missing; expected the vision tower "
                                  "model.vision describes")
        tensor = np.asarray(read(full), np.float32)
        if name == "patch_embed.proj.weight" and tensor.shape != _patch_shape(cfg):
            raise CheckpointError(f"{source}: tensor {full} has shape {tensor.shape}, expected "
                                  f"{_patch_shape(cfg)} from vision_config")
        if linear:
            tensor = np.ascontiguousarray(tensor.reshape(tensor.shape[0], -1).T)
        tree_put(params, path, tensor)
    return params


def vision_to_hf(params: dict[str, Any], cfg: VisionConfig,
                 prefix: str = PREFIX) -> dict[str, np.ndarray]:
    """The tower's parameters as Hugging Face tensors by name (:func:`vision_params` reversed)."""
    out = {}
    for name, path, linear in tower_tensors(cfg):
        tensor = np.asarray(tree_get(params, path))
        if linear:
            shape = _patch_shape(cfg) if name.startswith("patch_embed") else tensor.T.shape
            tensor = tensor.T.reshape(shape)
        out[prefix + name] = np.ascontiguousarray(tensor)
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
        raise CheckpointError(
            f"{source}: model_type {config.get('model_type')!r}; expected qwen3_vl or qwen2_5_vl")
    family, interleaved = FAMILIES[model_type]
    text = dict(config.get("text_config") or flat_text(config))
    field = "rope_parameters" if text.get("rope_parameters") is not None else "rope_scaling"
    rope = dict(text.pop(field, None) or {})
    section = rope.pop("mrope_section", None)
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise CheckpointError(
            f"{source}: text_config.{field}.mrope_section is {section!r}; expected three sizes "
            "(time, height, width)")
    rope.pop("mrope_interleaved", None)
    # (older configs' default)
    if rope.pop("type", None) == "mrope" or rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text.update(architectures=[f"{family.capitalize()}ForCausalLM"], model_type=family,
                rope_parameters=rope, tie_word_embeddings=tied)
    model = model_config_from_hf(text, f"{source} text_config")
    try:
        vision = vision_from_hf({"model_type": model_type, **(config.get("vision_config") or {})},
                                f"{source} vision_config")
    except ConfigError as err:  # (a folder's fault, not a run's settings)
        raise CheckpointError(str(err)) from None
    if vision.out_hidden_size != model.d_model:
        raise CheckpointError(
            f"{source}: vision_config.out_hidden_size {vision.out_hidden_size}; expected the text "
            f"model's hidden_size {model.d_model}")
    model = dataclasses.replace(model, vision=vision, mrope_section=list(section),
                                mrope_interleaved=interleaved)
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
    kept = ("bos_token_id", "eos_token_id", "pad_token_id")  # (other *_token_id: the VL model's)
    dropped = ("vision_config", "architectures", "model_type")
    return {k: v for k, v in config.items()
            if k in kept or (k not in dropped and not k.endswith("_token_id"))}


def vision_language_type(config: dict[str, Any]) -> str | None:
    """``qwen3_vl`` or ``qwen2_5_vl`` when a ``config.json`` (a dict) is that model's (by its
    model_type or architectures), else None."""
    if config.get("model_type") in FAMILIES:
        return config["model_type"]
    return next((ARCHITECTURES[a] for a in config.get("architectures") or () if a in ARCHITECTURES),
                None)


def is_vision_language(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (a dict) is Qwen3-VL's or Qwen2.5-VL's."""
    return vision_language_type(config) is not None


def text_name(name: str) -> str:
    """A VL tensor's name as its text model's (``model.language_model.X`` -> ``model.X``); others
    (the older ``model.X``, ``lm_head.weight``) unchanged."""
    return "model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def vision_language_params(read: Callable[[str], np.ndarray], names: Iterable[str],
                           cfg: ModelConfig, source: str,
                           dtype: Any = np.float32) -> dict[str, Any]:
    """A VL checkpoint's tensors as the ``nnx.to_pure_dict`` layout of a TransformerLM with a tower:
    the text model's read as a Qwen3's or Qwen2's (:func:`seqjax.hf.tensors.from_hf`, every tensor
    checked there), ``vision`` the tower's (float32)."""
    names = set(names)
    words = {text_name(n): n for n in names if not n.startswith(PREFIXES)}
    text = from_hf(lambda name: read(words[name]), words, cfg, source, dtype)
    return {**text, "vision": vision_params(read, names, cfg.vision, source=source)}


def encoder_of(cfg: ModelConfig, where: str) -> str:
    """``qwen3_vl`` or ``qwen2_5_vl``: the Hugging Face model a seqjax model with a tower is; one
    line when its settings are neither's (the text family, M-RoPE's layout and the tower must
    agree)."""
    model_type = cfg.vision.encoder
    if model_type is None or FAMILIES[model_type] != (cfg.family, cfg.mrope_interleaved):
        raise CheckpointError(
            f"{where}: model.vision with family {cfg.family!r} and mrope_interleaved "
            f"{cfg.mrope_interleaved} is neither Qwen3-VL's nor Qwen2.5-VL's settings; expected "
            "one of the two to write a Hugging Face folder")
    if cfg.rope_scaling.type != "none":
        raise CheckpointError(
            f"{where}: model.rope_scaling {cfg.rope_scaling.type!r} with a tower; expected none")
    return model_type


def vision_language_folder(model_type: str, text_tensors: dict[str, np.ndarray],
                           vision: dict[str, Any], cfg: ModelConfig, text_config: dict[str, Any],
                           token_id: Callable[[str], int | None], image_token: str,
                           where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, config.json) of a VL model (``model_type``: :func:`encoder_of`'s answer for it) as
    transformers' ``save_pretrained`` writes them: ``text_tensors`` and ``text_config`` are the text
    model's (seqjax.hf.tensors.to_hf, seqjax.hf.families.hf_config), ``vision`` the tower's
    parameters; ``token_id(token)`` looks the special tokens up in the tokenizer (one line naming a
    missing one)."""
    text_prefix, vision_prefix_ = LAYOUT[model_type]
    tensors = {(text_prefix + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in text_tensors.items()}
    tensors.update(vision_to_hf(vision, cfg.vision, vision_prefix_))
    tokens = {}
    for key, token in {"image_token_id": image_token, **TOKENS}.items():
        tokens[key] = token_id(token)
        if tokens[key] is None:
            raise CheckpointError(
                f"{where}: the tokenizer has no {token!r} ({key}); expected Qwen-VL's tokens")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
            "mrope_section": list(cfg.mrope_section)}
    if cfg.mrope_interleaved:
        rope["mrope_interleaved"] = True
    dropped = ("architectures", "rope_theta", "rope_scaling", "torch_dtype", "tie_word_embeddings")
    text = {k: v for k, v in text_config.items() if k not in dropped}
    vision_config = {"model_type": f"{model_type}_vision",
                     **{k: getattr(cfg.vision, k) for k in VISION_FIELDS + OWN[model_type]},
                     "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.vision.rope_theta}}
    architecture = next(a for a, t in ARCHITECTURES.items() if t == model_type)
    config = {"architectures": [architecture], "model_type": model_type,
              "text_config": {**text, "model_type": f"{model_type}_text", "rope_parameters": rope},
              "vision_config": vision_config, **tokens, "tie_word_embeddings": cfg.tie_embeddings,
              "dtype": text_config.get("torch_dtype")}
    return tensors, config
