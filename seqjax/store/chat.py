"""Chat templates: found, rendered as transformers renders them, and the character spans of what is
scored.

A template renders in a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
``bos_token`` / ``eos_token``, ``tools``, ``raise_exception`` and a ``tojson`` that keeps non-ASCII
text, as transformers' ``apply_chat_template`` does. Assistant spans come from the template's ``{%
generation %}`` blocks, from its twin (a shipped template that renders the chat the same), or from
rendering the chat a message at a time (docs/instruction.md; :mod:`seqjax.store.examples` turns the
spans into a token mask).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from seqjax.config.data import TEMPLATE_VARIABLES
from seqjax.core.errors import CorpusError
from seqjax.core.files import read_utf8
from seqjax.store.spec import KWARGS_FIELD, TEMPLATE_FILES, ExampleSpec

log = logging.getLogger(__name__)

# Private-use characters that mark a {% generation %} block's output while a template renders.
OPEN_MARK, CLOSE_MARK = "\ue000", "\ue001"


def find_chat_template(tokenizer_path: Path, configured: str | None = None) -> str | None:
    """The chat template a run uses with this tokenizer (``data.chat_template`` first), or None when
    there is none.

    Runs, imports and exports carry it beside their ``tokenizer.json`` as ``chat_template.jinja``
    (exports also inside ``tokenizer_config.json``, where transformers reads it).
    """
    try:
        return chat_template(configured, tokenizer_path)[0]
    except CorpusError:
        return None


# Training templates seqjax ships, by name (data.chat_template=qwen3): each family's chat format
# with {% generation %} blocks, so assistant-only loss needs no prefix rendering
# (docs/instruction.md, "Templates").
SHIPPED_TEMPLATES = {"chatml": "chatml.jinja", "qwen3": "qwen3.jinja", "gemma": "gemma.jinja",
                     "qwen3_vl": "qwen3_vl.jinja", "qwen2_5_vl": "qwen2_5_vl.jinja"}


@functools.cache
def shipped_template(name: str) -> str:
    return (Path(__file__).parent / "chat_templates" /
            SHIPPED_TEMPLATES[name]).read_text(encoding="utf-8")


def chat_template(path: str | None, tokenizer_path: Path | None,
                  required: bool = True) -> tuple[str | None, str]:
    """``(template text, where it came from)``: ``data.chat_template`` (a shipped template's name,
    or a file), else beside the tokenizer.json; ``(None, "")`` when there is none and it is not
    ``required`` (preference pairs of plain text need none)."""
    if path in SHIPPED_TEMPLATES:
        return shipped_template(path), f"{path} (seqjax's {SHIPPED_TEMPLATES[path]})"
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise CorpusError(
                f"data.chat_template: {file} not found; expected a Jinja chat template file or one "
                f"of {', '.join(SHIPPED_TEMPLATES)}")
        return read_utf8(file, CorpusError, "data.chat_template"), str(file)
    folder = tokenizer_path.parent if tokenizer_path is not None else None
    if folder is not None and (folder / TEMPLATE_FILES[0]).is_file():
        return read_utf8(folder / TEMPLATE_FILES[0], CorpusError), str(folder / TEMPLATE_FILES[0])
    for name in TEMPLATE_FILES[1:] if folder is not None else ():
        if (folder / name).is_file():
            found = _json_template(folder / name)
            if isinstance(found, str):
                return found, f"{folder / name} (chat_template)"
    if not required:
        return None, ""
    where = f" beside {tokenizer_path}" if tokenizer_path is not None else ""
    raise CorpusError(
        "data.format=chat: no chat template: data.chat_template is null and there is no "
        f"{' or '.join(TEMPLATE_FILES)} with a chat_template{where}; set data.chat_template to a "
        "file"
    )


def _json_template(file: Path) -> str | None:
    """The ``chat_template`` of a tokenizer_config.json or chat_template.json (transformers' named
    templates: the ``default`` one), or None."""
    text = read_utf8(file, CorpusError)
    try:  # (json's error is a ValueError, as every SeqjaxError is: read first, then parse)
        found = json.loads(text)
        found = found.get("chat_template") if isinstance(found, dict) else None
    except json.JSONDecodeError as err:
        raise CorpusError(f"{file}: not valid JSON ({err})") from None
    if isinstance(found, list):  # named templates: transformers uses "default"
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


# ---------------------------------------------------------------------------
# Rendering chats


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    class GenerationMarks(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: the block's output, between two marker
        characters."""

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
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationMarks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    return env.from_string(template)


def has_generation_blocks(template: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


# Chats a template and its twin must render alike: one exchange; a system prompt and two exchanges
# whose answers carry reasoning both ways (Qwen3's official template drops the first answer's, and
# renders the second's).
_PROBES = (
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "a2", "reasoning_content": "r2"}],
)


@functools.lru_cache(maxsize=8)
def twin_template(template: str, bos_token: str | None, eos_token: str) -> str | None:
    """The name of the shipped training template that renders every probe chat as ``template`` does,
    or None.

    Official templates carry no ``{% generation %}`` blocks, and Qwen3's rewrites earlier turns, so
    neither says by itself which tokens are an answer. Its twin does: where it renders a chat to the
    same text, its blocks are the answers' spans in that text. TRL patches such a template by
    recognising its exact text; a twin is found by what it renders instead, so any copy that renders
    alike qualifies, and each chat is checked again (:func:`chat_spans`).
    """
    if has_generation_blocks(template):
        return None
    for name in SHIPPED_TEMPLATES:
        mine = ExampleSpec(format="chat", loss_on="assistant", chat_template=template,
                           bos_token=bos_token, eos_token=eos_token)
        twin = dataclasses.replace(mine, chat_template=shipped_template(name))
        try:
            if all(render_chat(mine, p)[0] == render_chat(twin, p)[0] for p in _PROBES):
                return name
        except TEMPLATE_FAILURES:
            continue
    return None


# What rendering a template may raise: jinja2's own errors (the sandbox's SecurityError among them), and what
# the sandbox and the template's Python raise at run time (a range over its limit is an OverflowError, a bad
# index a LookupError, ...): each is one line naming the template, never a traceback.
TEMPLATE_FAILURES = (jinja2.exceptions.TemplateError, OverflowError, ArithmeticError, TypeError, ValueError,
                     LookupError, AttributeError, RecursionError)


def render_chat(spec: ExampleSpec, messages: list[dict], add_generation_prompt: bool = False,
                tools: list[dict] | None = None, kwargs: dict | None = None) -> tuple[str, list]:
    """``(text, generation spans)`` of ``messages`` (and the chat's ``tools`` and template
    variables ``kwargs``, by default the spec's) under the spec's template, the spans from its
    generation blocks."""
    variables = json.loads(spec.template_kwargs) if kwargs is None else kwargs
    raw = _compiled(spec.chat_template).render(messages=messages, tools=tools,
                                               add_generation_prompt=add_generation_prompt,
                                               bos_token=spec.bos_token or "", eos_token=spec.eos_token,
                                               **variables)
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
            tools: list[dict] | None = None, kwargs: dict | None = None):
    try:
        return render_chat(spec, messages, generation_prompt, tools, kwargs)
    except TEMPLATE_FAILURES as err:
        raise CorpusError(
            f"{where}: the chat template {spec.template_name} failed on {len(messages)} "
            "message(s): "
            f"{'' if isinstance(err, jinja2.exceptions.TemplateError) else type(err).__name__ + ': '}{err}") from None


def _valid_message(m: Any) -> bool:
    """A ``{role, content}`` object with string values, or content as a list of ``{type, ...}`` parts (text and
    images: :mod:`seqjax.store.image_chats`); an assistant turn that makes tool calls may have no
    content (null, or no key), as OpenAI's and TRL's format writes it and transformers renders
    it."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    calls, content = m.get("tool_calls"), m.get("content")
    parts = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)
    return isinstance(content, str) or parts or (content is None and isinstance(calls, list) and calls)


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages or not all(map(_valid_message, messages)):
        raise CorpusError(f"{where}: {field!r} must be a non-empty list of {{role, content}} objects "
                          "with string values or lists of {type, ...} parts (an assistant turn with tool_calls may "
                          "have no content)")
    if any(OPEN_MARK in (m.get("content") or "") or CLOSE_MARK in (m.get("content") or "")
           for m in messages):
        raise CorpusError(f"{where}: a message holds U+E000 or U+E001, which mark generation "
                          "blocks")


def chat_tools(spec: ExampleSpec, tools: Any, where: str) -> list[dict] | None:
    """A chat's tool definitions as the template takes them: a list of objects (JSON text of one is
    read), or None."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as err:
            raise CorpusError(
                f"{where}: field {spec.tools_field!r} is text but not JSON ({err}); expected a "
                "list of tool definitions (JSON schemas)") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise CorpusError(
            f"{where}: field {spec.tools_field!r} is {type(tools).__name__}; expected a list of "
            "tool definitions (JSON schemas) or JSON text of one")
    return tools or None


def chat_kwargs(spec: ExampleSpec, own: Any, where: str) -> dict:
    """The template variables of one chat: ``data.chat_template_kwargs`` with the record's own
    ``chat_template_kwargs`` (an object, or absent) over them."""
    if own is None:
        own = {}
    if not isinstance(own, dict):
        raise CorpusError(
            f"{where}: field {KWARGS_FIELD!r} is {type(own).__name__}; expected an object of "
            "template variables (such as {\"enable_thinking\": false})")
    taken = sorted(set(own) & set(TEMPLATE_VARIABLES))
    if taken:
        raise CorpusError(
            f"{where}: field {KWARGS_FIELD!r} sets {taken[0]!r}, which seqjax itself passes the "
            "template; expected other names")
    return {**json.loads(spec.template_kwargs), **own}


def chat_prompt(spec: ExampleSpec, messages: Any, where: str, tools: Any = None,
                kwargs: Any = None) -> str:
    """``messages`` rendered with the generation prompt (the assistant's turn opened), for
    generation; ``kwargs``: the chat's own template variables."""
    _check_messages(messages, where, spec.messages_field)
    return _render(spec, messages, where, True, chat_tools(spec, tools, where),
                   chat_kwargs(spec, kwargs, where))[0]


def chat_text(spec: ExampleSpec, messages: Any, where: str, generation_prompt: bool = False,
              tools: Any = None, kwargs: Any = None) -> str:
    """``messages`` rendered as ``apply_chat_template(messages, tools=..., **kwargs)`` renders them
    (checked first; one line naming ``where`` for a bad message or a template that fails)."""
    _check_messages(messages, where, spec.messages_field)
    return _render(spec, messages, where, generation_prompt, chat_tools(spec, tools, where),
                   chat_kwargs(spec, kwargs, where))[0]


def end_of_turn(spec: ExampleSpec, tokenizer) -> int | None:
    """The special token the template closes an assistant turn with (``<|im_end|>``,
    ``<end_of_turn>``, ``</s>``), read from a rendering of one exchange: the first token after the
    reply. None if none follows it."""
    reply = "seqjax-reply-7f3a"  # a text no template writes itself
    text = _render(
        spec, [{"role": "user", "content": "question"}, {"role": "assistant", "content": reply}],
        "the chat template's end of turn")[0]
    after = text[text.rfind(reply) + len(reply):] if reply in text else ""
    ids = tokenizer.encode_with_offsets(after)[0] if after else []
    return ids[0] if ids and tokenizer.is_special(ids[0]) else None


def chat_spans(spec: ExampleSpec, messages: Any, where: str, tools: Any = None,
               kwargs: Any = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its scored assistant messages
    (``data.loss_on``); ``kwargs``: the chat's own template variables."""
    _check_messages(messages, where, spec.messages_field)
    tools = chat_tools(spec, tools, where)
    kwargs = chat_kwargs(spec, kwargs, where)
    text, marked = _render(spec, messages, where, tools=tools, kwargs=kwargs)
    if spec.loss_on == "all":
        return text, [(0, len(text))]
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if has_generation_blocks(spec.chat_template):
        spans = marked
        if len(spans) != len(turns):
            raise CorpusError(
                f"{where}: the chat template {spec.template_name} marks {len(spans)} generation "
                f"block(s) for {len(turns)} assistant message(s); expected one per assistant "
                "message"
            )
    else:
        spans = _twin_spans(spec, messages, tools, kwargs, text, len(turns)) if spec.twin else None
        if spans is None:
            spans = [_prefix_span(spec, messages, tools, kwargs, k, text, where) for k in turns]
    return text, spans[-1:] if spec.loss_on == "last_assistant" else spans


def _twin_spans(spec: ExampleSpec, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                text: str, n_turns: int) -> list[tuple[int, int]] | None:
    """The answers' spans as the spec's twin marks them, when the twin renders ``messages`` to
    ``text`` too."""
    try:
        twin = dataclasses.replace(spec, chat_template=shipped_template(spec.twin))
        twin_text, spans = render_chat(twin, messages, tools=tools, kwargs=kwargs)
    except TEMPLATE_FAILURES:
        return None
    return spans if twin_text == text and len(spans) == n_turns else None


def _prefix_span(spec: ExampleSpec, messages: list[dict], tools: list[dict] | None, kwargs: dict,
                 k: int, text: str, where: str) -> tuple[int, int]:
    """Assistant message ``k``'s span: what ``messages[:k + 1]`` adds to ``messages[:k]`` with the
    generation prompt."""
    try:
        before = _render(spec, messages[:k], where, True, tools, kwargs)[0] if k else ""
    except CorpusError:
        before = ""  # a template that cannot render an empty chat: the turn starts the text
    upto = _render(spec, messages[: k + 1], where, tools=tools, kwargs=kwargs)[0]
    if not upto.startswith(before) or not text.startswith(upto):
        raise CorpusError(
            f"{where}: the chat template {spec.template_name} rewrites earlier turns: rendered up to "
            f"message {k} (assistant) it is not a prefix of the longer chat, so the assistant's tokens "
            "cannot be found; use a template with {% generation %} blocks: data.chat_template=qwen3 (Qwen3), "
            "chatml (Qwen2.5), gemma (Gemma 2/3), or a file of your own")
    return len(before), len(upto)
