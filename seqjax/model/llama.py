"""Hugging Face Llama <-> seqjax, as pure functions: the config fields, and the tensor names and layouts.

seqjax's TransformerLM computes what HF's ``LlamaForCausalLM`` computes
(RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU, no biases), so a
checkpoint moves between them by renaming and reshaping, nothing more.
HF stores PyTorch ``nn.Linear`` weights as [out, in]; seqjax keeps [in, out]
with the heads split out (V vocab, D d_model, H heads, K kv heads, Dh
head_dim, F d_ff):

=========================================  ===============  =============================
HF tensor                                  HF shape         seqjax parameter
=========================================  ===============  =============================
model.embed_tokens.weight                  [V, D]           embed.embedding [V, D]
model.layers.i.input_layernorm.weight      [D]              blocks.i.attn_norm.scale
model.layers.i.self_attn.q_proj.weight     [H*Dh, D]        blocks.i.attn.wq [D, H, Dh]
model.layers.i.self_attn.k_proj.weight     [K*Dh, D]        blocks.i.attn.wk [D, K, Dh]
model.layers.i.self_attn.v_proj.weight     [K*Dh, D]        blocks.i.attn.wv [D, K, Dh]
model.layers.i.self_attn.o_proj.weight     [D, H*Dh]        blocks.i.attn.wo [H, Dh, D]
model.layers.i.post_attention_layernorm    [D]              blocks.i.mlp_norm.scale
model.layers.i.mlp.gate_proj.weight        [F, D]           blocks.i.mlp.w_gate [D, F]
model.layers.i.mlp.up_proj.weight          [F, D]           blocks.i.mlp.w_up [D, F]
model.layers.i.mlp.down_proj.weight        [D, F]           blocks.i.mlp.w_down [F, D]
model.norm.weight                          [D]              final_norm.scale
lm_head.weight (untied only)               [V, D]           lm_head [D, V]
=========================================  ===============  =============================

No RoPE permutation is needed: HF's checkpoints are already in the
rotate-half layout seqjax uses (the permutation from Meta's interleaved
layout happens once, in HF's own conversion script).

Config fields (``config.json``) read and written:

- supported: vocab_size, hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads, num_key_value_heads (GQA), head_dim, rms_norm_eps,
  rope_theta, rope_scaling (null / ``default`` / ``llama3``, also as
  transformers 5's ``rope_parameters``), tie_word_embeddings,
  max_position_embeddings, bos/eos/pad_token_id; pretraining_tp (any value:
  HF slices the same products), informational fields (torch_dtype, ...).
- refused, naming the field and value: any architecture other than
  LlamaForCausalLM (model_type other than llama), hidden_act other than silu,
  attention_bias or mlp_bias true, another rope_scaling type (linear, dynamic,
  yarn, longrope, ...), a sliding window, attention_dropout above 0,
  quantization_config.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from seqjax.config.tree import ModelConfig, RopeScalingConfig
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.model.stacking import blocks_layout

ARCHITECTURE = "LlamaForCausalLM"
# Fields whose value changes what the model computes, and the one value (or test) seqjax can compute.
_MUST_BE = {
    "hidden_act": (("silu",), "'silu'"),
    "attention_bias": ((False, None), "false"),
    "mlp_bias": ((False, None), "false"),
    "sliding_window": ((None,), "null (no sliding window)"),
    "use_sliding_window": ((False, None), "false"),
    "quantization_config": ((None,), "no quantization_config (unquantized weights)"),
}
ROPE_TYPES = {"default": "none", "llama3": "llama3"}
# Old checkpoints saved RoPE's frequency table as a buffer; seqjax recomputes it.
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer(i: int) -> str:
    return f"model.layers.{i}."


def _refuse(source: str, field: str, value: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{source}: {field}: got {value!r}, expected {expected}; seqjax cannot compute it")


def _rope(hf: dict[str, Any], source: str) -> tuple[float, RopeScalingConfig]:
    """rope_theta and the scaling, from transformers 4's rope_theta + rope_scaling or 5's rope_parameters."""
    params = hf.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = hf.get("rope_scaling"), "rope_scaling"
    theta = float((params or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    if not params:
        return theta, RopeScalingConfig()
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise _refuse(source, f"{field}.rope_type", kind, f"one of {', '.join(ROPE_TYPES)}")
    if ROPE_TYPES[kind] == "none":
        return theta, RopeScalingConfig()
    defaults = RopeScalingConfig()
    try:
        scaling = RopeScalingConfig(
            type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
            high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)),
        )
    except KeyError:
        raise CheckpointError(f"{source}: {field}: llama3 scaling without a factor") from None
    return theta, scaling


def model_config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    """The seqjax ModelConfig of an HF ``config.json`` (a dict), or a CheckpointError naming ``source`` and the field.

    Example: ``{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, ...}``
    gives ``ModelConfig(d_model=64, n_heads=4, ...)``; ``{"attention_bias": true, ...}`` is refused with
    ``config.json: attention_bias: got True, expected false; seqjax cannot compute it``.
    """
    architectures = hf.get("architectures") or [ARCHITECTURE]
    if list(architectures) != [ARCHITECTURE]:
        raise _refuse(source, "architectures", architectures, f"[{ARCHITECTURE!r}]")
    if hf.get("model_type", "llama") != "llama":
        raise _refuse(source, "model_type", hf.get("model_type"), "'llama'")
    for field, (allowed, expected) in _MUST_BE.items():
        if hf.get(field) not in allowed:
            raise _refuse(source, field, hf.get(field), expected)
    if float(hf.get("attention_dropout") or 0.0) != 0.0:
        raise _refuse(source, "attention_dropout", hf["attention_dropout"], "0.0 (seqjax has no attention dropout)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if not isinstance(hf.get(k), int)]
    if missing:
        raise CheckpointError(f"{source}: expected integer fields {', '.join(missing)}")
    theta, scaling = _rope(hf, source)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        d_ff=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # LlamaConfig's default is untied, so an absent field means untied
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    try:
        cfg.check()
    except ConfigError as err:
        raise CheckpointError(f"{source}: {err}") from None
    return cfg


def hf_config(cfg: ModelConfig, *, bos_token_id: int, eos_token_id: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a ModelConfig: LlamaConfig's fields, in transformers 4's spelling (5 reads it too)."""
    rope_scaling = None
    if cfg.rope_scaling.type == "llama3":
        s = cfg.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }


# ---------------------------------------------------------------------------
# Tensors


def _block_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[str, ...], Callable, Callable]]:
    """(HF name suffix, seqjax path in the block, seqjax -> HF, HF -> seqjax) for one block's tensors."""
    d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim

    def heads_in(n):  # [D, n, Dh] <-> [n*Dh, D]
        return (lambda w: w.reshape(d, n * dh).T), (lambda t: t.T.reshape(d, n, dh))

    q, kv = heads_in(h), heads_in(k)
    return [
        ("input_layernorm.weight", ("attn_norm", "scale"), lambda w: w, lambda t: t),
        ("self_attn.q_proj.weight", ("attn", "wq"), *q),
        ("self_attn.k_proj.weight", ("attn", "wk"), *kv),
        ("self_attn.v_proj.weight", ("attn", "wv"), *kv),
        ("self_attn.o_proj.weight", ("attn", "wo"), lambda w: w.reshape(h * dh, d).T, lambda t: t.T.reshape(h, dh, d)),
        ("post_attention_layernorm.weight", ("mlp_norm", "scale"), lambda w: w, lambda t: t),
        ("mlp.gate_proj.weight", ("mlp", "w_gate"), lambda w: w.T, lambda t: t.T),
        ("mlp.up_proj.weight", ("mlp", "w_up"), lambda w: w.T, lambda t: t.T),
        ("mlp.down_proj.weight", ("mlp", "w_down"), lambda w: w.T, lambda t: t.T),
    ]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a model with ``cfg`` and its shape."""
    d, h, k, dh, f, v = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size
    per_block = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (h * dh, d),
                 "self_attn.k_proj.weight": (k * dh, d), "self_attn.v_proj.weight": (k * dh, d),
                 "self_attn.o_proj.weight": (d, h * dh), "post_attention_layernorm.weight": (d,),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        shapes.update({_layer(i) + name: shape for name, shape in per_block.items()})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """seqjax parameters (``nnx.to_pure_dict`` of the model's Params) -> HF tensors by name, as numpy arrays."""
    params = blocks_layout(params, stacked=False)  # HF keeps a tensor per layer, whatever model.scan_layers
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
    for i in range(cfg.n_layers):
        block = params["blocks"][i]
        for name, (module, leaf), to_hf_layout, _ in _block_tensors(cfg):
            out[_layer(i) + name] = np.ascontiguousarray(to_hf_layout(np.asarray(block[module][leaf])))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def from_hf(read: Callable[[str], np.ndarray], names: Iterable[str], cfg: ModelConfig, source: str,
            dtype: Any = np.float32) -> dict[str, Any]:
    """HF tensors -> seqjax parameters (the pure dict ``nnx.merge`` takes), each cast to ``dtype``.

    ``read(name)`` returns one tensor; ``names`` are the tensors the checkpoint
    holds. A missing tensor, a wrong shape, or a tensor seqjax has no place
    for (a bias, say) is refused with a CheckpointError naming it and ``source``.
    A tied model ignores an ``lm_head.weight`` (HF ties it to the embedding).
    """
    names = set(names)
    expected = hf_shapes(cfg)
    ignored = {n for n in names if n.endswith(_IGNORED_TENSOR_SUFFIXES)}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unexpected = sorted(names - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(
            f"{source}: holds tensors a Llama model with this config.json has no place for: "
            f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = sorted(set(expected) - names)
    if missing:
        raise CheckpointError(f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all)")

    def get(name: str) -> np.ndarray:
        tensor = read(name)
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {expected[name]} from config.json"
            )
        return np.asarray(tensor).astype(dtype)

    params: dict[str, Any] = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.norm.weight")},
        "blocks": {},
    }
    for i in range(cfg.n_layers):
        block: dict[str, dict[str, np.ndarray]] = {}
        for name, (module, leaf), _, from_hf_layout in _block_tensors(cfg):
            block.setdefault(module, {})[leaf] = np.ascontiguousarray(from_hf_layout(get(_layer(i) + name)))
        params["blocks"][i] = block
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T)
    return params

