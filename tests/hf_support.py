"""Helpers for the Hugging Face tests: tiny random Llama folders in transformers' own format, made on the spot.

Nothing is downloaded. A folder is what ``LlamaForCausalLM.save_pretrained``
writes: transformers' ``LlamaConfig`` writes ``config.json``, and the tensors
go to ``model.safetensors`` in PyTorch's layout ([out, in] per projection) with
``{"format": "pt"}`` metadata, so transformers' own loader
(``FlaxLlamaForCausalLM.from_pretrained``) reads the same files seqjax imports.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from seqjax.store.tokenizer import train_tokenizer

WORDS = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()


def tiny_tokenizer(folder: Path, vocab_size: int = 300):
    """A byte-level BPE (seqjax's recipe) trained on a few sentences, saved as ``folder/tokenizer.json``."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, 12)) + "\n" for _ in range(200)]
    return train_tokenizer(lines, folder / "tokenizer.json", vocab_size=vocab_size, special_tokens=["<|endoftext|>"])


def llama_tensors(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors with the names and [out, in] shapes of HF's LlamaForCausalLM for ``cfg`` (a config
    dict); norm weights near 1 so every layer matters."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    h = cfg["num_attention_heads"]
    k = cfg.get("num_key_value_heads") or h
    dh = cfg.get("head_dim") or d // h

    def normal(*shape, std=0.2):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(v, d, std=1.0), "model.norm.weight": 1 + normal(d, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + normal(d, std=0.1),
            p + "post_attention_layernorm.weight": 1 + normal(d, std=0.1),
            p + "self_attn.q_proj.weight": normal(h * dh, d),
            p + "self_attn.k_proj.weight": normal(k * dh, d),
            p + "self_attn.v_proj.weight": normal(k * dh, d),
            p + "self_attn.o_proj.weight": normal(d, h * dh),
            p + "mlp.gate_proj.weight": normal(f, d),
            p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f),
        }
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(v, d)
    return tensors


def write_llama_folder(folder: Path, tensors: dict[str, np.ndarray] | None = None, *,
                       tokenizer_from: Path | None = None,
                       seed: int = 0, **fields: Any) -> Path:
    """A tiny HF Llama folder: config.json by transformers' LlamaConfig, random tensors, a tokenizer.

    ``fields`` are LlamaConfig keyword arguments on top of a 2-layer, 32-wide,
    4-head (2 kv heads) model with a 300-token vocabulary.
    """
    # transformers: the reference that writes config.json, imported only where a test needs it
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=0, eos_token_id=0)
    settings.update(fields)
    LlamaConfig(**settings).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    save_file(tensors if tensors is not None else llama_tensors(cfg, seed), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_from is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer_from.read_bytes())
    else:
        tiny_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "bos_token": "<|endoftext|>"}))
    return folder


# ---------------------------------------------------------------------------
# Instruction data: a Llama folder with a chat template, and synthetic chats

def script_module(name: str):
    """``scripts/<name>.py`` as a module (the scripts are no package): what a test shares with a script."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # (a dataclass in the script looks its module up there)
    spec.loader.exec_module(module)
    return module


# make_chat_demo's chats, special tokens and template are the tests' too
_DEMO = script_module("make_chat_demo")
CHAT_SPECIALS, CHAT_TEMPLATE, synthetic_chats = _DEMO.CHAT_SPECIALS, _DEMO.CHAT_TEMPLATE, _DEMO.synthetic_chats


def write_chat_llama_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny HF Llama whose tokenizer opens text with ``<s>``, ends it with ``</s>`` and has a chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, 12)) + "\n" for _ in range(200)]
    train_tokenizer(lines, folder / "tokenizer.json", vocab_size=300, special_tokens=CHAT_SPECIALS)
    write_llama_folder(folder, tokenizer_from=folder / "tokenizer.json", seed=seed, bos_token_id=1, eos_token_id=0)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE}))
    return folder
