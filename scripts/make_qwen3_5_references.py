"""Reference outputs of transformers' own Qwen3.5 text model (JSON + safetensors): one tiny random
``qwen3_5_text`` folder, made by transformers 5 itself through its torch path (no FLA kernels).

    python scripts/make_qwen3_5_references.py --out tests/data/qwen3_5    # needs torch and transformers >= 5.24

The config mixes both kinds of layer (three Gated DeltaNet layers and one gated full-attention layer, partial
RoPE over a quarter of each head, (1 + w) norms). Its weights are drawn from each tensor's on-disk name
(make_moe_references.reference_weights, so the tests rebuild the folder without torch); it is saved as
transformers saves it and loaded back with ``from_pretrained``, and:

- ``qwen3_5.json``: the ``config.json`` transformers writes, the tensors' names and shapes, the versions;
- ``qwen3_5.safetensors``: for three sequences run alone (``seq0``, ``seq1``, and ``seq2`` shorter than the
  convolution), their ids and float32 logits; the three concatenated into one row *as transformers runs it*
  (``leaky.logits``: its state and convolution run on across the documents, the leak seqjax's segment ids
  close); and a greedy continuation of a prompt (``generate``, ``do_sample=False``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_moe_references import _saved_shapes, _write, reference_weights  # noqa: E402

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


def make(out: Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(**CONFIG)
    shapes, config_json = _saved_shapes(transformers.AutoModelForCausalLM.from_config(config))
    weights = reference_weights(shapes)
    with tempfile.TemporaryDirectory() as tmp:
        Path(f"{tmp}/config.json").write_text(json.dumps(config_json))
        from safetensors.numpy import save_file

        save_file(weights, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    tensors = {}
    with torch.no_grad():
        for name, ids in SEQUENCES.items():
            tensors[f"{name}.ids"] = np.asarray(ids, np.int32)
            tensors[f"{name}.logits"] = model(torch.tensor([ids])).logits[0].float().numpy()
        row = [t for ids in SEQUENCES.values() for t in ids]
        positions = torch.tensor([[p for ids in SEQUENCES.values() for p in range(len(ids))]])
        tensors["leaky.logits"] = model(torch.tensor([row]), position_ids=positions).logits[0].float().numpy()
        generated = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=CONFIG["pad_token_id"], eos_token_id=None)
    tensors["prompt.ids"] = np.asarray(PROMPT, np.int32)
    tensors["greedy.ids"] = generated[0, len(PROMPT):].numpy().astype(np.int32)
    record = {"family": "qwen3_5", "config": config_json, "tensors": shapes,
              "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                          "script": "scripts/make_qwen3_5_references.py"}}
    _write(out, "qwen3_5", record, tensors)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/qwen3_5"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make(args.out)


if __name__ == "__main__":
    main()
