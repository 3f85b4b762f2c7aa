"""Reference outputs of transformers' own mixture-of-experts models: Qwen3-MoE, Mixtral and gpt-oss (JSON +
safetensors), one tiny random folder each, made by transformers 5 itself.

    python scripts/make_moe_references.py --out tests/data/moe    # needs torch and transformers >= 5.24

For each family a tiny config exercising what it computes (Qwen3-MoE: a softmax router renormalized under
norm_topk_prob, one dense layer by mlp_only_layers; Mixtral: a sliding window; gpt-oss: attention sinks, biases,
alternating sliding and full layers, YaRN, the clamped interleaved SwiGLU and a top-k-then-softmax router), its
weights drawn from each tensor's on-disk name (:func:`reference_weights`, so the tests rebuild the folder
without torch), saved as transformers saves it and loaded back with ``from_pretrained`` (its own tensor
conversions: per-expert tensors fused on load), and:

- ``<family>.json``: the ``config.json`` transformers writes, the on-disk tensors' names, shapes and dtypes, and
  the versions that made it;
- ``<family>.safetensors``: for two sequences run alone (``seq0``, ``seq1``), their ids, float32 logits and
  each layer's router choices (the top k of its logits, in transformers' order); the router's load-balancing
  loss of the two padded into one batch with their attention mask (``load_balancing_loss_func``, as the
  model's ``aux_loss`` is computed); and a greedy continuation of a prompt (``generate``, ``do_sample=False``).

gpt-oss also gets ``gpt_oss_mxfp4``: its experts stored as MXFP4 (``*_blocks`` and ``*_scales`` drawn from their
names), and the float32 weights transformers' ``convert_moe_packed_tensors`` dequantizes them to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np

VOCAB = 320
SEQUENCES = {"seq0": [5, 17, 203, 9, 88, 41, 150, 7, 300, 12, 64, 99], "seq1": [5, 250, 33, 19, 181, 2, 77]}
PROMPT = [5, 40, 112, 9, 260]
NEW_TOKENS = 8
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64, "bos_token_id": 1,
          "eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", {"intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4,
                                     "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mixtral": ("MixtralConfig", {"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 4,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "gpt_oss": ("GptOssConfig", {"hidden_size": 64, "head_dim": 16, "intermediate_size": 32,
                                 "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                     "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": False}}),
}


def reference_weights(shapes: dict[str, list[int]], dtypes: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Every tensor drawn from its name alone: float32 N(0, 0.3); MXFP4's uint8 blocks uniform, its scales near
    2^0 (the script and the tests make the same ones)."""
    out = {}
    for name, shape in shapes.items():
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
        kind = (dtypes or {}).get(name, "float32")
        if kind == "uint8":
            low, high = (124, 129) if name.endswith("_scales") else (0, 256)
            out[name] = rng.integers(low, high, shape).astype(np.uint8)
        else:
            out[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    return out


def _saved_shapes(model) -> tuple[dict[str, list[int]], dict]:
    """The tensors transformers writes for ``model`` (its on-disk names: per-expert for Qwen3-MoE and Mixtral),
    and the config.json it writes."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(f"{tmp}/model.safetensors", "pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        config = json.loads(Path(f"{tmp}/config.json").read_text())
    return shapes, config


def _router_choices(model, ids) -> list[np.ndarray]:
    """Each layer's top-k experts of each token (its router logits' top k: a softmax keeps their order)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [torch.topk(logits.float(), k, dim=-1).indices.numpy().astype(np.int32) for logits in out.router_logits]


def loaded(config):
    """(transformers' model of ``config`` with every tensor drawn from its name, saved and read back by
    ``from_pretrained``, the tensors' names and shapes, the config.json it writes)."""
    import transformers
    from safetensors.numpy import save_file

    shapes, config_json = _saved_shapes(transformers.AutoModelForCausalLM.from_config(config))
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/config.json").write_text(json.dumps(config_json))
        save_file(reference_weights(shapes), f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    return model, shapes, config_json


def padded_aux_loss(model, sequences: list[list[int]]) -> np.ndarray:
    """transformers' load_balancing_loss_func over ``sequences`` padded into one batch with their attention
    mask (the aux loss over the real tokens)."""
    import torch

    width = max(map(len, sequences))
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in sequences])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in sequences])
    routed = model(batch, attention_mask=mask, output_router_logits=True)
    module = __import__(type(model).__module__, fromlist=["load_balancing_loss_func"])
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    aux = module.load_balancing_loss_func(routed.router_logits, experts, model.config.num_experts_per_tok, mask)
    return np.asarray(float(aux), np.float32)


def greedy(model, prompt: list[int], new_tokens: int, pad: int) -> dict[str, np.ndarray]:
    """``prompt.ids`` and transformers' greedy continuation of it, ``greedy.ids`` (``generate``, no sampling)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             eos_token_id=None)
    return {"prompt.ids": np.asarray(prompt, np.int32), "greedy.ids": out[0, len(prompt):].numpy().astype(np.int32)}


def record_of(name: str, config_json: dict, shapes: dict, script: str) -> dict:
    import torch
    import transformers

    return {"family": name, "config": config_json, "tensors": shapes,
            "made_by": {"transformers": transformers.__version__, "torch": torch.__version__, "script": script}}


def make(family: str, out: Path) -> None:
    import torch
    import transformers

    class_name, settings = FAMILIES[family]
    model, shapes, config_json = loaded(getattr(transformers, class_name)(**{**COMMON, **settings}))
    tensors = {}
    with torch.no_grad():
        for name, ids in SEQUENCES.items():
            tensors[f"{name}.ids"] = np.asarray(ids, np.int32)
            tensors[f"{name}.logits"] = model(torch.tensor([ids])).logits[0].float().numpy()
            for layer, chosen in enumerate(_router_choices(model, ids)):
                tensors[f"{name}.router.{layer}"] = chosen
        tensors["padded.aux_loss"] = padded_aux_loss(model, list(SEQUENCES.values()))
    tensors |= greedy(model, PROMPT, NEW_TOKENS, COMMON["pad_token_id"])
    _write(out, family, record_of(family, config_json, shapes, "scripts/make_moe_references.py"), tensors)
    if family == "gpt_oss":
        make_mxfp4(config_json, shapes, out)


def make_mxfp4(config_json: dict, shapes: dict[str, list[int]], out: Path) -> None:
    """gpt-oss with its experts in MXFP4: the folder's tensors (blocks and scales in place of gate_up_proj and
    down_proj) and transformers' own dequantization of them (``convert_moe_packed_tensors``, float32)."""
    import torch
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed, dtypes = {}, {}
    for name, shape in shapes.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            e, rows_in, cols_out = shape  # unquantized [E, in, out]; stored transposed, in 32-value blocks
            packed[name + "_blocks"], packed[name + "_scales"] = [e, cols_out, rows_in // 32, 16], [e, cols_out,
                                                                                                   rows_in // 32]
            dtypes[name + "_blocks"] = dtypes[name + "_scales"] = "uint8"
        else:
            packed[name] = shape
    weights = reference_weights(packed, dtypes)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith(("gate_up_proj", "down_proj")):
            tensors[name] = convert_moe_packed_tensors(torch.from_numpy(weights[name + "_blocks"]),
                                                       torch.from_numpy(weights[name + "_scales"]),
                                                       dtype=torch.float32).numpy()
    config = {**config_json, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    record = {"family": "gpt_oss", "config": config, "tensors": packed, "dtypes": dtypes,
              "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                          "script": "scripts/make_moe_references.py"}}
    _write(out, "gpt_oss_mxfp4", record, tensors)


def _write(out: Path, name: str, record: dict, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    save_file(tensors, str(out / f"{name}.safetensors"))
    (out / f"{name}.safetensors").chmod(0o644)  # (safetensors writes its files 0600)
    print(json.dumps({"family": name, "tensors": len(record["tensors"]), "saved": sorted(tensors)[:6]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/moe"))
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        make(family, args.out)


if __name__ == "__main__":
    main()
