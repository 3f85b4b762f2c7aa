"""config.json's RoPE sections -> ``model.rope_theta``, ``model.rope_scaling`` (and Gemma 3's
``model.rope_local_theta``): the readers a family row names (seqjax.hf.families), from
transformers 4's rope_theta + rope_scaling or 5's rope_parameters (per layer type for Gemma 3). A
RoPE type other than default, linear, llama3 or yarn is refused naming the field, as are YaRN's
DeepSeek factors (mscale) and a legacy rope_scaling that says other than rope_parameters."""

from __future__ import annotations

from typing import Any

from seqjax.config.model import RopeScalingConfig
from seqjax.core.errors import CheckpointError

ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


def refuse(source: str, field: str, value: Any, expected: str) -> CheckpointError:
    """The one line for a config.json field whose value seqjax does not compute."""
    return CheckpointError(f"{source}: {field}: got {value!r}, expected {expected}; seqjax cannot "
                           "compute it")


def _scaling(params: dict[str, Any] | None, field: str,
             source: str) -> tuple[float | None, RopeScalingConfig]:
    """(rope_theta if the section names one, scaling) of one RoPE section (rope_scaling /
    rope_parameters[...])."""
    if params and not isinstance(params, dict):
        raise refuse(source, field, params, "a mapping with rope_type and its factors")
    theta = (params or {}).get("rope_theta")
    if not params:
        return theta, RopeScalingConfig()
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise refuse(source, f"{field}.rope_type", kind, f"one of {', '.join(ROPE_TYPES)}")
    if ROPE_TYPES[kind] == "none":
        return theta, RopeScalingConfig()
    if "factor" not in params:
        raise CheckpointError(f"{source}: {field}: {kind} scaling without a factor")
    if kind == "linear":
        return theta, RopeScalingConfig(type="linear", factor=float(params["factor"]))
    defaults = RopeScalingConfig()
    if kind == "yarn":
        for key in ("mscale", "mscale_all_dim"):  # (DeepSeek's variant of the attention factor)
            if params.get(key):
                raise refuse(source, f"{field}.{key}", params[key], "null (YaRN's own attention "
                                                                    "factor)")
        factor = params.get("attention_factor")
        return theta, RopeScalingConfig(
            type="yarn", factor=float(params["factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings",
                                                            defaults.original_max_position_embeddings)),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)), attention_factor=None if factor is None else float(factor))
    return theta, RopeScalingConfig(
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)),
    )


def _legacy_scaling(hf: dict[str, Any], source: str) -> None:
    """A ``rope_scaling`` beside transformers 5's ``rope_parameters`` is read by neither: a
    string (``"linear"``) or one that says other than the parameters is one line, never a model
    computed without it."""
    legacy, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    if legacy is None:
        return
    if not isinstance(legacy, dict):
        raise refuse(source, "rope_scaling", legacy, "a mapping with rope_type (or type) and "
                                                     "factor, or null")
    if params is not None and legacy.get("rope_type", legacy.get("type", "default")) != "default" and \
            _scaling(legacy, "rope_scaling", source)[1] != _scaling(params, "rope_parameters", source)[1]:
        raise refuse(source, "rope_scaling", legacy, "null, or the scaling rope_parameters gives")


def one_rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta and rope_scaling, from transformers 4's rope_theta + rope_scaling or 5's
    rope_parameters."""
    _legacy_scaling(hf, source)
    params = hf.get("rope_parameters")
    field = "rope_parameters" if params is not None else "rope_scaling"
    theta, scaling = _scaling(params if params is not None else hf.get("rope_scaling"), field, source)
    return {"rope_theta": float(theta or hf.get("rope_theta") or 10000.0), "rope_scaling": scaling}


def partial_rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen3.5: :func:`one_rope` and the share of each head's dims it turns
    (partial_rotary_factor, in rope_parameters or beside it; transformers' default for the family,
    0.25, when absent). The multimodal sections (mrope_section) turn a text position alike on
    every axis, so a text model reads none of them."""
    params = hf.get("rope_parameters") or {}
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise refuse(source, "rope_parameters.partial_rotary_factor", fraction, "a share in (0, 1]")
    return {**one_rope(hf, source), "rope_fraction": float(fraction)}


def rope_per_layer_type(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3: the full layers' rope_theta and rope_scaling, and the sliding layers' own base
    (rope_local_theta), from 4's rope_scaling + rope_local_base_freq or 5's rope_parameters per
    layer type."""
    if not isinstance(hf.get("rope_scaling") or {}, dict):
        raise refuse(source, "rope_scaling", hf["rope_scaling"], "a mapping with rope_type and "
                                                                 "factor, or null")
    params = hf.get("rope_parameters")
    if params and "full_attention" in params:
        full_theta, scaling = _scaling(params.get("full_attention"),
                                       "rope_parameters.full_attention", source)
        local_theta, local = _scaling(params.get("sliding_attention"),
                                      "rope_parameters.sliding_attention", source)
    else:
        full_theta, scaling = _scaling(hf.get("rope_scaling"), "rope_scaling", source)
        local_theta, local = hf.get("rope_local_base_freq"), RopeScalingConfig()
    if local.type != "none":
        raise refuse(source, "rope_parameters.sliding_attention.rope_type", local.type, "default")
    return {"rope_theta": float(full_theta or hf.get("rope_theta") or 1e6), "rope_scaling": scaling,
            "rope_local_theta": float(local_theta or 1e4)}
