"""A chat trains on exactly the ids transformers gives it: for every family seqjax loads, the store holds each
chat as ``apply_chat_template(chat, tools=..., tokenize=True)``'s ids, a packed row trains on those ids alone
(no separator before or after), and ``generate --chat`` prompts with the ids of ``add_generation_prompt=True``.

The references (tests/data/chat/<family>/reference.json) were made by transformers itself, from the committed
script scripts/make_chat_references.py, with each family's official template as TRL 1.16 ships it (Mistral's
chats use Qwen2.5's ChatML: TRL has no Mistral template); the templates are read from that installed package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.data.pipeline import build_pipeline
from seqjax.store.build import prepare
from seqjax.store.chat import chat_prompt
from seqjax.store.examples import example_spec
from seqjax.store.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "chat"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def trl_template(name: str) -> Path:
    found = importlib.util.find_spec("trl")  # finds the package without importing it (TRL imports torch)
    path = Path(found.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja" if found else None
    if path is None or not path.is_file():
        pytest.skip("the official chat templates come with TRL's package: scripts/setup.sh installs trl==1.16.0")
    return path


def family_config(family: str, tmp_path: Path, *extra: str):
    folder = DATA / family
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    reference = json.loads((folder / "reference.json").read_text())
    specials = [t["content"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]]
    config = load_config(None, [
        "data.corpus=jsonl", "data.format=chat", f"data.train_files=[{folder / 'chats.jsonl'}]",
        f"data.cache_dir={tmp_path / 'cache'}", f"data.chat_template={trl_template(reference['template'])}",
        f"tokenizer.path={folder / 'tokenizer.json'}", f"tokenizer.special_tokens={json.dumps(specials)}",
        f"tokenizer.bos_token={json.dumps(tokenizer['bos_token'])}", "data.seq_len=1024", "data.batch_size=2",
        "data.shuffle=false", *extra])
    return config, reference["chats"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_store_holds_each_chat_as_transformers_tokenizes_it(family, tmp_path):
    config, chats = family_config(family, tmp_path)
    store = prepare(config, splits=("train",)).stores["train"]
    assert store.num_docs == len(chats)
    for i, chat in enumerate(chats):
        assert store.doc_sequence(i).tolist() == chat["ids"], f"chat {i}"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_packed_row_trains_on_each_chats_ids_alone(family, tmp_path):
    """Inputs ids[:-1], targets ids[1:], positions from 0: no <|endoftext|> (or any separator) before a Qwen chat,
    one <|begin_of_text|> (the template's own) before a Llama one."""
    config, chats = family_config(family, tmp_path)
    store = prepare(config, splits=("train",)).stores["train"]
    wanted = {tuple(chat["ids"]) for chat in chats}
    seen = set()
    batches = iter(build_pipeline(config, store))
    for _ in range(len(chats)):
        batch = next(batches)
        for row in range(batch["inputs"].shape[0]):
            seg = batch["segment_ids"][row]
            for s in set(seg[seg > 0].tolist()):
                where = np.flatnonzero(seg == s)
                np.testing.assert_array_equal(batch["positions"][row, where], np.arange(len(where)))
                ids = tuple(batch["inputs"][row, where].tolist()) + (int(batch["targets"][row, where[-1]]),)
                assert ids in wanted
                seen.add(ids)
    assert seen == wanted


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chat_prompt_is_transformers_generation_prompt(family, tmp_path):
    config, chats = family_config(family, tmp_path)
    tokenizer = Tokenizer(config.tokenizer.path, config.tokenizer.special_tokens[0], config.tokenizer.bos_token)
    spec = example_spec(config, config.data.resolved_sources()[0], Path(config.tokenizer.path),
                        config.tokenizer.special_tokens[0])
    records = [json.loads(line) for line in (DATA / family / "chats.jsonl").read_text().splitlines()]
    for record, chat in zip(records, chats):
        messages = record["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        text = chat_prompt(spec, messages[:last], "test", record.get("tools"), record.get("chat_template_kwargs"))
        assert tokenizer.encode_text(text) == chat["prompt_ids"]


def test_qwen3s_enable_thinking_reaches_the_template_as_transformers_passes_it(tmp_path):
    """data.chat_template_kwargs for every chat, a record's own chat_template_kwargs (TRL's field) over them, in
    the store and in generate --chat: the prompt ids are transformers' with enable_thinking=False."""
    from seqjax.main.generate import chat_prompts

    records = [json.loads(line) for line in (DATA / "qwen3" / "chats.jsonl").read_text().splitlines()]
    assert sum("chat_template_kwargs" in r for r in records) == 2
    for extra, key in (((), "prompt_ids"), (("data.chat_template_kwargs={enable_thinking: false}",),
                                            "no_thinking_prompt_ids")):
        config, chats = family_config("qwen3", tmp_path, *extra)
        tokenizer = Tokenizer(config.tokenizer.path, config.tokenizer.special_tokens[0], config.tokenizer.bos_token)
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({**r, "messages": r["messages"][:max(
            i for i, m in enumerate(r["messages"]) if m["role"] == "assistant")]}) + "\n" for r in records))
        texts, ids, images, _ = chat_prompts(str(prompts), config, tokenizer)
        assert [tokenizer.encode_text(t) for t in texts] == ids == [chat[key] for chat in chats] and images is None
        store = prepare(config, splits=("train",)).stores["train"]
        assert [store.doc_sequence(i).tolist() for i in range(len(chats))] == [chat["ids"] for chat in chats]
    assert chats[0]["prompt_ids"] != chats[0]["no_thinking_prompt_ids"]


def test_template_variables_seqjax_passes_itself_are_refused_in_one_line(tmp_path):
    from seqjax.config.tree import ConfigError
    from seqjax.core.errors import CorpusError

    with pytest.raises(ConfigError, match="data.chat_template_kwargs: got 'tools', which seqjax itself passes"):
        family_config("qwen3", tmp_path, "data.chat_template_kwargs={tools: []}")
    bad = tmp_path / "bad.jsonl"
    record = json.loads((DATA / "qwen3" / "chats.jsonl").read_text().splitlines()[0])
    bad.write_text(json.dumps({**record, "chat_template_kwargs": ["enable_thinking"]}) + "\n")
    config, _ = family_config("qwen3", tmp_path, f"data.train_files=[{bad}]", f"data.cache_dir={tmp_path / 'c2'}")
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: field 'chat_template_kwargs' is list; expected an object"):
        prepare(config, splits=("train",))
