"""``model.vision``: the settings of a Qwen3-VL or Qwen2.5-VL vision encoder, read from a Hugging
Face ``config.json``'s ``vision_config`` (or a run's config.yaml).

Every field that changes the computation is read, or refused when another encoder's
(:data:`REFUSED`): :func:`vision_from_hf` names the field, the value and what is supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seqjax.config.fields import MODEL, hashable, setting
from seqjax.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """``model.vision``: the vision tower (the defaults are transformers' ``Qwen3VLVisionConfig``'s
    except ``depth``, whose 0 means a text model; Qwen2.5-VL's encoder is the settings
    :data:`QWEN2_5_VL` names). A Hugging Face folder's ``vision_config`` fills it
    (:func:`vision_from_hf`); a run's config.yaml keeps it, so eval, export and a resume build the
    same tower."""

    depth: int = setting(0, "vision blocks (0: no vision tower, a text model)", min=0, resume=MODEL)
    hidden_size: int = setting(1152, "the tower's width", min=1, resume=MODEL)
    intermediate_size: int = setting(4304, "the tower's MLP width", min=1, resume=MODEL)
    num_heads: int = setting(16, "the tower's attention heads", min=1, resume=MODEL)
    in_channels: int = setting(3, "image channels", min=1, resume=MODEL)
    patch_size: int = setting(16, "a patch's side in pixels", min=1, resume=MODEL)
    temporal_patch_size: int = setting(2, "frames per patch (an image is repeated)", min=1, resume=MODEL)
    spatial_merge_size: int = setting(2, "m: m x m patches merge into one language-model token", min=1,
                                      resume=MODEL)
    out_hidden_size: int = setting(3584, "the merger's output width (the language model's d_model)", min=1,
                                   resume=MODEL)
    num_position_embeddings: int = setting(2304, "entries of the square table of learned positions (0: none, "
                                           "Qwen2.5-VL)", min=0, resume=MODEL)
    deepstack_visual_indexes: list[int] = setting(
        [8, 16, 24], "the blocks whose features DeepStack adds to the first decoder layers", resume=MODEL)
    hidden_act: str = setting("gelu_pytorch_tanh", "the tower's MLP activation (gelu_pytorch_tanh, gelu or silu)",
                              resume=MODEL)
    rope_theta: float = setting(10000.0, "the tower's 2-D RoPE base", min=1.0, resume=MODEL)
    norm: str = setting("layer_norm", "the tower's norms: layer_norm (Qwen3-VL) or rms_norm (Qwen2.5-VL)",
                        resume=MODEL)
    gated_mlp: bool = setting(False, "the blocks' MLP: down(act(gate(x)) * up(x)) (Qwen2.5-VL), else "
                              "fc2(act(fc1(x)))", resume=MODEL)
    patch_bias: bool = setting(True, "the patch embedding has a bias (Qwen3-VL; Qwen2.5-VL's has none)",
                               resume=MODEL)
    window_size: int = setting(0, "a window's side in pixels: blocks outside fullatt_block_indexes attend within "
                               "windows (Qwen2.5-VL); 0: every block sees its whole image", min=0, resume=MODEL)
    fullatt_block_indexes: list[int] = setting([], "with window_size: the blocks that see the whole image",
                                               resume=MODEL)
    attention: str = setting("xla", "the tower's attention backend: xla (the dense non-causal mask) or pallas (the "
                             "flash kernel's non-causal form; not measured on a GPU yet); others cannot "
                             "honour the non-causal mask", choices=("xla", "pallas"))

    def __hash__(self) -> int:  # (the tower keeps it as static graph data; lists as tuples)
        return hash(hashable(dataclasses.astuple(self)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The values of one patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def encoder(self) -> str | None:
        """``qwen3_vl`` or ``qwen2_5_vl`` when the settings are that model's tower, else None (a
        tower config.yaml mixed from both, which no Hugging Face model computes)."""
        if all(getattr(self, k) == v for k, v in QWEN2_5_VL.items()):
            return "qwen2_5_vl"
        plain = (self.norm, self.gated_mlp, self.patch_bias, self.window_size) == ("layer_norm", False, True, 0)
        if plain and self.num_position_embeddings and not self.fullatt_block_indexes:
            return "qwen3_vl"
        return None

    @property
    def window_patches(self) -> int:
        """A window's side in patches: whole merged groups (transformers' ``window_size //
        spatial_merge_size // patch_size`` of them)."""
        return self.window_size // self.spatial_merge_size // self.patch_size * self.spatial_merge_size

    @property
    def grid_side(self) -> int:
        """The side of the square table of learned position embeddings."""
        return int(round(self.num_position_embeddings**0.5))

    def check(self, where: str = "model.vision") -> None:
        """The tower's rules (nothing to check at depth 0); ``where`` names the section in the
        line."""
        if not self.depth:
            return
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{where}: hidden_act {self.hidden_act!r}; expected one of {', '.join(ACTIVATIONS)}")
        if self.grid_side**2 != self.num_position_embeddings:
            raise ConfigError(f"{where}: num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(f"{where}: hidden_size {self.hidden_size} over num_heads {self.num_heads} must be a "
                              "whole head width divisible by 4 (2-D rotary positions)")
        if self.norm not in ("layer_norm", "rms_norm"):
            raise ConfigError(f"{where}: norm {self.norm!r}; expected layer_norm or rms_norm")
        if self.window_size and not self.window_patches:
            raise ConfigError(f"{where}: window_size {self.window_size} is under one merged group "
                              f"({self.spatial_merge_size * self.patch_size} pixels); expected 0 or at least that")
        for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):
            bad = [i for i in getattr(self, key) if not 0 <= i < self.depth]
            if bad:
                raise ConfigError(f"{where}: {key} {list(getattr(self, key))}; expected layers below depth "
                                  f"{self.depth}")


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
# read as they are (Qwen2.5-VL's windows: window_size and fullatt_block_indexes)
READ = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
        "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "deepstack_visual_indexes", "hidden_act",
        "window_size", "fullatt_block_indexes")
# fields of other encoders that change the computation (Qwen2-VL's widths): refused
REFUSED = ("embed_dim", "mlp_ratio")
# the fields only one of the two encoders has
OWN = {"qwen3_vl": ("num_position_embeddings", "deepstack_visual_indexes"),
       "qwen2_5_vl": ("window_size", "fullatt_block_indexes")}
# Qwen2.5-VL's encoder as settings of the one tower, and transformers' Qwen2_5_VLVisionConfig
# defaults for the fields a config.json leaves out (Qwen3-VL's are VisionConfig's own).
QWEN2_5_VL = {"norm": "rms_norm", "gated_mlp": True, "patch_bias": False, "num_position_embeddings": 0,
              "deepstack_visual_indexes": []}
QWEN2_5_VL_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "patch_size": 14,
                       "hidden_act": "silu", "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}
# Hub configs of Qwen2.5-VL carry these; transformers reads in_channels and patch_size instead
# (tokens_per_second times video frames only)
ALIASES = {"in_chans": "in_channels", "spatial_patch_size": "patch_size"}


def vision_from_hf(fields: dict[str, Any], where: str = "config.json vision_config") -> VisionConfig:
    """The settings of a Qwen3-VL or Qwen2.5-VL ``vision_config``; a field or value seqjax does not
    compute is one line."""
    model_type = fields.get("model_type", "qwen3_vl")
    qwen2_5 = model_type in ("qwen2_5_vl", "qwen2_5_vl_vision")
    if not qwen2_5 and model_type not in ("qwen3_vl", "qwen3_vl_vision"):
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; expected qwen3_vl or qwen2_5_vl")
    own, other = (OWN["qwen2_5_vl"], OWN["qwen3_vl"]) if qwen2_5 else (OWN["qwen3_vl"], OWN["qwen2_5_vl"])
    unknown = sorted(set(fields) & (set(REFUSED) | set(other)))
    if unknown:
        expected = ", ".join(k for k in READ if k not in other)
        raise ConfigError(f"{where}: field(s) {', '.join(unknown)} are not read by seqjax's {model_type} vision "
                          f"encoder; expected {expected}, rope_parameters")
    values = {key: fields[key] for key in READ if key in fields}
    if qwen2_5:
        values = {**QWEN2_5_VL_DEFAULTS, **values, **QWEN2_5_VL}
    for alias, key in ALIASES.items():
        read = values.get(key, getattr(VisionConfig, key))
        if alias in fields and fields[alias] != read:
            raise ConfigError(f"{where}: {alias} {fields[alias]} differs from {key} {read}; transformers reads "
                              f"{key}: expected them equal")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(values.get(key), (list, tuple)):
            if len(set(values[key])) != 1:
                raise ConfigError(f"{where}: {key} {values[key]} is not square; expected one size")
            values[key] = values[key][0]
    for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):
        if key in values:
            values[key] = list(values[key])
    values.setdefault("depth", 27)  # (transformers' default; seqjax's 0 means no tower)
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{where}: rope_parameters.rope_type {rope['rope_type']!r}; expected axial")
    values["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    config = VisionConfig(**values)
    config.check(where)
    return config

