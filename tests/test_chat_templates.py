"""The training templates seqjax ships (data.chat_template=chatml|qwen3|gemma|qwen3_vl|qwen2_5_vl):
what each renders, which tokens it scores, and a Qwen3 model fine-tuned packed on chats under
Qwen3's official template, sliding layers and all.

The references are the models' official templates (Qwen2.5, Qwen3, Gemma 3), as TRL 1.16 ships
copies of them (TRL patches a template by comparing its text with these copies, so they are the
models' own), rendered by transformers itself: each shipped template must render every chat to the
same text. scripts/setup.sh installs TRL's package without its dependencies (nothing of TRL is
imported: only the .jinja files are read).

A template that drops earlier turns' reasoning when it renders a later turn (Qwen3's official one
does) cannot be scored by prefix rendering; it trains through its twin, the shipped template that
renders the same text, and a rewriting template without a twin is refused with a pointer to the
shipped ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import SourceConfig
from seqjax.core.errors import CorpusError
from seqjax.main.generate import read_chats
from seqjax.store.build import prepare
from seqjax.store.chat import chat_prompt, chat_spans, chat_template, render_chat, twin_template
from seqjax.store.corpus import file_records
from seqjax.store.examples import ExampleSpec, encode_example
from seqjax.store.tokenizer import Tokenizer, train_tokenizer
from test_families import hf_folder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<bos>", "<start_of_turn>",
            "<end_of_turn>"]
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nsat on a mat"},
        {"role": "user", "content": "and the dog"},
        {"role": "assistant", "content": "ran far", "reasoning_content": "second thought"}]


def spec(name: str, template: str | None = None) -> ExampleSpec:
    text, where = (template, "official") if template else chat_template(name, None)
    return ExampleSpec(format="chat", loss_on="assistant", chat_template=text, template_name=where,
                       bos_token="<bos>", eos_token="<|endoftext|>",
                       twin=twin_template(text, "<bos>", "<|endoftext|>") if template else None)


# seqjax's template -> the official template it renders as (TRL 1.16's copy,
# trl/chat_templates/NAME.jinja)
OFFICIAL = {"qwen3": "qwen3", "chatml": "qwen2_5", "gemma": "gemma3", "qwen3_vl": "qwen3_vl",
            "qwen2_5_vl": "qwen2_5_vl"}
VL = ("qwen3_vl", "qwen2_5_vl")


def official(name: str) -> str:
    # finds the package without importing it (TRL imports torch)
    found = importlib.util.find_spec("trl")
    file = Path(found.submodule_search_locations[0]) / "chat_templates" / f"{OFFICIAL[name]}.jinja" if found else None
    if file is None or not file.is_file():
        pytest.skip("the official chat templates come with TRL's package: scripts/setup.sh installs trl==1.16.0")
    return file.read_text(encoding="utf-8")


def transformers_render(template: str, messages: list[dict], generation_prompt: bool, tools=None, **kwargs) -> str:
    """``messages`` (and ``tools``, and template variables) rendered by transformers' own
    apply_chat_template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token="<bos>", eos_token="<|endoftext|>")
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=generation_prompt, tools=tools, **kwargs)


TEXT = st.lists(st.sampled_from(["a", " ", "\n", "<think>", "</think>", "<tool_response>", "</tool_response>"]),
                max_size=6).map("".join)
CALL = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                              "arguments": st.one_of(st.dictionaries(st.sampled_from("xy"), st.integers(0, 9)),
                                                     st.just('{"z": 1}'))})
# Tool definitions as datasets carry them: OpenAI's {"type": "function", "function": schema} or the
# bare schema, non-ASCII descriptions included (tojson keeps them).
SCHEMA = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "f"]),
                                "description": st.sampled_from(["", "Météo à Zürich", "a \"quoted\" tool"]),
                                "parameters": st.fixed_dictionaries({"type": st.just("object"), "properties":
                                                                     st.dictionaries(st.sampled_from("xy"),
                                                                                     st.just({"type": "string"}))})})
TOOLS = st.one_of(st.none(), st.lists(st.one_of(SCHEMA, SCHEMA.map(lambda f: {"type": "function", "function": f})),
                                      min_size=1, max_size=2))
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                             "parameters": {"type": "object", "properties": {"city": {}}}}}]


# A VL chat's content: text, or parts as TRL and transformers write them (an image or video by type
# or by key, text parts)
PART = st.one_of(st.just({"type": "image"}), st.just({"type": "image", "image": "a.png"}), st.just({"image": "b.png"}),
                 st.just({"type": "image_url", "image_url": {"url": "c.png"}}), st.just({"type": "video"}),
                 TEXT.map(lambda t: {"type": "text", "text": t}))


@st.composite
def chats(draw, template: str):
    """Chats as the template's family writes them: Gemma alternates user/assistant after an optional
    system message; Qwen chats mix every role, answers with reasoning (reasoning_content or a
    <think> prefix) and tool calls (arguments as objects or JSON text, bare or under "function"),
    tool results in a row; a VL chat's contents are text or lists of image, video and text parts."""
    content = st.one_of(TEXT, st.lists(PART, max_size=4)) if template in VL else TEXT
    system = [{"role": "system", "content": draw(content)}] if draw(st.booleans()) else []
    if template == "gemma":
        turns = draw(st.integers(1, 4))
        return system + [{"role": ("user", "assistant")[k % 2], "content": draw(TEXT)} for k in range(turns)]
    messages = []
    for role in draw(st.lists(st.sampled_from(["user", "assistant", "assistant", "tool", "system"]), min_size=1,
                              max_size=6)):
        message = {"role": role, "content": draw(content)}
        if role == "assistant" and draw(st.booleans()):
            message["reasoning_content"] = draw(TEXT)
        if role == "assistant" and draw(st.booleans()):
            message["tool_calls"] = [{"type": "function", "function": c} if draw(st.booleans()) else c
                                     for c in draw(st.lists(CALL, min_size=1, max_size=2))]
        messages.append(message)
    return system + messages


# Each branch of the official templates, drawn or not: answers after the last query with and without
# reasoning, tool calls with and without an answer, tool results in a row, a wrapped tool result in
# a user turn.
EDGES = [CHAT, CHAT[1:3],
         [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
          {"role": "assistant", "content": "a2"}, {"role": "assistant", "content": "a3", "reasoning_content": "r"},
          {"role": "assistant", "content": "\n\na4"}],
         [{"role": "user", "content": "q"},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
          {"role": "tool", "content": "6"}, {"role": "tool", "content": "7"},
          {"role": "user", "content": "<tool_response>8</tool_response>"},
          {"role": "assistant", "content": "b", "tool_calls": [{"name": "g", "arguments": {}}] * 2}]]


@pytest.mark.parametrize("name", list(OFFICIAL))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_each_shipped_template_renders_every_chat_as_the_official_one(name, data):
    messages, prompt, tools = data.draw(chats(name)), data.draw(st.booleans()), data.draw(TOOLS)
    kwargs = {"add_vision_id": data.draw(st.booleans())} if name in VL else {}
    assert render_chat(spec(name), messages, prompt, tools, kwargs)[0] == transformers_render(
        official(name), messages, prompt, tools, **kwargs)


@pytest.mark.parametrize("name", ["qwen3", "chatml"])
def test_each_branch_of_the_official_qwen_templates_renders_alike(name):
    for messages in EDGES:
        for prompt in (False, True):
            for tools in (None, WEATHER):
                assert render_chat(spec(name), messages, prompt, tools)[0] == transformers_render(
                    official(name), messages, prompt, tools)


def test_the_official_templates_train_through_their_twins():
    """The official templates, as found beside an imported model, are scored as the shipped twin
    marks them: Qwen3's, which rewrites earlier turns, included. A chat the twin renders differently
    is not scored by it."""
    for name in OFFICIAL:
        assert twin_template(official(name), "<bos>", "<|endoftext|>") == name
        chat = CHAT if name != "chatml" else CHAT[1:]
        for tools in (None, WEATHER):
            assert chat_spans(spec(name, official(name)), chat, "here", tools) == chat_spans(spec(name), chat, "here",
                                                                                             tools)
    qwen3 = spec("qwen3", official("qwen3"))
    assert "first thought" not in chat_spans(qwen3, CHAT, "here")[0]
    # a twin that renders otherwise is not used
    with pytest.raises(CorpusError, match="rewrites earlier turns"):
        chat_spans(dataclasses.replace(qwen3, twin="chatml"), CHAT, "here")
    gemma = spec("gemma", official("gemma"))
    with pytest.raises(CorpusError, match="roles must alternate"):
        chat_spans(gemma, CHAT[:2] + CHAT[3:], "here")


def scored(name: str, messages=CHAT) -> tuple[str, list[str]]:
    text, spans = chat_spans(spec(name), messages, "here")
    return text, [text[a:b] for a, b in spans]


def test_chatml_scores_each_answer_and_its_im_end():
    text, parts = scored("chatml", CHAT[1:])
    # Qwen2.5's default
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert parts == [CHAT[2]["content"] + "<|im_end|>", "ran far<|im_end|>"]
    assert "<|im_start|>assistant\n" + parts[1] + "\n" in text


def test_qwen3_keeps_only_the_last_turns_reasoning_and_scores_what_the_chat_shows():
    text, parts = scored("qwen3")
    assert "first thought" not in text  # an answer before the last user message loses its reasoning
    assert parts == ["sat on a mat<|im_end|>", "<think>\nsecond thought\n</think>\n\nran far<|im_end|>"]
    prompt = spec("qwen3")
    assert chat_prompt(prompt, CHAT[:4], "here").endswith("<|im_start|>user\nand the dog<|im_end|>\n"
                                                          "<|im_start|>assistant\n")


def test_gemma_folds_the_system_prompt_into_the_first_turn_and_scores_model_turns():
    text, parts = scored("gemma")
    assert text.startswith("<bos><start_of_turn>user\nbe brief\n\nthe cat<end_of_turn>\n<start_of_turn>model\n")
    assert parts == [CHAT[2]["content"] + "<end_of_turn>", "ran far<end_of_turn>"]


def test_a_records_tools_are_rendered_as_context_from_a_list_or_json_text_and_never_scored(tmp_path):
    """A chat record's tools (data.tools_field), read from a jsonl file as prepare reads it: the
    list and its JSON text give the same ids; the tools lengthen the text but add no scored token; a
    bad value is one line."""
    words = "the cat sat on a mat get_weather city Météo".split()
    train_tokenizer([" ".join(words)] * 20, tmp_path / "tokenizer.json", vocab_size=300, special_tokens=SPECIALS)
    tokenizer = Tokenizer(tmp_path / "tokenizer.json", "<|endoftext|>")
    chat = CHAT[1:3]
    records = [{"messages": chat, "tools": WEATHER}, {"messages": chat, "tools": json.dumps(WEATHER)},
               {"messages": chat}, {"messages": chat, "tools": 5}, {"messages": chat, "tools": "[oops"}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    qwen3 = spec("qwen3")
    read = list(file_records(SourceConfig(corpus="jsonl", format="chat"), tmp_path / "chats.jsonl", qwen3.fields))
    listed, texted, bare = (encode_example(qwen3, tokenizer, record, where) for where, record in read[:3])
    np.testing.assert_array_equal(listed.ids, texted.ids)
    np.testing.assert_array_equal(listed.mask, texted.mask)
    assert "get_weather" in tokenizer.decode(listed.ids) and len(listed.ids) > len(bare.ids) + 20
    np.testing.assert_array_equal(listed.ids[listed.mask.astype(bool)], bare.ids[bare.mask.astype(bool)])
    with pytest.raises(CorpusError, match=r"chats.jsonl:4: field 'tools' is int; expected a list of tool"):
        encode_example(qwen3, tokenizer, read[3][1], read[3][0])
    with pytest.raises(CorpusError, match=r"chats.jsonl:5: field 'tools' is text but not JSON"):
        encode_example(qwen3, tokenizer, read[4][1], read[4][0])


def test_generate_chat_prompts_carry_each_conversations_tools(tmp_path):
    """``generate --chat FILE.jsonl``: a line's tools reach the template, as in transformers'
    generation prompt."""
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CHAT[1:2], "tools": WEATHER}) + "\n"
                                          + json.dumps(CHAT[1:2]) + "\n")
    first, second = read_chats(str(tmp_path / "chats.jsonl"))
    with_tools, tools, plain, none = first["messages"], first.get("tools"), second["messages"], second.get("tools")
    assert tools == WEATHER and none is None and with_tools == plain == CHAT[1:2]
    for name in ("qwen3", "chatml"):
        prompt = chat_prompt(spec(name), with_tools, "here", tools)
        assert "<tools>\n" + json.dumps(WEATHER[0], ensure_ascii=False) + "\n</tools>" in prompt
        assert prompt == transformers_render(official(name), with_tools, True, tools)


def test_a_template_that_rewrites_earlier_turns_is_refused_pointing_at_the_shipped_one():
    # Qwen3-like: earlier answers lose their reasoning once a later turn is rendered; no generation
    # blocks
    rewriting = ("{%- for m in messages -%}{%- set c = m.content -%}{%- if m.role == 'assistant' and not loop.last "
                 "-%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
                 "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}")
    custom = ExampleSpec(format="chat", loss_on="assistant", chat_template=rewriting, template_name="mine",
                         eos_token="<|endoftext|>")
    with pytest.raises(CorpusError, match=r"rewrites earlier turns.*data.chat_template=qwen3"):
        chat_spans(custom, CHAT[1:], "here")


def test_an_unknown_template_name_or_file_is_one_line():
    with pytest.raises(CorpusError, match="data.chat_template: .*qwen4.* not found; expected a Jinja chat template "
                                          "file or one of chatml, qwen3, gemma, qwen3_vl, qwen2_5_vl"):
        chat_template("qwen4", None)


@pytest.mark.slow  # a two-step fine-tune in this process
def test_a_qwen3_model_fine_tunes_packed_on_chats_under_its_official_template(tmp_path):
    """The Qwen3 reference model (sliding layers from the second on) imported with Qwen3's official
    template in its tokenizer_config.json, fine-tuned on multi-turn chats with reasoning, packed,
    loss on the assistant turns only, half of them with tools, with no data.chat_template set: the
    store scores what data.chat_template=qwen3 scores, on the same text."""
    from seqjax.main import import_hf
    from seqjax.train.loop import train

    folder = hf_folder("qwen3", tmp_path / "qwen3")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat dog ran far away".split()
    train_tokenizer([" ".join(rng.choice(words, 10)) + "\n" for _ in range(100)], folder / "tokenizer.json",
                    vocab_size=300, special_tokens=SPECIALS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "chat_template": official("qwen3")}))
    import_hf.main([str(folder), "--out", str(tmp_path / "imported"), "model.attention=xla"])

    def say(n):
        return " ".join(rng.choice(words, n))

    chats = [{"messages": [{"role": "user", "content": say(3)},
                           {"role": "assistant", "content": f"<think>\n{say(2)}\n</think>\n\n{say(3)}"},
                           {"role": "user", "content": say(2)},
                           {"role": "assistant", "content": say(rng.integers(1, 4)), "reasoning_content": say(2)}],
              **({"tools": WEATHER} if k % 2 else {})}
             for k in range(40)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))

    def config(*more):
        return load_config(tmp_path / "imported" / "config.yaml", [
            f"train.init_from={tmp_path / 'imported'}", "data.corpus=jsonl", "data.format=chat",
            f"data.train_files=[{tmp_path / 'chats.jsonl'}]", f"data.valid_files=[{tmp_path / 'chats.jsonl'}]",
            "data.seq_len=64", "data.batch_size=4", "data.strategy=pack", "train.steps=2", "train.warmup_steps=0",
            "train.eval_every=0", f"run.dir={tmp_path / 'run'}", *more])

    official_run = config(f"data.cache_dir={tmp_path / 'cache'}")
    assert official_run.data.chat_template is None
    store = prepare(official_run, splits=("train",)).stores["train"]
    shipped = prepare(config(f"data.cache_dir={tmp_path / 'cache2'}", "data.chat_template=qwen3"),
                      splits=("train",)).stores["train"]
    ids, mask = np.asarray(store.tokens), np.asarray(store.mask).astype(bool)
    np.testing.assert_array_equal(ids, np.asarray(shipped.tokens))
    np.testing.assert_array_equal(mask, np.asarray(shipped.mask).astype(bool))
    assert 0 < mask.mean() < 0.6  # the answers (and <|im_end|>), not the prompts
    lengths = np.diff(np.asarray(store.doc_offsets))  # the store keeps the file's order
    # the tools' section, in the odd chats
    assert len(lengths) == 40 and lengths[1::2].min() > lengths[::2].max()
    summary = train(official_run)
    assert official_run.model.has_windows and summary["finished"] and np.isfinite(summary["val_loss"])
    assert summary["tokens_seen"] < 2 * 4 * 64 and ids.size > 0  # whole chats: rows end in padding
    jax.clear_caches()


@pytest.mark.parametrize("template, what", [
    ("{% for i in range(100000000) %}x{% endfor %}", "OverflowError: Range too big"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_a_template_the_sandbox_stops_is_one_line_naming_it(template, what):
    """Every refusal of jinja2's sandbox (a range over its limit) and every runtime error of a template is one
    CorpusError line naming the record and the template, never a traceback."""
    from seqjax.core.errors import CorpusError
    from seqjax.store.chat import _render
    from seqjax.store.spec import ExampleSpec

    spec = ExampleSpec(format="chat", loss_on="assistant", chat_template=template, template_name="loop")
    with pytest.raises(CorpusError, match=r"chats\.jsonl:3: the chat template loop failed on 1 message\(s\)") as err:
        _render(spec, [{"role": "user", "content": "hi"}], "chats.jsonl:3")
    assert what in str(err.value) and "\n" not in str(err.value)
