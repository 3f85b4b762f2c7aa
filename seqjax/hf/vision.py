"""Qwen3-VL from a Hugging Face ``config.json`` and tensors: the text model as a Qwen3 (the family
table's row, its tensors renamed), the vision tower (``model.visual.*``) as the ``vision`` subtree
of a TransformerLM's ``nnx.to_pure_dict`` layout (:class:`seqjax.model.vision.VisionTower`).
:mod:`seqjax.hf.folders` reads a Qwen3-VL folder through here.

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
TEXT_PREFIX = "model.language_model."


def _linear(read: Callable[[str], np.ndarray], name: str) -> dict[str, np.ndarray]:
    weight = read(f"{name}.weight")
    return {"kernel": np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T), "bias": read(f"{name}.bias")}


def _norm(read: Callable[[str], np.ndarray], name: str) -> dict[str, np.ndarray]:
    return {"scale": read(f"{name}.weight"), "bias": read(f"{name}.bias")}


def _merger(read: Callable[[str], np.ndarray], name: str) -> dict[str, Any]:
    return {"norm": _norm(read, f"{name}.norm"), "fc1": _linear(read, f"{name}.linear_fc1"),
            "fc2": _linear(read, f"{name}.linear_fc2")}


def vision_params(read: Callable[[str], np.ndarray], names: set[str], cfg: VisionConfig, prefix: str = PREFIX,
                  source: str = "the checkpoint") -> dict[str, Any]:
    """The tower's parameters (float32): ``read(name)`` gives a tensor of the checkpoint, ``names``
    are those it holds; a missing tensor or a wrong shape is one line naming it."""
    def get(name: str) -> np.ndarray:
        full = prefix + name
        if full not in names:
            raise CheckpointError(f"{source}: tensor {full} is missing; expected Qwen3-VL's vision tower")
        return np.asarray(read(full), np.float32)

    patch = get("patch_embed.proj.weight")
    if patch.shape != (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size):
        raise CheckpointError(f"{source}: tensor {prefix}patch_embed.proj.weight has shape {patch.shape}, expected "
                              f"{(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size)} "
                              f"+ ({cfg.patch_size},) from vision_config")
    blocks = {
        i: {"norm1": _norm(get, f"blocks.{i}.norm1"), "norm2": _norm(get, f"blocks.{i}.norm2"),
            "qkv": _linear(get, f"blocks.{i}.attn.qkv"), "proj": _linear(get, f"blocks.{i}.attn.proj"),
            "fc1": _linear(get, f"blocks.{i}.mlp.linear_fc1"), "fc2": _linear(get, f"blocks.{i}.mlp.linear_fc2")}
        for i in range(cfg.depth)
    }
    return {"patch_embed": _linear(get, "patch_embed.proj"), "pos_embed": get("pos_embed.weight"),
            "blocks": blocks, "merger": _merger(get, "merger"),
            "deepstack": {j: _merger(get, f"deepstack_merger_list.{j}")
                          for j in range(len(cfg.deepstack_visual_indexes))}}


@dataclasses.dataclass(frozen=True)
class VisionLanguage:
    """A Qwen3-VL ``config.json`` as seqjax reads it: the model (a Qwen3 row of the family table
    with ``model.vision`` and ``model.mrope_section`` set) and the special tokens."""

    text: ModelConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def vision_language_config(config: dict[str, Any], source: str = "config.json") -> VisionLanguage:
    """Qwen3-VL's ``config.json`` (a dict): its text_config read as Qwen3's (every field read or
    refused there), its vision_config by :func:`vision_from_hf`; a video-only or missing field is
    one line."""
    text = dict(config.get("text_config") or {})
    rope = dict(text.get("rope_parameters") or {})
    section = rope.pop("mrope_section", None)
    if not isinstance(section, (list, tuple)) or len(section) != 3:
        raise CheckpointError(f"{source}: text_config.rope_parameters.mrope_section is {section!r}; expected three "
                              "sizes (time, height, width)")
    interleaved = bool(rope.pop("mrope_interleaved", True))
    text.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_parameters=rope,
                tie_word_embeddings=config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    model = model_config_from_hf(text, f"{source} text_config")
    vision = vision_from_hf(config.get("vision_config") or {}, f"{source} vision_config")
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


def is_vision_language(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (a dict) is Qwen3-VL's (a vision_config beside its text_config)."""
    return config.get("model_type") == "qwen3_vl" or "Qwen3VLForConditionalGeneration" in (
        config.get("architectures") or ())


def text_name(name: str) -> str:
    """A Qwen3-VL tensor's name as a Qwen3's (``model.language_model.X`` -> ``model.X``); others
    unchanged."""
    return "model." + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def vision_language_params(read: Callable[[str], np.ndarray], names: Iterable[str], cfg: ModelConfig,
                           source: str, dtype: Any = np.float32) -> dict[str, Any]:
    """A Qwen3-VL checkpoint's tensors as the ``nnx.to_pure_dict`` layout of a TransformerLM with a
    tower: the text model's read as a Qwen3's (:func:`seqjax.hf.tensors.from_hf`, every tensor
    checked there), ``vision`` the tower's (float32)."""
    names = set(names)
    words = {text_name(n): n for n in names if not n.startswith(PREFIX)}
    text = from_hf(lambda name: read(words[name]), words, cfg, source, dtype)
    return {**text, "vision": vision_params(read, names, cfg.vision, source=source)}
