"""The training templates seqjax ships (data.chat_template=chatml|qwen3|gemma): what each renders, which tokens
it scores, and a Qwen3 model fine-tuned packed on chats under its template, sliding layers and all.

A Qwen3-style template that drops earlier turns' reasoning when it renders a later turn (as Qwen3's official one
does) cannot be scored by prefix rendering: it is refused with a pointer to the shipped template, which marks
each assistant turn with {% generation %} as the field does (TRL asks for such blocks and ships patched ones).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.core.errors import CorpusError
from seqjax.store.build import prepare
from seqjax.store.examples import ExampleSpec, chat_spans, chat_template
from seqjax.store.tokenizer import train_tokenizer
from test_families import hf_folder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<bos>", "<start_of_turn>",
            "<end_of_turn>"]
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nsat on a mat"},
        {"role": "user", "content": "and the dog"},
        {"role": "assistant", "content": "ran far", "reasoning_content": "second thought"}]


def spec(name: str) -> ExampleSpec:
    text, where = chat_template(name, None)
    return ExampleSpec(format="chat", loss_on="assistant", chat_template=text, template_name=where,
                       bos_token="<bos>", eos_token="<|endoftext|>")


def scored(name: str, messages=CHAT) -> tuple[str, list[str]]:
    text, spans = chat_spans(spec(name), messages, "here")
    return text, [text[a:b] for a, b in spans]


def test_chatml_scores_each_answer_and_its_im_end():
    text, parts = scored("chatml", CHAT[1:])
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")  # Qwen2.5's default
    assert parts == [CHAT[2]["content"] + "<|im_end|>", "ran far<|im_end|>"]
    assert "<|im_start|>assistant\n" + parts[1] + "\n" in text


def test_qwen3_keeps_only_the_last_turns_reasoning_and_scores_what_the_chat_shows():
    text, parts = scored("qwen3")
    assert "first thought" not in text  # an answer before the last user message loses its reasoning
    assert parts == ["sat on a mat<|im_end|>", "<think>\nsecond thought\n</think>\n\nran far<|im_end|>"]
    prompt = spec("qwen3")
    from seqjax.store.examples import chat_prompt

    assert chat_prompt(prompt, CHAT[:4], "here").endswith("<|im_start|>user\nand the dog<|im_end|>\n"
                                                          "<|im_start|>assistant\n")


def test_gemma_folds_the_system_prompt_into_the_first_turn_and_scores_model_turns():
    text, parts = scored("gemma")
    assert text.startswith("<bos><start_of_turn>user\nbe brief\n\nthe cat<end_of_turn>\n<start_of_turn>model\n")
    assert parts == [CHAT[2]["content"] + "<end_of_turn>", "ran far<end_of_turn>"]


def test_a_template_that_rewrites_earlier_turns_is_refused_pointing_at_the_shipped_one():
    # Qwen3-like: earlier answers lose their reasoning once a later turn is rendered; no generation blocks
    rewriting = ("{%- for m in messages -%}{%- set c = m.content -%}{%- if m.role == 'assistant' and not loop.last "
                 "-%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
                 "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}")
    custom = ExampleSpec(format="chat", loss_on="assistant", chat_template=rewriting, template_name="mine",
                         eos_token="<|endoftext|>")
    with pytest.raises(CorpusError, match=r"rewrites earlier turns.*data.chat_template=qwen3"):
        chat_spans(custom, CHAT[1:], "here")


def test_an_unknown_template_name_or_file_is_one_line():
    with pytest.raises(CorpusError, match="data.chat_template: .*qwen4.* not found; expected a Jinja chat template "
                                          "file or one of chatml, qwen3, gemma"):
        chat_template("qwen4", None)


@pytest.mark.slow  # a two-step fine-tune in this process
def test_a_qwen3_model_fine_tunes_packed_on_chats_with_assistant_only_loss(tmp_path):
    """The Qwen3 reference model (sliding layers from the second on) imported, fine-tuned on chats under the
    shipped qwen3 template, packed, loss on the assistant turns only."""
    from seqjax.main import import_hf
    from seqjax.train.loop import train

    folder = hf_folder("qwen3", tmp_path / "qwen3")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat dog ran far away".split()
    train_tokenizer([" ".join(rng.choice(words, 10)) + "\n" for _ in range(100)], folder / "tokenizer.json",
                    vocab_size=300, special_tokens=SPECIALS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    import_hf.main([str(folder), "--out", str(tmp_path / "imported"), "model.attention=xla"])
    chats = [{"messages": [{"role": "user", "content": " ".join(rng.choice(words, 5))},
                           {"role": "assistant", "content": " ".join(rng.choice(words, 4))}]} for _ in range(40)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    config = load_config(tmp_path / "imported" / "config.yaml", [
        f"train.init_from={tmp_path / 'imported'}", "data.corpus=jsonl", "data.format=chat",
        "data.chat_template=qwen3", f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
        f"data.valid_files=[{tmp_path / 'chats.jsonl'}]", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=48",
        "data.batch_size=4", "data.strategy=pack", "train.steps=2", "train.warmup_steps=0", "train.eval_every=0",
        f"run.dir={tmp_path / 'run'}"])
    store = prepare(config, splits=("train",)).stores["train"]
    ids, mask = np.asarray(store.tokens), np.asarray(store.mask).astype(bool)
    assert 0 < mask.mean() < 0.5  # the answers (and <|im_end|>), not the prompts
    summary = train(config)
    assert config.model.has_windows and summary["finished"] and np.isfinite(summary["val_loss"])
    assert summary["tokens_seen"] < 2 * 4 * 48 and ids.size > 0
    jax.clear_caches()
