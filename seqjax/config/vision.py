"""A Qwen3-VL vision encoder's settings, read from a Hugging Face ``config.json``'s ``vision_config``.

Every field that changes the computation is read, or refused when another encoder's (:data:`REFUSED`):
:func:`vision_from_hf` names the field, the value and what is supported. Qwen2.5-VL's encoder (windowed
blocks, a gated MLP, RMSNorm) is refused for now.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seqjax.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Qwen3-VL's vision tower (transformers' ``Qwen3VLVisionConfig``, its defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

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


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# read as they are (a list becomes a tuple)
READ = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
        "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "deepstack_visual_indexes", "hidden_act")
# fields of other encoders that change the computation (Qwen2.5-VL's windows, Qwen2-VL's widths): refused
REFUSED = ("window_size", "fullatt_block_indexes", "tokens_per_second", "embed_dim", "mlp_ratio", "in_chans")


def vision_from_hf(fields: dict[str, Any], where: str = "config.json vision_config") -> VisionConfig:
    """The settings of a Qwen3-VL ``vision_config``; a field or value seqjax does not compute is one line."""
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
        values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
    rope = fields.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{where}: rope_parameters.rope_type {rope['rope_type']!r}; expected axial")
    values["rope_theta"] = float(rope.get("rope_theta", fields.get("rope_theta", 10000.0)))
    config = VisionConfig(**values)
    if config.hidden_act not in ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_act {config.hidden_act!r}; expected one of {', '.join(ACTIVATIONS)}")
    if config.grid_side**2 != config.num_position_embeddings:
        raise ConfigError(f"{where}: num_position_embeddings {config.num_position_embeddings} is not a square")
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise ConfigError(f"{where}: hidden_size {config.hidden_size} over num_heads {config.num_heads} must be a "
                          "whole head width divisible by 4 (2-D rotary positions)")
    bad = [i for i in config.deepstack_visual_indexes if not 0 <= i < config.depth]
    if bad:
        raise ConfigError(f"{where}: deepstack_visual_indexes {list(config.deepstack_visual_indexes)}; expected "
                          f"layers below depth {config.depth}")
    return config
