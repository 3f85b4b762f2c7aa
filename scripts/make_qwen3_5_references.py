"""Reference outputs of transformers' own Qwen3.5 text models (JSON + safetensors): tiny random
``qwen3_5_text`` and ``qwen3_5_moe_text`` folders, made by transformers 5 itself through its torch path (no FLA
kernels).

    python scripts/make_qwen3_5_references.py --out tests/data/qwen3_5    # needs torch, transformers >= 5.24, peft

The config mixes both kinds of layer (three Gated DeltaNet layers and one gated full-attention layer, partial
RoPE over a quarter of each head, (1 + w) norms). Its weights are drawn from each tensor's on-disk name
(make_moe_references.reference_weights, so the tests rebuild the folder without torch); it is saved as
transformers saves it and loaded back with ``from_pretrained``, and:

The same for Qwen3.5-MoE's text model (``qwen3_5_moe``: experts on every layer and a shared expert with its
sigmoid gate), each in two files:

- ``<name>.json``: the ``config.json`` transformers writes, the tensors' names and shapes, the versions;
- ``<name>.safetensors``: for three sequences run alone (``seq0``, ``seq1``, and ``seq2`` shorter than the
  convolution), their ids and float32 logits; the three concatenated into one row *as transformers runs it*
  (``leaky.logits``: its state and convolution run on across the documents, the leak seqjax's segment ids
  close); a greedy continuation of a prompt (``generate``, ``do_sample=False``); for the MoE variant, the
  router's load-balancing loss of ``seq0`` and ``seq1`` padded into one batch with their attention mask.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_moe_references import _write, greedy, loaded, padded_aux_loss, record_of, reference_weights  # noqa: E402

SEQUENCES = {"seq0": [5, 17, 203, 9, 88, 41, 150, 7, 300, 12, 64, 99, 31, 8], "seq1": [5, 250, 33, 19, 181, 2, 77],
             "seq2": [11, 290, 4]}
PROMPT = [5, 40, 112, 9, 260]
NEW_TOKENS = 8
CONFIG = {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "linear_conv_kernel_dim": 4, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 0,
          "pad_token_id": 0, "tie_word_embeddings": False,
          "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}


# Qwen3.5-MoE's text model: the same layers, experts on every one (top 2 of 4, renormalized) beside a shared
# expert with its sigmoid gate
MOE_CONFIG = {**{k: v for k, v in CONFIG.items() if k != "intermediate_size"}, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
              "output_router_logits": True, "router_aux_loss_coef": 0.01}
VARIANTS = {"qwen3_5": ("Qwen3_5TextConfig", CONFIG), "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE_CONFIG)}


def make(out: Path, name: str) -> None:
    import torch
    import transformers

    class_name, settings = VARIANTS[name]
    model, shapes, config_json = loaded(getattr(transformers, class_name)(**settings))
    tensors = {}
    with torch.no_grad():
        for seq, ids in SEQUENCES.items():
            tensors[f"{seq}.ids"] = np.asarray(ids, np.int32)
            tensors[f"{seq}.logits"] = model(torch.tensor([ids])).logits[0].float().numpy()
        row = [t for ids in SEQUENCES.values() for t in ids]
        positions = torch.tensor([[p for ids in SEQUENCES.values() for p in range(len(ids))]])
        tensors["leaky.logits"] = model(torch.tensor([row]), position_ids=positions).logits[0].float().numpy()
        if name == "qwen3_5_moe":  # the router's load-balancing loss of two sequences padded into one batch
            tensors["padded.aux_loss"] = padded_aux_loss(model, [SEQUENCES["seq0"], SEQUENCES["seq1"]])
    tensors |= greedy(model, PROMPT, NEW_TOKENS, CONFIG["pad_token_id"])
    _write(out, name, record_of(name, config_json, shapes, "scripts/make_qwen3_5_references.py"), tensors)


# peft's LoRA on the dense model: the gated attention's projections, every Gated DeltaNet projection and the MLP's
LORA_TARGETS = ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                "gate_proj", "down_proj"]


def make_lora(out: Path) -> None:
    """``qwen3_5-lora.{json,safetensors}``: peft's ``LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS)``
    by ``get_peft_model`` on the dense base, every adapter tensor drawn from its name (so each B is nonzero),
    written as an adapter folder and loaded back by ``PeftModel.from_pretrained``; peft's float32 logits of
    ``seq0``."""
    import peft
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.numpy import save_file

    record = json.loads((out / "qwen3_5.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, adapter_dir = Path(tmp) / "base", Path(tmp) / "adapter"
        base_dir.mkdir()
        (base_dir / "config.json").write_text(json.dumps(record["config"]))
        save_file(reference_weights(record["tensors"]), str(base_dir / "model.safetensors"), metadata={"format": "pt"})

        def base():
            return transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                                     dtype=torch.float32)

        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=LORA_TARGETS)
        peft.get_peft_model(base(), config).save_pretrained(adapter_dir)
        with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        save_file(reference_weights(shapes), str(adapter_dir / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
        model = peft.PeftModel.from_pretrained(base(), adapter_dir).eval()
        with torch.no_grad():
            logits = model(torch.tensor([SEQUENCES["seq0"]])).logits[0].float().numpy()
    record = {"family": "qwen3_5", "adapter_config": adapter_config, "tensors": shapes,
              "made_by": {"peft": peft.__version__, "transformers": transformers.__version__,
                          "torch": torch.__version__, "script": "scripts/make_qwen3_5_references.py"}}
    _write(out, "qwen3_5-lora", record, {"seq0.logits": logits, "seq0.ids": np.asarray(SEQUENCES["seq0"], np.int32)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/qwen3_5"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in VARIANTS:
        make(args.out, name)
    make_lora(args.out)


if __name__ == "__main__":
    main()
