"""Fine-tuning on instruction data end to end, as the README's section runs it, with transformers as the judge.

A Llama built locally (random weights, a tokenizer.json with <s> and </s>, a
chat template) is imported, fine-tuned with packing on synthetic chats (loss on
the assistant turns), evaluated, exported; transformers then loads the export,
applies the same chat template, and its greedy continuation must be seqjax's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hf_support import synthetic_chats, write_chat_llama_folder
from test_train_support import REPO, cli_env

pytestmark = pytest.mark.slow


def run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_fine_tune_on_chats_evaluate_export_and_transformers_generates_the_same(tmp_path):
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM  # the reference, loaded as a user would

    llama = write_chat_llama_folder(tmp_path / "llama")
    for split, n, seed in (("train", 120, 1), ("valid", 20, 2)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in synthetic_chats(n, seed)))
    run("seqjax.import", str(llama), "--out", str(tmp_path / "imported"))
    ft = tmp_path / "ft"
    # the imported run's config.yaml carries the model's shape; the data keys say what to fine-tune on
    summary = run("seqjax.train", "--config", str(tmp_path / "imported" / "config.yaml"),
                  f"train.init_from={tmp_path / 'imported'}", "data.corpus=jsonl", "data.format=chat",
                  f"data.train_files=[{tmp_path / 'train.jsonl'}]", f"data.valid_files=[{tmp_path / 'valid.jsonl'}]",
                  f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128", "data.batch_size=8", "train.steps=12",
                  "train.warmup_steps=2", "train.eval_every=0", "train.checkpoint_every=12", f"run.dir={ft}")
    assert summary["finished"] and summary["val_word_perplexity"] is None
    scored = run("seqjax.eval", "--run", str(ft), "eval.mode=documents")
    assert scored["tokens"] < summary["tokens_seen"] and np.isclose(scored["nll_sum"] / scored["tokens"],
                                                                    summary["val_loss"], rtol=0.05)
    run("seqjax.export", "--run", str(ft), "--out", str(tmp_path / "hf"))

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = FlaxAutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "the cat sat on a mat"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tokenizer.bos_token_id  # the template opens with <s>, as the store framed every example
    out = model.generate(np.asarray([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    theirs = tokenizer.decode(np.asarray(out.sequences)[0, len(ids):])
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    greedy = ("--max-new-tokens", "8", "--temperature", "0")
    # The rendered prompt opens with <s>: it is not given a second one (issue 29 item 3).
    ours = run("seqjax.generate", "--run", str(ft), "--prompt", prompt, *greedy)["samples"][0]
    bare = run("seqjax.generate", "--run", str(ft), "--prompt", prompt[len("<s>"):], *greedy)["samples"][0]
    assert ours["token_ids"] == bare["token_ids"] and len(ours["completion"]) > 0
    assert theirs.startswith(ours["completion"])

    # --chat: the run's template with the generation prompt, the reply stopped at the template's end of turn.
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": messages}) + "\n" + json.dumps(messages) + "\n")
    chat = run("seqjax.generate", "--run", str(ft), "--chat", str(tmp_path / "chats.jsonl"), "--max-new-tokens",
               "24", "--temperature", "0")["samples"]
    out = model.generate(np.asarray([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = np.asarray(out.sequences)[0, len(ids):].tolist()
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    stop = min([k for k, i in enumerate(new) if i in (end, tokenizer.eos_token_id)], default=len(new))
    assert [s["token_ids"] for s in chat] == [new[:stop]] * 2
    assert [s["stopped_at_eot"] for s in chat] == [stop < len(new)] * 2
    assert chat[0]["prompt"] == prompt
