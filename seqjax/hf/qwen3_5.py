"""Qwen3.5's readers and writer for its family rows (seqjax.hf.families): which layers are Gated
DeltaNets (``layer_types``) and their sizes (the ``linear_*`` fields), both ways; and the text model
of a folder the Hub ships with its vision tower (``Qwen3_5ForConditionalGeneration``)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

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
    """Qwen3.5: layer_types of linear_attention (a Gated DeltaNet) and full_attention (absent:
    every full_attention_interval-th layer full, 4 by default), the DeltaNet's sizes from the
    linear_* fields."""
    every = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or any(kind not in _LINEAR_KINDS for kind in types):
        raise refuse(source, "layer_types", types, "a list of linear_attention and full_attention")
    fields = (("key_heads", "linear_num_key_heads", 16), ("value_heads", "linear_num_value_heads", 32),
              ("key_dim", "linear_key_head_dim", 128), ("value_dim", "linear_value_head_dim", 128),
              ("conv_width", "linear_conv_kernel_dim", 4))
    net = DeltaNetConfig(**{ours: _positive(hf, theirs, source, default)
                            for ours, theirs, default in fields})
    return {"layer_types": [_LINEAR_KINDS[kind] for kind in types], "deltanet": net}


def qwen3_5_export(cfg: ModelConfig) -> dict[str, Any]:
    net = cfg.deltanet
    return {"attention_bias": False, "layer_types": [
        "linear_attention" if kind == "linear" else "full_attention" for kind in cfg.layer_types],
        "linear_num_key_heads": net.key_heads, "linear_num_value_heads": net.value_heads,
        "linear_key_head_dim": net.key_dim, "linear_value_head_dim": net.value_dim,
        "linear_conv_kernel_dim": net.conv_width, "rope_parameters": {
            "rope_type": "default", "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.rope_fraction}}


# The Hub's Qwen3.5 folders: the text model beside a vision tower and multi-token-prediction layers
CONDITIONAL = {"Qwen3_5ForConditionalGeneration": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
               "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}
CONDITIONAL_TYPES = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                     "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
TEXT_PREFIX, LEFT_OUT = "model.language_model.", "model.visual."


def conditional_text(config: dict[str, Any]) -> dict[str, Any] | None:
    """The text model's config.json (its text_config, as a ``qwen3_5_text`` or ``qwen3_5_moe_text``
    folder holds it) of a Qwen3.5 folder with a vision tower, or None for any other folder."""
    architectures = config.get("architectures") or [CONDITIONAL_TYPES.get(config.get("model_type"))]
    if len(architectures) != 1 or architectures[0] not in CONDITIONAL:
        return None
    architecture, model_type = CONDITIONAL[architectures[0]]
    text = dict(config.get("text_config") or {})
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "architectures": [architecture], "model_type": model_type,
            "tie_word_embeddings": tied}


def text_tensors(read: Callable[[str], Any],
                 names: Iterable[str]) -> tuple[Callable[[str], Any], list[str]]:
    """(read, names) of such a folder's text model: ``model.language_model.X`` read as
    ``model.X``, the head and the multi-token-prediction layers (``mtp.*``: seqjax.hf.carried keeps
    them) as they are, the tower (``model.visual.*``) left out."""
    names = [n for n in names if not n.startswith(LEFT_OUT)]
    renamed = {("model." + n[len(TEXT_PREFIX):] if n.startswith(TEXT_PREFIX) else n): n
               for n in names}
    return (lambda name: read(renamed[name])), list(renamed)
