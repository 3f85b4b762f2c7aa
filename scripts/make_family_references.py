"""Reference outputs of transformers' own models, one small random model per family seqjax loads (JSON + safetensors).

    python scripts/make_family_references.py --out tests/data/families    # needs torch and transformers >= 5

transformers 5 is PyTorch only, and torch is a 3 GB install that CI (2 cores, 90 minutes) does without. So the
reference is made here, by transformers itself, and committed: for each family (Llama, Mistral, Qwen2, Qwen3,
Gemma 3 text) a tiny config exercising everything the family computes (biases, q/k norms, (1 + w) norms,
GeGLU, sliding windows interleaved with full layers, per-layer RoPE bases and scalings), random weights, and:

- ``<family>.json``: the ``config.json`` transformers writes, every tensor's name and shape in its state dict,
  and the versions that made it;
- ``<family>.safetensors``: for each of two sequences run alone (``seq0``, ``seq1``, 12 and 7 tokens), its ids
  and transformers' float32 logits; a prompt and transformers' greedy continuation (``generate``,
  ``do_sample=False``); and ``tied_own_head.seq0.logits``: seq0 under a folder whose config.json ties the head
  (``tie_word_embeddings: true``) but which holds its own, different ``lm_head.weight``, as
  ``from_pretrained`` loads it.

The weights are not stored: :func:`reference_weights` draws each tensor from its name alone, so the tests
rebuild exactly these weights without torch (tests/test_families.py) and compare seqjax's logits to these.
tests/test_families.py also runs transformers live wherever torch imports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

VOCAB = 320
SEQUENCES = {"seq0": [5, 17, 203, 9, 88, 41, 150, 7, 300, 12, 64, 99], "seq1": [5, 250, 33, 19, 181, 2, 77]}
PROMPT = [5, 40, 112, 9, 260]
NEW_TOKENS = 8
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}
# Each family's settings: a window (4) shorter than the sequences, so that sliding layers really differ.
FAMILIES = {
    "llama": ("LlamaConfig", {"head_dim": 8, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
                              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}}),
    "mistral": ("MistralConfig", {"head_dim": 8, "sliding_window": 4, "tie_word_embeddings": False,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1,
                              "tie_word_embeddings": True,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 4,
                              "max_window_layers": 2, "tie_word_embeddings": False,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                    "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}


def reference_weights(shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Every tensor drawn from its name alone (float32, N(0, 0.3)): the script and the tests make the same ones."""
    out = {}
    for name, shape in shapes.items():
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        out[name] = (np.random.default_rng(seed).standard_normal(shape) * 0.3).astype(np.float32)
    return out


def _tied_with_own_head(class_name: str, settings: dict, shapes: dict[str, list[int]]) -> np.ndarray:
    """seq0's logits from a folder whose config.json ties the head to the embeddings but which holds its own,
    different lm_head.weight, as transformers' from_pretrained loads it (it keeps the file's head)."""
    import tempfile

    import torch
    import transformers
    from safetensors.numpy import save_file

    config = getattr(transformers, class_name)(**COMMON, **{**settings, "tie_word_embeddings": True})
    shapes = {**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file(reference_weights(shapes), f"{tmp}/model.safetensors", metadata={"format": "pt"})
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([SEQUENCES["seq0"]])).logits[0].float().numpy()


def make(family: str, out: Path) -> None:
    import torch
    import transformers
    from safetensors.numpy import save_file

    class_name, settings = FAMILIES[family]
    config = getattr(transformers, class_name)(**COMMON, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    state = model.state_dict()
    shapes = {name: list(t.shape) for name, t in state.items() if not (config.tie_word_embeddings
                                                                     and name == "lm_head.weight")}
    weights = reference_weights(shapes)
    model.load_state_dict({**{k: torch.from_numpy(v) for k, v in weights.items()},
                           **({"lm_head.weight": torch.from_numpy(weights["model.embed_tokens.weight"])}
                              if config.tie_word_embeddings else {})}, strict=True)
    tensors = {}
    with torch.no_grad():
        for name, ids in SEQUENCES.items():
            ids_t = torch.tensor([ids])
            tensors[f"{name}.ids"] = np.asarray(ids, np.int32)
            tensors[f"{name}.logits"] = model(ids_t).logits[0].float().numpy()
        generated = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   pad_token_id=COMMON["pad_token_id"], eos_token_id=None)
    tensors["prompt.ids"] = np.asarray(PROMPT, np.int32)
    tensors["greedy.ids"] = generated[0, len(PROMPT):].numpy().astype(np.int32)
    tensors["tied_own_head.seq0.logits"] = _tied_with_own_head(class_name, settings, shapes)
    folder = out / family
    model.config.architectures = [type(model).__name__]  # as model.save_pretrained records it
    model.config.save_pretrained(folder)  # config.json as transformers writes it
    record = {"family": family, "config": json.loads((folder / "config.json").read_text()), "tensors": shapes,
              "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                          "script": "scripts/make_family_references.py"}}
    (folder / "config.json").unlink()
    folder.rmdir()
    (out / f"{family}.json").write_text(json.dumps(record, indent=1) + "\n")
    save_file(tensors, str(out / f"{family}.safetensors"))
    (out / f"{family}.safetensors").chmod(0o644)  # (safetensors writes its files 0600)
    print(json.dumps({"family": family, "tensors": len(shapes), "logits": {k: list(v.shape) for k, v in
                                                                          tensors.items() if "logits" in k}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/families"))
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        make(family, args.out)


if __name__ == "__main__":
    main()
