"""A small chat fine-tuning set and a random Llama with a chat template, made locally (nothing is downloaded).

    python scripts/make_chat_demo.py --out chat_demo

writes ``chat_demo/llama/`` (a Hugging Face Llama folder: random weights, a
byte-level BPE tokenizer.json with ``<s>``/``</s>`` and chat special tokens,
and a Zephyr-like chat template in tokenizer_config.json) and
``chat_demo/train.jsonl`` / ``valid.jsonl`` (``{"messages": [...]}`` chats of
one to three user/assistant exchanges, a system prompt in about a third), and
``pairs_train.jsonl`` / ``pairs_valid.jsonl``: conversational preference pairs
(``{"prompt": [...], "chosen": [...], "rejected": [...]}``, the chat up to its
last answer, that answer chosen and another chat's rejected), and
``prompts_train.jsonl``: conversational sums to answer (``{"prompt": [...], "answer": "12"}``), an RL run's
prompts. The README's "Fine-tuning on instruction data", docs/preference.md and docs/rl.md run on it; the model
is tiny (the shape of the README's test model), so every step takes seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

WORDS = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()
CHAT_SPECIALS = ["</s>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# Each message closes with <|end|>: the assistant's is scored, so the model learns to end its turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def synthetic_chats(n: int, seed: int = 0, max_turns: int = 3) -> list[dict]:
    """``n`` chats of 1..max_turns user/assistant exchanges, a system prompt in about a third of them."""
    rng = np.random.default_rng(seed)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))

    chats = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(2, 6)}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, max_turns + 1))):
            messages += [{"role": "user", "content": sentence(2, 14)},
                         {"role": "assistant", "content": sentence(1, 10)}]
        chats.append({"messages": messages})
    return chats


def math_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` conversational prompts asking for a sum of two numbers below 50, with the ``answer``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        out.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder to create (refused if it exists and is not empty)")
    p.add_argument("--examples", type=int, default=400, help="training chats (validation: a tenth)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # seqjax after argparse: --help stays instant
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.core.files import check_new_folder
    from seqjax.hf import folders as hf
    from seqjax.model.transformer import build_model
    from seqjax.store.tokenizer import train_tokenizer

    out = check_new_folder(args.out, overwrite=False)
    llama = out / "llama"
    llama.mkdir(parents=True)
    rng = np.random.default_rng(args.seed)
    lines = [" ".join(rng.choice(WORDS, 12)) + "\n" for _ in range(400)]
    tokenizer = train_tokenizer(lines, out / "tokenizer.json", vocab_size=320, special_tokens=CHAT_SPECIALS)
    config = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
                                "model.max_seq_len=256", "model.tie_embeddings=false", "model.norm_eps=1e-5"])
    model = build_model(config, tokenizer.vocab_size, rngs=nnx.Rngs(args.seed))
    hf.write_folder(llama, model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokenizer_json=tokenizer.path,
                    eos_token="</s>", bos_token="<s>", chat_template=CHAT_TEMPLATE)
    (out / "tokenizer.json").unlink()
    counts = {}
    for split, n, seed in (("train", args.examples, args.seed + 1), ("valid", max(1, args.examples // 10),
                                                                      args.seed + 2)):
        chats = synthetic_chats(n, seed)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
        counts[split] = n
        pairs = [{"prompt": c["messages"][:-1], "chosen": c["messages"][-1:],
                  "rejected": chats[(i + 1) % n]["messages"][-1:]} for i, c in enumerate(chats)
                 if chats[(i + 1) % n]["messages"][-1] != c["messages"][-1]]
        (out / f"pairs_{split}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        counts[f"pairs_{split}"] = len(pairs)
    prompts = math_prompts(args.examples, args.seed + 3)
    (out / "prompts_train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    counts["prompts_train"] = len(prompts)
    result = {"out": str(out), "llama": str(llama), "chats": counts, "vocab_size": tokenizer.vocab_size}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
