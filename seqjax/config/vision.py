"""``model.vision``: a Qwen3-VL vision encoder's settings, read from a Hugging Face
``config.json``'s ``vision_config`` (or a run's config.yaml).

Every field that changes the computation is read, or refused when another encoder's
(:data:`REFUSED`): :func:`vision_from_hf` names the field, the value and what is supported.
Qwen2.5-VL's encoder (windowed blocks, a gated MLP, RMSNorm) is refused for now.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seqjax.config.fields import MODEL, hashable, setting
from seqjax.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """``model.vision``: Qwen3-VL's vision tower (transformers' ``Qwen3VLVisionConfig``, its
    defaults except ``depth``, whose 0 means a text model). A Hugging Face folder's
    ``vision_config`` fills it (:func:`vision_from_hf`); a run's config.yaml keeps it, so eval,
    export and a resume build the same tower."""

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
    num_position_embeddings: int = setting(2304, "entries of the square table of learned positions", min=1,
                                           resume=MODEL)
    deepstack_visual_indexes: list[int] = setting(
        [8, 16, 24], "the blocks whose features DeepStack adds to the first decoder layers", resume=MODEL)
    hidden_act: str = setting("gelu_pytorch_tanh", "the tower's MLP activation (gelu_pytorch_tanh or gelu)",
                              resume=MODEL)
    rope_theta: float = setting(10000.0, "the tower's 2-D RoPE base", min=1.0, resume=MODEL)

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
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"{where}: deepstack_visual_indexes {list(self.deepstack_visual_indexes)}; expected "
                              f"layers below depth {self.depth}")


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# read as they are
READ = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
        "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "deepstack_visual_indexes", "hidden_act")
# fields of other encoders that change the computation (Qwen2.5-VL's windows, Qwen2-VL's widths):
# refused
REFUSED = ("window_size", "fullatt_block_indexes", "tokens_per_second", "embed_dim", "mlp_ratio", "in_chans")


def vision_from_hf(fields: dict[str, Any], where: str = "config.json vision_config") -> VisionConfig:
    """The settings of a Qwen3-VL ``vision_config``; a field or value seqjax does not compute is one
    line."""
    model_type = fields.get("model_type", "qwen3_vl")
    if model_type not in ("qwen3_vl", "qwen3_vl_vision"):
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; expected qwen3_vl (Qwen2.5-VL's "
                          "windowed encoder is not built yet)")
    unknown = sorted(set(fields) & set(REFUSED))
    if unknown:
        raise ConfigError(f"{where}: field(s) {', '.join(unknown)} are not read by seqjax's vision encoder; expected "
                          f"Qwen3-VL's fields ({', '.join(READ)}, rope_parameters)")
    values = {key: fields[key] for key in READ if key in fields}
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(values.get(key), (list, tuple)):
            if len(set(values[key])) != 1:
                raise ConfigError(f"{where}: {key} {values[key]} is not square; expected one size")
            values[key] = values[key][0]
    if "deepstack_visual_indexes" in values:
        values["deepstack_visual_indexes"] = list(values["deepstack_visual_indexes"])
    values.setdefault("depth", 27)  # (transformers' default; seqjax's 0 means no tower)
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{where}: rope_parameters.rope_type {rope['rope_type']!r}; expected axial")
    values["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    config = VisionConfig(**values)
    config.check(where)
    return config

