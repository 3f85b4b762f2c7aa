"""Hugging Face checkpoints <-> seqjax, as data and pure functions: the families' table, and the
tensor names.

One seqjax model computes every family: a family is a set of ``model.*`` settings
(:class:`~seqjax.config.model.ModelConfig`), read from ``config.json`` here and
written back on export. Each family is one :class:`Family` row of :data:`FAMILIES`:
its architecture and model_type, the settings it computes with, the fields it
refuses, its activation, its tied default, its RoPE and window readers, and what
export writes. What each family adds to Llama's block (RMSNorm, rotate-half
RoPE, grouped-query attention, SwiGLU, no biases):

==========  ======================  ========================================================================
family      architecture            differences from Llama
==========  ======================  ========================================================================
llama       LlamaForCausalLM        (none; rope_scaling llama3 or linear)
mistral     MistralForCausalLM      sliding_window on every layer when set
qwen2       Qwen2ForCausalLM        biases on q, k, v; sliding layers only under use_sliding_window
qwen3       Qwen3ForCausalLM        RMSNorm on each head's q and k before RoPE; explicit head_dim
gemma3      Gemma3ForCausalLM       norms scale by (1 + w), four a block; q/k norms; GeGLU (tanh GELU);
            (model_type             embeddings x sqrt(hidden); query_pre_attn_scalar; sliding layers
            gemma3_text)            interleaved by layer_types, with their own RoPE base; tied head
qwen3_moe   Qwen3MoeForCausalLM     Qwen3's attention; experts (a softmax router, top k, renormalized under
                                    norm_topk_prob); mlp_only_layers and decoder_sparse_step keep the gated MLP
mixtral     MixtralForCausalLM      Mistral's attention; experts (a softmax router, top k renormalized)
gpt_oss     GptOssForCausalLM       biases on q, k, v and o; attention sinks; sliding and full layers by
                                    layer_types; YaRN RoPE; experts with biases, a top-k-then-softmax router
                                    and the clamped, interleaved SwiGLU; MXFP4 experts dequantized on import
qwen3_5     Qwen3_5ForCausalLM      Gated DeltaNet layers (linear_attention) beside full ones by layer_types;
            (qwen3_5_text)          gated attention (q_proj [query | gate] per head); partial RoPE; (1 + w)
                                    norms; q/k norms
qwen3_5_moe Qwen3_5MoeForCausalLM   Qwen3.5's layers; experts on every layer (a softmax router, top k
                                    renormalized) and a shared expert times sigmoid(x w_shared_gate)
==========  ======================  ========================================================================

The tensor names and layouts are :mod:`seqjax.hf.tensors`; the RoPE sections' readers
:mod:`seqjax.hf.rope`.

Every ``config.json`` field that changes what the model computes is read, or
refused naming the field and its value: another architecture, another
activation, biases a family does not have, a RoPE type other than
default/linear/llama3, logit soft-capping, bidirectional attention, attention
dropout above 0, a quantization_config.

**Adding a family** starts with a row of :data:`FAMILIES` (and its name in
``seqjax.config.model.FAMILIES``, which ``model.family`` takes); docs/model.md
says what else it may need: a new setting of the model when it computes
something no flag covers, a tensor name :func:`seqjax.hf.tensors.block_tensors` lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from seqjax.config.experts import ExpertsConfig
from seqjax.config.model import ModelConfig
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf.qwen3_5 import qwen3_5_export, qwen3_5_layers
from seqjax.hf.rope import one_rope, partial_rope, refuse, rope_per_layer_type

# Old checkpoints saved RoPE's frequency table as a buffer; seqjax recomputes it.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
# Fields whose value changes what any family computes, and the one value seqjax computes.
_MUST_BE_ALL = {
    "quantization_config": ((None,), "no quantization_config (unquantized weights)"),
    "final_logit_softcapping": ((None,), "null (no logit soft-capping)"),
    "attn_logit_softcapping": ((None,), "null (no attention soft-capping)"),
    "use_bidirectional_attention": ((False, None), "false (causal attention)"),
}
_NO_ATTENTION_BIAS = {"attention_bias": ((False, None), "false")}
_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}


# ---------------------------------------------------------------------------
# Readers a row names: config.json -> model.* settings


def no_windows(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    return {}


def every_layer_slides(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Mistral: sliding_window on every layer when set (or as layer_types says)."""
    if hf.get("sliding_window") is None:
        return {}
    return _typed_windows(hf, hf.get("layer_types"), source) if hf.get("layer_types") else \
        {"sliding_window": int(hf["sliding_window"])}


def qwen_windows(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Qwen: sliding layers only under use_sliding_window (transformers ignores sliding_window
    otherwise), from layer_types or, without it, the layers from max_window_layers on."""
    if hf.get("sliding_window") is None or not hf.get("use_sliding_window"):
        return {}
    first = int(hf.get("max_window_layers", n_layers))
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
    ]
    return _typed_windows(hf, types, source)


def gemma_windows(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Gemma 3: layer_types, or every sliding_window_pattern-th layer full (6: five local, one
    global)."""
    if hf.get("sliding_window") is None:
        return {}
    pattern = int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(n_layers)]
    return _typed_windows(hf, types, source)


def _typed_windows(hf: dict[str, Any], types: list, source: str) -> dict[str, Any]:
    unknown = [t for t in types if t not in _KINDS]
    if unknown:
        raise refuse(source, "layer_types", unknown[0], "sliding_attention or full_attention")
    return {"sliding_window": int(hf["sliding_window"]), "layer_types": [_KINDS[t] for t in types]}


def activation(field: str, value: str, ours: str, *fallbacks:
               str) -> Callable[[dict[str, Any], str], str]:
    """A reader of the MLP's activation: ``field`` (or, when absent, the first of ``fallbacks``
    present) must be ``value``, which seqjax computes as ``model.mlp_activation=ours``."""

    def read(hf: dict[str, Any], source: str) -> str:
        name = next((f for f in (field, *fallbacks) if f in hf), field)
        if hf.get(name, value) != value:
            raise refuse(source, name, hf[name], repr(value))
        return ours

    read.field, read.value = field, value
    return read


# Fields of MoE checkpoints seqjax does not compute: shared experts, DeepSeek's latent attention
# (MLA) and group-limited routing, a router other than a softmax, router noise.
_MOE_MUST_BE = {
    "shared_expert_intermediate_size": ((None, 0), "null or 0 (no shared expert)"),
    "n_shared_experts": ((None, 0), "null or 0 (no shared experts)"),
    "kv_lora_rank": ((None,), "null (no multi-head latent attention)"),
    "q_lora_rank": ((None,), "null (no multi-head latent attention)"),
    "n_group": ((None, 1), "null or 1 (no group-limited routing)"),
    "topk_group": ((None, 1), "null or 1 (no group-limited routing)"),
    "scoring_func": ((None, "softmax"), "softmax"),
    "router_jitter_noise": ((None, 0, 0.0), "0 (no router noise)"),
}


# Qwen3.5's dense and MoE rows: the same attention (gated, q/k-normed, (1 + w) norms), the same refusals
_QWEN3_5 = {"qk_norm": True, "norm_plus_one": True, "attention_gate": True}
_QWEN3_5_MUST_BE = {**_NO_ATTENTION_BIAS, "attn_output_gate": ((True, None), "true (gated attention)")}


def _aux_coef(hf: dict[str, Any]) -> float:
    """transformers adds router_aux_loss_coef times the load-balancing loss only under
    output_router_logits."""
    return float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0


def qwen3_moe_experts(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Qwen3-MoE: experts on every layer but mlp_only_layers and those off decoder_sparse_step;
    the gated MLP's intermediate_size there."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = sorted({int(i) for i in hf.get("mlp_only_layers") or []} |
                   {i for i in range(n_layers) if (i + 1) % step})
    return {"experts": ExpertsConfig(
        count=_integer(hf, "num_experts" if "num_experts" in hf else "num_local_experts", source),
        top_k=_integer(hf, "num_experts_per_tok", source), d_ff=_integer(hf, "moe_intermediate_size", source),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        dense_layers=dense, aux_loss_coef=_aux_coef(hf))}


def mixtral_experts(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Mixtral: experts on every layer, intermediate_size wide, the top k always renormalized."""
    return {"experts": ExpertsConfig(
        count=_integer(hf, "num_local_experts", source), top_k=_integer(hf, "num_experts_per_tok", source),
        d_ff=_integer(hf, "intermediate_size", source), norm_topk_prob=True, aux_loss_coef=_aux_coef(hf))}


def gpt_oss_experts(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """gpt-oss: experts with biases, the top k of the logits then a softmax over them, the
    clamped SwiGLU."""
    return {"experts": ExpertsConfig(
        count=_integer(hf, "num_local_experts", source), top_k=_integer(hf, "num_experts_per_tok", source),
        d_ff=_integer(hf, "intermediate_size", source), router="topk_softmax", norm_topk_prob=False, bias=True,
        activation="clamped_swiglu", swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), aux_loss_coef=_aux_coef(hf))}


def qwen3_5_moe_experts(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    """Qwen3.5-MoE: experts on every layer, the top k always renormalized, and a shared expert
    (shared_expert_intermediate_size wide) with its sigmoid gate."""
    return {"experts": ExpertsConfig(
        count=_integer(hf, "num_experts", source),
        top_k=_integer(hf, "num_experts_per_tok", source),
        d_ff=_integer(hf, "moe_intermediate_size", source), norm_topk_prob=True,
        shared_d_ff=_integer(hf, "shared_expert_intermediate_size", source),
        aux_loss_coef=_aux_coef(hf))}


def no_experts(hf: dict[str, Any], n_layers: int, source: str) -> dict[str, Any]:
    return {}


def _gpt_oss_reads(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return {"qkv_bias": bias, "attn_out_bias": bias}


# ---------------------------------------------------------------------------
# Writers a row names: model.* settings -> config.json extras


def _window_fields(cfg: ModelConfig) -> dict[str, Any]:
    types = [("sliding_attention" if cfg.window_of(i) else "full_attention")
             for i in range(cfg.n_layers)]
    return {"sliding_window": cfg.sliding_window, "layer_types": types}


def _qwen_export(cfg: ModelConfig) -> dict[str, Any]:
    return {**_window_fields(cfg), "use_sliding_window": cfg.sliding_window is not None,
            "max_window_layers": cfg.n_layers}


def _gemma_export(cfg: ModelConfig) -> dict[str, Any]:
    scalar = cfg.query_pre_attn_scalar  # transformers 5 types it int (Gemma 3's are 256, 168, 144)
    return {**_window_fields(cfg), "attention_bias": False,
            "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
            "rope_local_base_freq": cfg.rope_local_theta, "final_logit_softcapping": None,
            "attn_logit_softcapping": None}


def _experts_export(cfg: ModelConfig, count: str, d_ff: str) -> dict[str, Any]:
    ex = cfg.experts
    return {count: ex.count, "num_experts_per_tok": ex.top_k, d_ff: ex.d_ff or cfg.d_ff,
            "output_router_logits": bool(ex.aux_loss_coef), "router_aux_loss_coef": ex.aux_loss_coef or 0.001}


def _qwen3_moe_export(cfg: ModelConfig) -> dict[str, Any]:
    return {**_qwen_export(cfg), "attention_bias": False,
            **_experts_export(cfg, "num_experts", "moe_intermediate_size"),
            "norm_topk_prob": cfg.experts.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.experts.dense_layers)}


def _gpt_oss_export(cfg: ModelConfig) -> dict[str, Any]:
    ex = cfg.experts
    return {**_window_fields(cfg), "attention_bias": cfg.qkv_bias,
            **_experts_export(cfg, "num_local_experts", "intermediate_size"), "swiglu_limit": ex.swiglu_limit,
            "swiglu_alpha": ex.swiglu_alpha}


def _qwen3_5_moe_export(cfg: ModelConfig) -> dict[str, Any]:
    return {**qwen3_5_export(cfg), **_experts_export(cfg, "num_experts", "moe_intermediate_size"),
            "shared_expert_intermediate_size": cfg.experts.shared_d_ff}


def _llama_can_export(cfg: ModelConfig) -> None:
    if cfg.has_windows:
        raise CheckpointError(
            "model.sliding_window: LlamaForCausalLM has no sliding window; expected null, or "
            "model.family=mistral")


def _mistral_can_export(cfg: ModelConfig) -> None:
    if "full" in cfg.layer_types:
        raise CheckpointError(
            f"model.layer_types: got {cfg.layer_types}, but MistralForCausalLM slides on every "
            "layer or none; expected [] (or another model.family)")


# ---------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class ExpertTensors:
    """How a family names its expert tensors in a checkpoint (seqjax.hf.tensors.expert_groups):
    the router's module, and either one tensor per expert (``gate``, ``up``, ``down``: patterns
    of the expert's number) or ``fused``, the module holding [E, D, 2F] gate_up_proj (gate and up
    interleaved) and [E, F, D] down_proj."""

    router: str
    gate: str = ""
    up: str = ""
    down: str = ""
    fused: str | None = None


@dataclass(frozen=True)
class Family:
    """Everything one Hugging Face family is to seqjax: how its ``config.json`` becomes ``model.*``
    and back.

    ``settings`` are the model's flags this family computes with (``qk_norm``, ``post_norms``, ...;
    Llama's choice when absent); ``must_be`` maps each field whose other values seqjax cannot
    compute to (the values it can, how a message says them); ``reads`` takes the family's own
    numeric fields (Gemma's query_pre_attn_scalar); ``export`` and ``can_export`` write and check
    what only this family's config.json has. The tensor names follow from the settings
    (:func:`seqjax.hf.tensors.block_tensors`).
    """

    name: str
    architecture: str
    model_type: str
    settings: dict[str, Any] = field(default_factory=dict)
    must_be: dict[str, tuple[tuple, str]] = field(default_factory=dict)
    activation: Callable[[dict[str, Any], str], str] = activation("hidden_act", "silu", "silu")
    tied_default: bool = False
    rope: Callable[[dict[str, Any], str], dict[str, Any]] = one_rope
    windows: Callable[[dict[str, Any], int, str], dict[str, Any]] = no_windows
    reads: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: {}
    export: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    can_export: Callable[[ModelConfig], None] = lambda cfg: None
    experts_of: Callable[[dict[str, Any], int, str], dict[str, Any]] = no_experts
    experts: ExpertTensors | None = None
    quantizations: tuple[str, ...] = ()  # quantization_config.quant_method values dequantized on import
    # Gated DeltaNet layers (model.layer_types linear) in its checkpoints
    linear_layers: bool = False
    carried: str | None = None  # tensors <carried>.* and fields <carried>_* kept, not computed (seqjax.hf.carried)


FAMILIES: dict[str, Family] = {row.name: row for row in (
    Family("llama", "LlamaForCausalLM", "llama",
           must_be={**_NO_ATTENTION_BIAS, "mlp_bias": ((False, None), "false"),
                    "sliding_window": ((None,), "null (no sliding window)"),
                    "use_sliding_window": ((False, None), "false")},
           export=lambda cfg: {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
           can_export=_llama_can_export),
    Family("mistral", "MistralForCausalLM", "mistral", windows=every_layer_slides,
           export=lambda cfg: {"sliding_window": cfg.sliding_window}, can_export=_mistral_can_export),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", settings={"qkv_bias": True}, windows=qwen_windows,
           export=_qwen_export),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", settings={"qk_norm": True}, must_be=_NO_ATTENTION_BIAS,
           windows=qwen_windows, export=lambda cfg: {**_qwen_export(cfg), "attention_bias": False}),
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text",
           settings={"qk_norm": True, "norm_plus_one": True, "post_norms": True, "embed_scale": True},
           must_be=_NO_ATTENTION_BIAS,
           activation=activation("hidden_activation", "gelu_pytorch_tanh", "gelu_tanh", "hidden_act"),
           tied_default=True, rope=rope_per_layer_type, windows=gemma_windows,
           reads=lambda hf: {"query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256))},
           export=_gemma_export),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", settings={"qk_norm": True},
           must_be={**_NO_ATTENTION_BIAS, **_MOE_MUST_BE}, windows=qwen_windows, export=_qwen3_moe_export,
           experts_of=qwen3_moe_experts,
           experts=ExpertTensors("mlp.gate", "mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj",
                                 "mlp.experts.{}.down_proj")),
    Family("mixtral", "MixtralForCausalLM", "mixtral", must_be=_MOE_MUST_BE, windows=every_layer_slides,
           export=lambda cfg: {"sliding_window": cfg.sliding_window,
                               **_experts_export(cfg, "num_local_experts", "intermediate_size")},
           can_export=_mistral_can_export, experts_of=mixtral_experts,
           experts=ExpertTensors("block_sparse_moe.gate", "block_sparse_moe.experts.{}.w1",
                                 "block_sparse_moe.experts.{}.w3", "block_sparse_moe.experts.{}.w2")),
    Family("gpt_oss", "GptOssForCausalLM", "gpt_oss", settings={"attention_sinks": True},
           must_be=_MOE_MUST_BE, windows=every_layer_slides, reads=_gpt_oss_reads, export=_gpt_oss_export,
           experts_of=gpt_oss_experts, experts=ExpertTensors("mlp.router", fused="mlp.experts"),
           quantizations=("mxfp4",)),
    Family("qwen3_5", "Qwen3_5ForCausalLM", "qwen3_5_text", settings=_QWEN3_5, must_be=_QWEN3_5_MUST_BE,
           rope=partial_rope, windows=qwen3_5_layers, export=qwen3_5_export, linear_layers=True, carried="mtp"),
    Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", settings=_QWEN3_5,
           must_be={**_QWEN3_5_MUST_BE, **{field: rule for field, rule in _MOE_MUST_BE.items()
                                           if field != "shared_expert_intermediate_size"}},
           rope=partial_rope, windows=qwen3_5_layers, export=_qwen3_5_moe_export,
           linear_layers=True, carried="mtp",
           experts_of=qwen3_5_moe_experts,
           experts=ExpertTensors("mlp.gate", "mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj",
                                 "mlp.experts.{}.down_proj")),
)}
# (what a config.json without "architectures" is taken to be)
ARCHITECTURE = FAMILIES["llama"].architecture
FAMILY_OF = {row.architecture: name for name, row in FAMILIES.items()}


def family_of(hf: dict[str, Any], source: str) -> Family:
    """The family row of an HF ``config.json``, from its architectures (and model_type), or a
    CheckpointError."""
    by_type = {row.model_type: row.architecture for row in FAMILIES.values()}
    architectures = hf.get("architectures") or [by_type.get(hf.get("model_type"), ARCHITECTURE)]
    if not isinstance(architectures,
                      list) or len(architectures) != 1 or architectures[0] not in FAMILY_OF:
        raise refuse(source, "architectures", architectures,
                      f"one of {', '.join(map(repr, FAMILY_OF))}")
    row = FAMILIES[FAMILY_OF[architectures[0]]]
    if hf.get("model_type", row.model_type) != row.model_type:
        raise refuse(source, "model_type", hf.get("model_type"), repr(row.model_type))
    return row


def _integer(hf: dict[str, Any], key: str, source: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{source}: {key}: got {value!r}, expected a positive integer")
    return value


def model_config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """The seqjax ModelConfig of an HF ``config.json`` (a dict), or a CheckpointError naming
    ``source`` and the field.

    Example: ``{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "head_dim": 32, ...}``
    gives ``ModelConfig(family="qwen3", qk_norm=True, d_model=64, head_dim=32, ...)``;
    ``{"attention_bias": true}`` on a Llama is refused with ``config.json: attention_bias: got True,
    expected false; seqjax cannot compute it``.
    """
    row = family_of(hf, source)
    for field_name, (allowed, expected) in {**_MUST_BE_ALL, **row.must_be}.items():
        value = hf.get(field_name)
        if field_name == "quantization_config" and isinstance(value, dict) and \
                value.get("quant_method") in row.quantizations:
            continue  # (weights dequantized on import: seqjax.hf.mxfp4)
        if value not in allowed:
            raise refuse(source, field_name, value, expected)
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        raise refuse(source, "attention_dropout", hf["attention_dropout"],
                      "0.0 (seqjax has no attention dropout)")
    n_layers = _integer(hf, "num_hidden_layers", source)
    n_heads = _integer(hf, "num_attention_heads", source)
    cfg = ModelConfig(
        family=row.name,
        vocab_size=_integer(hf, "vocab_size", source),
        d_model=_integer(hf, "hidden_size", source),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=_integer(hf, "num_key_value_heads", source, n_heads)
        if hf.get("num_key_value_heads") else n_heads,
        head_dim=_integer(hf, "head_dim", source) if hf.get("head_dim") is not None else None,
        # (Qwen3.5-MoE has no intermediate_size)
        d_ff=_integer(hf, "intermediate_size", source, hf.get("moe_intermediate_size")),
        max_seq_len=_integer(hf, "max_position_embeddings", source, 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", row.tied_default)),
        mlp_activation=row.activation(hf, source),
        **row.settings,
        **row.reads(hf),
        **row.rope(hf, source),
        **row.windows(hf, n_layers, source),
        **row.experts_of(hf, n_layers, source),
    )
    try:
        cfg.check()
    except ConfigError as err:
        raise CheckpointError(f"{source}: {err}") from None
    return cfg


def hf_config(cfg: ModelConfig, *, bos_token_id: int, eos_token_id: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a ModelConfig, in its family's fields (transformers 4's spelling; 5
    reads it too)."""
    row = FAMILIES[cfg.family]
    if "linear" in cfg.layer_types and not row.linear_layers:
        raise CheckpointError(f"model.layer_types: got {cfg.layer_types}, but {row.architecture} has no linear "
                              "(Gated DeltaNet) layers; expected full or sliding layers to export")
    row.can_export(cfg)
    scaling = cfg.rope_scaling
    rope_scaling = None
    if scaling.type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
    elif scaling.type == "llama3":
        rope_scaling = {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings
        }
    elif scaling.type == "yarn":
        rope_scaling = {
            "rope_type": "yarn", "factor": scaling.factor, "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow, "truncate": scaling.truncate,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            **({} if scaling.attention_factor is None else {"attention_factor": scaling.attention_factor})
        }
    return {
        "architectures": [row.architecture],
        "model_type": row.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        row.activation.field: row.activation.value,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
        **row.export(cfg),
    }
