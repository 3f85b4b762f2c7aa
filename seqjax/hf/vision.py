"""Qwen3-VL from a Hugging Face ``config.json`` and tensors: the text model as a Qwen3 (the family table's
row, its tensors renamed), the vision tower (``model.visual.*``) as the ``nnx.to_pure_dict`` layout of
:class:`seqjax.model.vision.VisionTower`.

transformers stores a linear layer as ``weight [out, in]`` (seqjax: ``kernel [in, out]``), a LayerNorm as
``weight``/``bias`` (seqjax: ``scale``/``bias``), and the patch embedding as a 3-D convolution whose kernel
equals its stride, ``[D, C, t, p, p]``: on one patch flattened in that (C, t, p, p) order it is a linear layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np
from flax import nnx

from seqjax.config.model import ModelConfig
from seqjax.config.vision import VisionConfig, vision_from_hf
from seqjax.core.errors import CheckpointError
from seqjax.hf.families import model_config_from_hf
from seqjax.hf.folders import CONFIG_JSON, read_json, tensor_files, tensor_reader
from seqjax.hf.tensors import from_hf
from seqjax.model.multimodal import VisionLanguageModel
from seqjax.model.stacking import blocks_layout
from seqjax.model.transformer import build_model
from seqjax.model.vision import VisionTower

PREFIX = "model.visual."


def _linear(read: Callable[[str], np.ndarray], name: str) -> dict[str, np.ndarray]:
    weight = read(f"{name}.weight")
    return {"kernel": np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T), "bias": read(f"{name}.bias")}


def _norm(read: Callable[[str], np.ndarray], name: str) -> dict[str, np.ndarray]:
    return {"scale": read(f"{name}.weight"), "bias": read(f"{name}.bias")}


def _merger(read: Callable[[str], np.ndarray], name: str) -> dict[str, Any]:
    return {"norm": _norm(read, f"{name}.norm"), "fc1": _linear(read, f"{name}.linear_fc1"),
            "fc2": _linear(read, f"{name}.linear_fc2")}


def vision_params(tensors: dict[str, np.ndarray], cfg: VisionConfig, prefix: str = PREFIX,
                  source: str = "the checkpoint") -> dict[str, Any]:
    """The tower's parameters (float32) from ``tensors`` (name -> array); a missing tensor or a wrong shape is
    one line naming it."""
    def read(name: str) -> np.ndarray:
        full = prefix + name
        if full not in tensors:
            raise CheckpointError(f"{source}: tensor {full} is missing; expected Qwen3-VL's vision tower")
        return np.asarray(tensors[full], np.float32)

    patch = read("patch_embed.proj.weight")
    if patch.shape != (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size):
        raise CheckpointError(f"{source}: tensor {prefix}patch_embed.proj.weight has shape {patch.shape}, expected "
                              f"{(cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size)} "
                              f"+ ({cfg.patch_size},) from vision_config")
    blocks = {
        i: {"norm1": _norm(read, f"blocks.{i}.norm1"), "norm2": _norm(read, f"blocks.{i}.norm2"),
            "qkv": _linear(read, f"blocks.{i}.attn.qkv"), "proj": _linear(read, f"blocks.{i}.attn.proj"),
            "fc1": _linear(read, f"blocks.{i}.mlp.linear_fc1"), "fc2": _linear(read, f"blocks.{i}.mlp.linear_fc2")}
        for i in range(cfg.depth)
    }
    return {"patch_embed": _linear(read, "patch_embed.proj"), "pos_embed": read("pos_embed.weight"),
            "blocks": blocks, "merger": _merger(read, "merger"),
            "deepstack": {j: _merger(read, f"deepstack_merger_list.{j}")
                          for j in range(len(cfg.deepstack_visual_indexes))}}


@dataclasses.dataclass(frozen=True)
class VisionLanguage:
    """A Qwen3-VL ``config.json`` as seqjax reads it: the text model as a Qwen3 row of the family table, the
    vision tower, the multimodal RoPE layout and the special tokens."""

    text: ModelConfig
    vision: VisionConfig
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def vision_language_config(config: dict[str, Any], source: str = "config.json") -> VisionLanguage:
    """Qwen3-VL's ``config.json`` (a dict): its text_config read as Qwen3's (every field read or refused there),
    its vision_config by :func:`vision_from_hf`; a video-only or missing field is one line."""
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
    tokens = {}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if not isinstance(config.get(key), int):
            raise CheckpointError(f"{source}: {key} is {config.get(key)!r}; expected a token id")
        tokens[key] = config[key]
    return VisionLanguage(model, vision, tuple(section), interleaved, **tokens)


def text_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The language model's tensors under a Qwen3's names (``model.language_model.X`` -> ``model.X``)."""
    out = {}
    for name, tensor in tensors.items():
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model."):]] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor
    return out


def vision_language_model(tensors: dict[str, np.ndarray], vl: VisionLanguage, text: ModelConfig | None = None,
                          source: str = "model.safetensors", seed: int = 0) -> VisionLanguageModel:
    """A :class:`VisionLanguageModel` holding a Qwen3-VL checkpoint's ``tensors``. ``text``: the language
    model's config as a run sets it (``vl.text`` with its attention backend, ``model.lora``, scan, remat, the
    chunked loss); adapters start as :func:`build_model` draws them from ``seed`` (B = 0: the base's function)."""
    cfg = text or vl.text
    lm = build_model(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(lm)
    words = text_tensors(tensors)
    nnx.replace_by_pure_dict(state, blocks_layout(from_hf(words.__getitem__, words, cfg, source), cfg.scan_layers))
    tower = VisionTower(vl.vision, nnx.Rngs(seed))
    tower_graph, tower_state = nnx.split(tower)
    nnx.replace_by_pure_dict(tower_state, vision_params(tensors, vl.vision, source=source))
    return VisionLanguageModel(nnx.merge(graphdef, state), nnx.merge(tower_graph, tower_state), vl.mrope_section,
                               vl.mrope_interleaved)


def read_vision_language_folder(path: str | Path, text: ModelConfig | None = None,
                                seed: int = 0) -> tuple[VisionLanguage, VisionLanguageModel]:
    """A Hugging Face Qwen3-VL folder (config.json, model.safetensors or an index with its shards) as seqjax's
    model; ``text`` and ``seed`` as :func:`vision_language_model` takes them (``text`` built from the folder's
    own text config when given as None). A missing or unreadable file or tensor is one line naming it."""
    folder = Path(path).expanduser()
    if not (folder / CONFIG_JSON).is_file():
        raise CheckpointError(f"{folder}: no {CONFIG_JSON}; expected a Hugging Face Qwen3-VL folder")
    vl = vision_language_config(read_json(folder / CONFIG_JSON), str(folder / CONFIG_JSON))
    files = tensor_files(folder)
    read = tensor_reader(files)
    return vl, vision_language_model({name: read(name) for name in files}, vl, text, str(folder), seed)
