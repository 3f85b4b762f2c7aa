"""Qwen3.5's readers and writer for its family rows (seqjax.hf.families): which layers are Gated
DeltaNets (``layer_types``) and their sizes (the ``linear_*`` fields), both ways."""

from __future__ import annotations

from typing import Any

from seqjax.config.deltanet import DeltaNetConfig
from seqjax.config.model import ModelConfig
from seqjax.hf.rope import refuse


def _positive(hf: dict[str, Any], key: str, source: str, default: int) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise refuse(source, key, value, "a positive integer")
    return value


_LINEAR_KINDS = {"linear_attention": "linear", "full_attention": "full"}


def qwen3_5_layers(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Qwen3.5: layer_types of linear_attention (a Gated DeltaNet) and full_attention (absent: every
    full_attention_interval-th layer full, 4 by default), the DeltaNet's sizes from the linear_* fields."""
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or any(kind not in _LINEAR_KINDS for kind in types):
        raise refuse(source, "layer_types", types, "a list of linear_attention and full_attention")
    net = DeltaNetConfig(**{ours: _positive(hf, theirs, source, default) for ours, theirs, default in (
        ("key_heads", "linear_num_key_heads", 16), ("value_heads", "linear_num_value_heads", 32),
        ("key_dim", "linear_key_head_dim", 128), ("value_dim", "linear_value_head_dim", 128),
        ("conv_width", "linear_conv_kernel_dim", 4))})
    return {"layer_types": [_LINEAR_KINDS[kind] for kind in types], "deltanet": net}


def qwen3_5_export(cfg: ModelConfig) -> dict[str, Any]:
    net = cfg.deltanet
    return {"attention_bias": False, "layer_types": [
        "linear_attention" if kind == "linear" else "full_attention" for kind in cfg.layer_types],
        "linear_num_key_heads": net.key_heads, "linear_num_value_heads": net.value_heads,
        "linear_key_head_dim": net.key_dim, "linear_value_head_dim": net.value_dim,
        "linear_conv_kernel_dim": net.conv_width, "rope_parameters": {
            "rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rope_fraction}}
