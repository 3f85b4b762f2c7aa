"""Reference token ids of chats, made by transformers itself: one tokenizer and official template per family.

    python scripts/make_chat_references.py --out tests/data/chat     # needs transformers >= 5 and TRL's templates

For each family seqjax loads (Llama, Mistral, Qwen2, Qwen3, Gemma 3) this writes ``<family>/``:

- ``tokenizer.json``, ``tokenizer_config.json``: a small byte-level BPE trained here on synthetic text, with the
  family's special tokens and opening-token rule (Llama 3's and Gemma 3's tokenizers open text with their BOS,
  Qwen's with nothing), and the name of the official chat template it uses;
- ``chats.jsonl``: the chats (system prompts, several turns, tools and tool calls where the template takes them,
  an assistant turn with ``tool_calls`` and no content, Qwen3 reasoning, and Qwen3 chats with their own
  ``chat_template_kwargs``, ``{"enable_thinking": false}``, TRL's per-record field);
- ``reference.json``: for each chat, ``apply_chat_template(chat, tools=..., tokenize=True, **chat_template_kwargs)``'s
  ids, and the ids of its prompt (all but the last assistant turn) with ``add_generation_prompt=True``: what
  transformers and TRL train and generate on; for Qwen3 also every prompt with ``enable_thinking=False``
  passed to all chats (``data.chat_template_kwargs``).

The templates are not copied: they are TRL 1.16's copies of the official ones (``trl/chat_templates/``), which
the test reads from the same installed package (Mistral's is not among them: its chats use Qwen2.5's ChatML).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

WORDS = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()
# family -> (TRL template, special tokens (the first is end-of-text), bos_token, eos_token, opens text with BOS)
FAMILIES = {
    "llama": ("llama3_1", ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", True),
    "mistral": ("qwen2_5", ["</s>", "<s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], "<s>",
                "<|im_end|>", True),
    "qwen2": ("qwen2_5", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"], None,
              "<|im_end|>", False),
    "qwen3": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                        "<tool_response>", "</tool_response>", "<think>", "</think>"], None, "<|im_end|>", False),
    "gemma3": ("gemma3", ["<eos>", "<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>",
               True),
}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a town",
                                           "parameters": {"type": "object",
                                                          "properties": {"town": {"type": "string"}},
                                                          "required": ["town"]}}}]


def sentence(rng, n=6) -> str:
    return " ".join(rng.choice(WORDS, n))


def chats(family: str, seed: int = 0) -> list[dict]:
    """Eight chats of one to three turns; where the template takes them, tools, tool calls and reasoning."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        messages = [{"role": "system", "content": sentence(rng)}] if i % 2 and family != "gemma3" else []
        for _ in range(1 + i % 3):
            messages += [{"role": "user", "content": sentence(rng)},
                         {"role": "assistant", "content": sentence(rng, 4 + i)}]
        record = {"messages": messages}
        if family in ("qwen2", "qwen3", "mistral") and i in (2, 5):
            call = {"type": "function", "function": {"name": "weather", "arguments": {"town": str(rng.choice(WORDS))}}}
            messages[-1:] = [{"role": "assistant", "tool_calls": [call]} if i == 2 else
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "content": sentence(rng, 3)},
                             {"role": "assistant", "content": sentence(rng)}]
            record["tools"] = TOOLS
        if family == "qwen3" and i == 4:
            messages[-1]["reasoning_content"] = sentence(rng, 5)
        if family == "qwen3" and i in (1, 6):
            record["chat_template_kwargs"] = {"enable_thinking": False}
        out.append(record)
    return out


def template(name: str) -> str:
    found = importlib.util.find_spec("trl")
    return (Path(found.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja").read_text()


def tokenizer(specials: list[str], bos: str | None, path: Path):
    """A byte-level BPE with ``specials``, opening text with ``bos`` when given (as Llama 3's and Gemma's do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([sentence(rng, 12) + "\n" for _ in range(300)] + ['{"town": "x"} weather'], trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path))


def make(family: str, out: Path) -> None:
    import transformers
    from transformers import PreTrainedTokenizerFast

    name, specials, bos, eos, _ = FAMILIES[family]
    folder = out / family
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(specials, bos, folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "trl_chat_template": name}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=bos, eos_token=eos)
    text = template(name)
    records, refs = chats(family), []
    for record in records:
        messages, tools, kwargs = record["messages"], record.get("tools"), record.get("chat_template_kwargs", {})
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids = tok.apply_chat_template(messages, tools=tools, chat_template=text, tokenize=True, return_dict=False,
                                      **kwargs)
        prompt = tok.apply_chat_template(messages[:last], tools=tools, chat_template=text, tokenize=True,
                                         add_generation_prompt=True, return_dict=False, **kwargs)
        refs.append({"ids": list(map(int, ids)), "prompt_ids": list(map(int, prompt))})
        if family == "qwen3":
            refs[-1]["no_thinking_prompt_ids"] = list(map(int, tok.apply_chat_template(
                messages[:last], tools=tools, chat_template=text, tokenize=True, add_generation_prompt=True,
                return_dict=False, enable_thinking=False)))
    (folder / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "reference.json").write_text(json.dumps({
        "family": family, "template": name, "chats": refs,
        "made_by": {"transformers": transformers.__version__, "script": "scripts/make_chat_references.py"}}) + "\n")
    print(json.dumps({"family": family, "chats": len(refs), "tokens": sum(len(r["ids"]) for r in refs)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/chat"))
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = p.parse_args()
    for family in args.families:
        make(family, args.out)


if __name__ == "__main__":
    main()
