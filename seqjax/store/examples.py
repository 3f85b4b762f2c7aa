"""Instruction examples -> token ids plus a scored-token mask: prompt/completion pairs, chats, pre-tokenized rows.

``data.format`` says what one record of a jsonl/parquet/hf corpus is:

- ``prompt_completion``: ``{prompt, completion}``. The ids are ``[bos] + prompt +
  (prompt_separator + completion) + [eos]``, the bos only for a tokenizer that
  opens text with one (``tokenizer.bos_token``, e.g. an imported Llama's). Prompt
  and completion are encoded separately, so their boundary is a token boundary.
- ``chat``: ``{messages: [{role, content}, ...], tools: [...]}`` rendered with
  the chat template the way transformers renders it: a sandboxed Jinja
  environment with ``trim_blocks`` and ``lstrip_blocks``, ``bos_token`` /
  ``eos_token``, ``tools`` (the record's tool definitions, if any: JSON schemas,
  or JSON text of a list of them), ``raise_exception`` and a ``tojson`` that
  keeps non-ASCII text. The text is then encoded as one string, special tokens
  recognized, none added.
- ``tokenized``: ``{input_ids, labels}`` (-100: not scored, HF's convention) or
  ``{input_ids, loss_weights}`` (0/1), the forms lmms-engine and Levanter hand
  over; ``labels[i]`` / ``loss_weights[i]`` is about token ``i`` as a target.

**What is scored** (``data.loss_on``). ``completion``: the completion and its
eos. ``assistant``: every assistant message; ``last_assistant``: the last one;
``all``: every token. Assistant spans come from the template's
``{% generation %}`` blocks when it has them. A template without them (the
official ones) is scored as its *twin* marks the chat, when one of the training
templates seqjax ships renders that chat to the same text (Qwen3's official
template has ``qwen3``: :func:`twin_template`). Otherwise they come from rendering
the chat one message at a time: the span of assistant message ``k`` is what
``messages[:k + 1]`` adds to ``messages[:k]`` rendered with the generation
prompt (so the ``assistant`` header is not scored, its end-of-turn token is).
A template under which a shorter chat's text is not a prefix of the longer one's
(it rewrites earlier turns) is refused, naming the template and the turn.

Character spans become token masks through the tokenizer's offsets: **a token
is scored when any of its characters is** (transformers' assistant mask does
the same: a token straddling a boundary is in). An example with no scored token
is dropped and counted.

**Framing.** The store separates examples with its end-of-text token (EOT,
:mod:`seqjax.store.reader`), which also opens the next one. So an example's
leading token is dropped when it *is* that token (it would be doubled), and a
trailing one becomes the example's closing separator, keeping its weight. For
a tokenizer whose EOT is ``<|endoftext|>`` the example ``[EOT] p p c c [EOT]``
is stored as ``p p c c`` + closing EOT with weights ``0 0 1 1`` + ``1``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seqjax.config.tree import Config, SourceConfig
from seqjax.core.errors import CorpusError

log = logging.getLogger(__name__)

# Private-use characters that mark a {% generation %} block's output while a template renders.
OPEN_MARK, CLOSE_MARK = "\ue000", "\ue001"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_FILES = (CHAT_TEMPLATE_FILE, "tokenizer_config.json")
NOT_SCORED = -100  # HF's label for a token the loss skips


@dataclass(frozen=True)
class ExampleSpec:
    """How one source's records become examples: picklable, so tokenizer processes take it whole."""

    format: str
    loss_on: str  # resolved: completion / assistant / last_assistant / all / labels
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    prompt_separator: str = ""
    messages_field: str = "messages"
    tools_field: str = "tools"
    input_ids_field: str = "input_ids"
    labels_field: str = "labels"
    loss_weights_field: str = "loss_weights"
    chat_template: str | None = None
    template_name: str = ""
    bos_token: str | None = None
    eos_token: str = "<|endoftext|>"
    weights_dtype: str = "uint8"  # data.loss_weights_dtype: how the store keeps each target's weight
    # A shipped training template that renders this template's chats the same text (:func:`twin_template`): a
    # template without generation blocks is scored as its twin marks each chat it renders identically.
    twin: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The record fields read, the required one first."""
        return {
            "prompt_completion": (self.prompt_field, self.completion_field),
            "chat": (self.messages_field, self.tools_field),
            "tokenized": (self.input_ids_field, self.labels_field, self.loss_weights_field),
        }[self.format]

    def identity(self) -> dict[str, Any]:
        """What the store's cache key takes from the spec: everything that changes the ids or the mask."""
        return {k: v for k, v in self.__dict__.items()}


def example_spec(config: Config, source: SourceConfig, tokenizer_path: Path | None,
                 eot_token: str) -> ExampleSpec | None:
    """The spec of ``source``'s records, or None for text; the chat template is read now (a missing one is one line)."""
    if source.format == "text":
        return None
    d = config.data
    loss_on = d.loss_on
    if loss_on == "auto":
        loss_on = {"prompt_completion": "completion", "chat": "assistant", "tokenized": "labels"}[source.format]
    template, name, twin = None, "", None
    if source.format == "chat":
        template, name = chat_template(d.chat_template, tokenizer_path)
        twin = twin_template(template, config.tokenizer.bos_token, eot_token)
        if twin is not None:
            log.info(f"the chat template {name} has no {{% generation %}} blocks; its chats are scored as seqjax's "
                     f"{twin} template marks them wherever that renders them the same (docs/instruction.md)")
    return ExampleSpec(
        format=source.format, loss_on=loss_on, prompt_field=d.prompt_field, completion_field=d.completion_field,
        prompt_separator=d.prompt_separator, messages_field=d.messages_field, tools_field=d.tools_field,
        input_ids_field=d.input_ids_field,
        labels_field=d.labels_field, loss_weights_field=d.loss_weights_field, chat_template=template,
        template_name=name, bos_token=config.tokenizer.bos_token, eos_token=eot_token,
        weights_dtype=d.loss_weights_dtype, twin=twin)


def find_chat_template(tokenizer_path: Path, configured: str | None = None) -> str | None:
    """The chat template a run uses with this tokenizer (``data.chat_template`` first), or None when there is none.

    Runs, imports and exports carry it beside their ``tokenizer.json`` as
    ``chat_template.jinja`` (exports also inside ``tokenizer_config.json``, where transformers reads it).
    """
    try:
        return chat_template(configured, tokenizer_path)[0]
    except CorpusError:
        return None


# Training templates seqjax ships, by name (data.chat_template=qwen3): each family's chat format with
# {% generation %} blocks, so assistant-only loss needs no prefix rendering (docs/instruction.md, "Templates").
SHIPPED_TEMPLATES = {"chatml": "chatml.jinja", "qwen3": "qwen3.jinja", "gemma": "gemma.jinja"}


@functools.cache
def shipped_template(name: str) -> str:
    return (Path(__file__).parent / "chat_templates" / SHIPPED_TEMPLATES[name]).read_text(encoding="utf-8")


def chat_template(path: str | None, tokenizer_path: Path | None) -> tuple[str, str]:
    """``(template text, where it came from)``: ``data.chat_template`` (a shipped template's name, or a file), else
    beside the tokenizer.json."""
    if path in SHIPPED_TEMPLATES:
        return shipped_template(path), f"{path} (seqjax's {SHIPPED_TEMPLATES[path]})"
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise CorpusError(f"data.chat_template: {file} not found; expected a Jinja chat template file or one of "
                              f"{', '.join(SHIPPED_TEMPLATES)}")
        return file.read_text(encoding="utf-8"), str(file)
    folder = tokenizer_path.parent if tokenizer_path is not None else None
    if folder is not None and (folder / TEMPLATE_FILES[0]).is_file():
        return (folder / TEMPLATE_FILES[0]).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILES[0])
    if folder is not None and (folder / TEMPLATE_FILES[1]).is_file():
        try:
            found = json.loads((folder / TEMPLATE_FILES[1]).read_text(encoding="utf-8")).get("chat_template")
        except ValueError as err:
            raise CorpusError(f"{folder / TEMPLATE_FILES[1]}: not valid JSON ({err})") from None
        if isinstance(found, list):  # named templates: transformers uses "default"
            found = next((t.get("template") for t in found if t.get("name") == "default"), None)
        if isinstance(found, str):
            return found, f"{folder / TEMPLATE_FILES[1]} (chat_template)"
    where = f" beside {tokenizer_path}" if tokenizer_path is not None else ""
    raise CorpusError(f"data.format=chat: no chat template: data.chat_template is null and there is no "
                      f"{' or '.join(TEMPLATE_FILES)} with a chat_template{where}; set data.chat_template to a file")


# ---------------------------------------------------------------------------
# Rendering chats


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    class GenerationMarks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the block's output, between two marker characters."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return OPEN_MARK + caller() + CLOSE_MARK

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    return env.from_string(template)


def has_generation_blocks(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


# Chats a template and its twin must render alike: one exchange; a system prompt and two exchanges whose answers
# carry reasoning both ways (Qwen3's official template drops the first answer's, and renders the second's).
_PROBES = (
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "a2", "reasoning_content": "r2"}],
)


@functools.lru_cache(maxsize=8)
def twin_template(template: str, bos_token: str | None, eos_token: str) -> str | None:
    """The name of the shipped training template that renders every probe chat as ``template`` does, or None.

    Official templates carry no ``{% generation %}`` blocks, and Qwen3's rewrites earlier turns, so neither says
    by itself which tokens are an answer. Its twin does: where it renders a chat to the same text, its blocks are
    the answers' spans in that text. TRL patches such a template by recognising its exact text; a twin is found by
    what it renders instead, so any copy that renders alike qualifies, and each chat is checked again
    (:func:`chat_spans`).
    """
    if has_generation_blocks(template):
        return None
    for name in SHIPPED_TEMPLATES:
        mine = ExampleSpec(format="chat", loss_on="assistant", chat_template=template, bos_token=bos_token,
                           eos_token=eos_token)
        twin = dataclasses.replace(mine, chat_template=shipped_template(name))
        try:
            if all(render_chat(mine, p)[0] == render_chat(twin, p)[0] for p in _PROBES):
                return name
        except jinja2.exceptions.TemplateError:
            continue
    return None


def render_chat(spec: ExampleSpec, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None) -> tuple[str, list]:
    """``(text, generation spans)`` of ``messages`` (and the chat's ``tools``) under the spec's template, the spans
    from its generation blocks."""
    raw = _compiled(spec.chat_template).render(messages=messages, tools=tools,
                                               add_generation_prompt=add_generation_prompt,
                                               bos_token=spec.bos_token or "", eos_token=spec.eos_token)
    spans, text, at = [], [], 0
    for piece in re.split(f"([{OPEN_MARK}{CLOSE_MARK}])", raw):
        if piece == OPEN_MARK:
            spans.append([at, at])
        elif piece == CLOSE_MARK:
            spans[-1][1] = at
        else:
            text.append(piece)
            at += len(piece)
    return "".join(text), [tuple(s) for s in spans]


def _render(spec: ExampleSpec, messages: list[dict], where: str, generation_prompt: bool = False,
            tools: list[dict] | None = None):
    try:
        return render_chat(spec, messages, generation_prompt, tools)
    except jinja2.exceptions.TemplateError as err:
        raise CorpusError(f"{where}: the chat template {spec.template_name} failed on {len(messages)} message(s): "
                          f"{err}") from None


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise CorpusError(f"{where}: {field!r} must be a non-empty list of {{role, content}} objects "
                          "with string values")
    if any(OPEN_MARK in m["content"] or CLOSE_MARK in m["content"] for m in messages):
        raise CorpusError(f"{where}: a message holds U+E000 or U+E001, which mark generation blocks")


def chat_tools(spec: ExampleSpec, tools: Any, where: str) -> list[dict] | None:
    """A chat's tool definitions as the template takes them: a list of objects (JSON text of one is read), or None."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as err:
            raise CorpusError(f"{where}: field {spec.tools_field!r} is text but not JSON ({err}); expected a list of "
                              "tool definitions (JSON schemas)") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise CorpusError(f"{where}: field {spec.tools_field!r} is {type(tools).__name__}; expected a list of tool "
                          "definitions (JSON schemas) or JSON text of one")
    return tools or None


def chat_prompt(spec: ExampleSpec, messages: Any, where: str, tools: Any = None) -> str:
    """``messages`` rendered with the generation prompt (the assistant's turn opened), for generation."""
    _check_messages(messages, where, spec.messages_field)
    return _render(spec, messages, where, True, chat_tools(spec, tools, where))[0]


def end_of_turn(spec: ExampleSpec, tokenizer) -> int | None:
    """The special token the template closes an assistant turn with (``<|im_end|>``, ``<end_of_turn>``, ``</s>``),
    read from a rendering of one exchange: the first token after the reply. None if none follows it."""
    reply = "seqjax-reply-7f3a"  # a text no template writes itself
    text = _render(spec, [{"role": "user", "content": "question"}, {"role": "assistant", "content": reply}],
                   "the chat template's end of turn")[0]
    after = text[text.rfind(reply) + len(reply):] if reply in text else ""
    ids = tokenizer.encode_with_offsets(after)[0] if after else []
    return ids[0] if ids and tokenizer.is_special(ids[0]) else None


def chat_spans(spec: ExampleSpec, messages: Any, where: str, tools: Any = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its scored assistant messages (``data.loss_on``)."""
    _check_messages(messages, where, spec.messages_field)
    tools = chat_tools(spec, tools, where)
    text, marked = _render(spec, messages, where, tools=tools)
    if spec.loss_on == "all":
        return text, [(0, len(text))]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if has_generation_blocks(spec.chat_template):
        spans = marked
        if len(spans) != len(turns):
            raise CorpusError(f"{where}: the chat template {spec.template_name} marks {len(spans)} generation "
                              f"block(s) for {len(turns)} assistant message(s); expected one per assistant message")
    else:
        spans = _twin_spans(spec, messages, tools, text, len(turns)) if spec.twin else None
        if spans is None:
            spans = [_prefix_span(spec, messages, tools, k, text, where) for k in turns]
    return text, spans[-1:] if spec.loss_on == "last_assistant" else spans


def _twin_spans(spec: ExampleSpec, messages: list[dict], tools: list[dict] | None, text: str,
                n_turns: int) -> list[tuple[int, int]] | None:
    """The answers' spans as the spec's twin marks them, when the twin renders ``messages`` to ``text`` too."""
    try:
        twin = dataclasses.replace(spec, chat_template=shipped_template(spec.twin))
        twin_text, spans = render_chat(twin, messages, tools=tools)
    except jinja2.exceptions.TemplateError:
        return None
    return spans if twin_text == text and len(spans) == n_turns else None


def _prefix_span(spec: ExampleSpec, messages: list[dict], tools: list[dict] | None, k: int, text: str,
                 where: str) -> tuple[int, int]:
    """Assistant message ``k``'s span: what ``messages[:k + 1]`` adds to ``messages[:k]`` with the generation prompt."""
    try:
        before = _render(spec, messages[:k], where, True, tools)[0] if k else ""
    except CorpusError:
        before = ""  # a template that cannot render an empty chat: the turn starts the text
    upto = _render(spec, messages[: k + 1], where, tools=tools)[0]
    if not upto.startswith(before) or not text.startswith(upto):
        raise CorpusError(
            f"{where}: the chat template {spec.template_name} rewrites earlier turns: rendered up to "
            f"message {k} (assistant) it is not a prefix of the longer chat, so the assistant's tokens "
            "cannot be found; use a template with {% generation %} blocks: data.chat_template=qwen3 (Qwen3), "
            "chatml (Qwen2.5), gemma (Gemma 2/3), or a file of your own")
    return len(before), len(upto)


def char_spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (character ``offsets[i] = (start, end)``) that shares a character with a span.

    A token straddling a span's edge is scored: ``offsets [(0, 3), (3, 6)]``
    with the span ``(5, 9)`` gives ``[0, 1]``.
    """
    mask = np.zeros(len(offsets), np.uint8)
    if len(offsets):
        starts, ends = offsets[:, 0], offsets[:, 1]
        for a, b in spans:
            mask |= ((starts < b) & (ends > a) & (b > a)).astype(np.uint8)
    return mask


def _scored_bytes(text: str, offsets: np.ndarray, mask: np.ndarray) -> int:
    covered = np.zeros(len(text) + 1, np.int64)
    for s, e in offsets[mask.astype(bool)]:
        covered[s] += 1
        covered[e] -= 1
    inside = np.cumsum(covered)[:-1] > 0
    return len("".join(c for c, keep in zip(text, inside) if keep).encode("utf-8"))


# ---------------------------------------------------------------------------
# Records -> ids and mask


@dataclass
class Example:
    """One example as the store keeps it: ids without the separators, their weights, the closing EOT's weight."""

    ids: np.ndarray
    mask: np.ndarray
    close: float
    bytes: int
    scored_bytes: int

    @property
    def scored(self) -> int:
        """Targets with a weight above 0 (a count, whatever the weights are)."""
        return int(np.count_nonzero(self.mask)) + int(self.close != 0)


def _text_ids(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode_with_offsets(text)
    return np.asarray(encoding[0], np.int64), np.asarray(encoding[1], np.int64).reshape(-1, 2)


def encode_example(spec: ExampleSpec, tokenizer, record: dict, where: str) -> Example:
    """One record as ids and mask (before framing); a bad record is one line naming ``where`` and the field."""
    if spec.format == "prompt_completion":
        prompt, completion = (record.get(f) for f in spec.fields)
        for name, value in zip(spec.fields, (prompt, completion)):
            if not isinstance(value, str):
                raise CorpusError(f"{where}: field {name!r} is {type(value).__name__}, expected a string")
        head = [tokenizer.token_id(spec.bos_token)] if spec.bos_token else []
        p_ids = np.asarray(head + tokenizer.encode_text(prompt), np.int64)
        answer = spec.prompt_separator + completion
        c_ids = np.asarray(tokenizer.encode_text(answer) + [tokenizer.token_id(spec.eos_token)], np.int64)
        ids = np.concatenate([p_ids, c_ids])
        mask = np.concatenate([np.full(len(p_ids), spec.loss_on == "all"), np.ones(len(c_ids))]).astype(np.uint8)
        scored_bytes = len(answer.encode("utf-8")) if spec.loss_on != "all" else len((prompt + answer).encode())
        return Example(ids, mask, 0, len((prompt + answer).encode("utf-8")), scored_bytes)
    if spec.format == "chat":
        text, spans = chat_spans(spec, record.get(spec.messages_field), where, record.get(spec.tools_field))
        ids, offsets = _text_ids(tokenizer, text)
        mask = char_spans_to_mask(offsets, spans)
        return Example(ids, mask, 0, len(text.encode("utf-8")), _scored_bytes(text, offsets, mask))
    ids = record.get(spec.input_ids_field)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CorpusError(f"{where}: field {spec.input_ids_field!r} must be a non-empty list of integers")
    outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]  # in Python: an id past int64 cannot overflow
    if outside:
        raise CorpusError(f"{where}: {spec.input_ids_field!r} holds id {outside[0]}, outside the tokenizer's "
                          f"vocabulary of {tokenizer.vocab_size}")
    ids = np.asarray(ids, np.int64)
    if spec.loss_on == "all":
        mask = np.ones(len(ids), np.uint8)
    elif spec.labels_field in record:
        mask = labels_mask(spec, record[spec.labels_field], ids, where)
    elif spec.loss_weights_field in record:
        mask = loss_weights(spec, record[spec.loss_weights_field], len(ids), where)
    else:
        raise CorpusError(f"{where}: neither {spec.labels_field!r} nor {spec.loss_weights_field!r}; expected one of "
                          "them, or data.loss_on=all to score every token")
    text_bytes = len(tokenizer.decode(ids).encode("utf-8"))
    return Example(ids, mask, 0, text_bytes, len(tokenizer.decode(ids[mask.astype(bool)]).encode("utf-8")))


def labels_mask(spec: ExampleSpec, labels: Any, ids: np.ndarray, where: str) -> np.ndarray:
    """A tokenized record's ``labels`` as a 0/1 mask, HF's convention: at each position -100 (not scored) or the
    input id itself (scored; the model shifts it into place). Anything else is one line naming the position: a
    label of another token would otherwise be scored as if it were that position's own."""
    field = spec.labels_field
    integers = isinstance(labels, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in labels)
    if not integers or len(labels) != len(ids):
        raise CorpusError(f"{where}: field {field!r} must be a list of integers as long as {spec.input_ids_field!r} "
                          f"({len(ids)})")
    for position, (label, token) in enumerate(zip(labels, ids.tolist())):
        if label != NOT_SCORED and label != token:
            raise CorpusError(f"{where}: {field!r}[{position}] is {label}; expected {NOT_SCORED} (not scored) or the "
                              f"input id at that position ({token})")
    return (np.asarray(labels, np.int64) != NOT_SCORED).astype(np.uint8)


def loss_weights(spec: ExampleSpec, weights: Any, n: int, where: str) -> np.ndarray:
    """A tokenized record's ``loss_weights`` as the store keeps them; anything else is one line naming the record.

    Under ``data.loss_weights_dtype=uint8`` they must be 0/1 (or booleans);
    ``float32`` keeps any finite weight >= 0 (Levanter's prebuilt form carries 0.1 and 1.0, for instance).
    """
    field = spec.loss_weights_field
    numbers = isinstance(weights, list) and all(isinstance(w, (int, float)) and abs(w) < 1e300 for w in weights)
    if not numbers or len(weights) != n:
        raise CorpusError(f"{where}: field {field!r} must be a list of numbers as long as {spec.input_ids_field!r} "
                          f"({n})")
    values = np.asarray(weights, np.float64)
    bad = values[~(np.isfinite(values) & (values >= 0))]
    if len(bad):
        raise CorpusError(f"{where}: field {field!r} holds {float(bad[0])}; expected weights >= 0")
    if spec.weights_dtype == "uint8" and not np.all((values == 0) | (values == 1)):
        bad = float(values[(values != 0) & (values != 1)][0])
        raise CorpusError(f"{where}: field {field!r} holds {bad}; data.loss_weights_dtype=uint8 keeps 0/1 weights "
                          "only (set data.loss_weights_dtype=float32 to keep fractional ones)")
    return values.astype(spec.weights_dtype)


def framed(example: Example, separator: int) -> Example:
    """The example as stored between separators: a leading separator dropped, a trailing one made the closing one."""
    ids, mask, close = example.ids, example.mask, 0
    if len(ids) and ids[0] == separator:
        ids, mask = ids[1:], mask[1:]
    if len(ids) and ids[-1] == separator:
        ids, mask, close = ids[:-1], mask[:-1], mask[-1].item()
    return Example(ids, mask, close, example.bytes, example.scored_bytes)
