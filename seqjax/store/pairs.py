"""Preference records (``data.format=preference``) -> the two examples of a pair, tokenized as TRL
1.16's DPOTrainer tokenizes them.

A record holds ``prompt``, ``chosen`` and ``rejected`` (``data.prompt_field`` ...), either all text
(*standard*) or all lists of ``{role, content}`` messages (*conversational*, rendered by the run's
chat template with the record's ``tools`` and ``chat_template_kwargs``). Without a prompt it is
*implicit*: the longest common start of chosen and rejected (whole messages, or characters, a
trailing space left to the completions), as TRL's ``extract_prompt`` takes it.

The pair is stored as two examples, ``prompt + chosen`` then ``prompt + rejected``, each scored on
its completion only::

    prompt_ids  = tokenize(prompt)                          (conversational: with the generation prompt)
    chosen_seq  = tokenize(prompt + chosen)                 (standard: + EOS, unless chosen ends with it)
    n           = min(common_prefix(prompt_ids, chosen_seq), common_prefix(prompt_ids, rejected_seq))

and the completion is what follows the first ``n`` ids, TRL's rule when a template renders the
prompt alone differently from the prompt followed by an answer. ``tokenize`` is the tokenizer with
its own special tokens (a Llama tokenizer opens text with its BOS), as ``tokenizer(text)`` gives.

A pair whose chosen and rejected are the same, or whose completion is empty, is kept as TRL keeps
it, dropped or refused (``data.degenerate_pairs``); one that is not one of the two forms is one line
naming the record. ``data.pair_eos=always`` puts an EOS after every completion, as TRL's CPO and
ORPO trainers do."""

from __future__ import annotations

from typing import Any

import numpy as np

from seqjax.core.errors import CorpusError
from seqjax.store.chat import chat_text
from seqjax.store.spec import KWARGS_FIELD, ExampleSpec


def conversational(value: Any) -> bool:
    """A list of ``{role, ...}`` messages (TRL's ``is_conversational``)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m for m in value)


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` with the prompt the longest common start of the two (messages,
    or characters without a space that ends it), as TRL's ``extract_prompt``.

    >>> extract_prompt("Q: sky? A: blue", "Q: sky? A: green")
    ('Q: sky? A:', ' blue', ' green')
    """
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def pair_texts(spec: ExampleSpec, record: dict, where: str) -> tuple[str, str, str, bool]:
    """``(prompt text, prompt + chosen text, prompt + rejected text, conversational)`` of one
    record (a chat's texts rendered by the template); a record of neither form, or with an empty or
    equal completion, is one line."""
    chosen, rejected = record.get(spec.chosen_field), record.get(spec.rejected_field)
    prompt = record.get(spec.prompt_field)
    if prompt is None or conversational(chosen) != conversational(
            prompt):  # implicit (TRL's maybe_extract)
        prompt, chosen, rejected = extract_prompt(chosen, rejected) if isinstance(chosen, (str, list)) and \
            isinstance(rejected, (str, list)) else (None, chosen, rejected)
    form = "conversational" if conversational(chosen) else "standard"
    ok = (all(isinstance(v, str) for v in (prompt, chosen, rejected)) if form == "standard" else
          all(conversational(v) or v == [] for v in (prompt, chosen, rejected)))
    if not ok:
        raise CorpusError(
            f"{where}: fields {spec.prompt_field!r}, {spec.chosen_field!r}, {spec.rejected_field!r} are "
            f"{', '.join(type(v).__name__ for v in (prompt, chosen, rejected))}; expected all text (standard) or "
            "all lists of {role, content} messages (conversational), the prompt optional")
    if spec.degenerate_pairs == "error" and (not chosen or not rejected):
        which = spec.chosen_field if not chosen else spec.rejected_field
        raise CorpusError(f"{where}: field {which!r} is empty after the prompt; expected a completion "
                          "(data.degenerate_pairs=keep trains such a pair as TRL does, drop leaves it out)")
    if spec.degenerate_pairs == "error" and chosen == rejected:
        raise CorpusError(
            f"{where}: {spec.chosen_field!r} equals {spec.rejected_field!r}; expected two different completions "
            "(data.degenerate_pairs=keep trains such a pair as TRL does, drop leaves it out)")
    if form == "standard":
        eos = spec.eos_token
        return (prompt, prompt + chosen + ("" if chosen.endswith(eos) else eos),
                prompt + rejected + ("" if rejected.endswith(eos) else eos), False)
    if spec.chat_template is None:
        raise CorpusError(
            f"{where}: a conversational pair, and no chat template; set data.chat_template")
    tools, kwargs = record.get(spec.tools_field), record.get(KWARGS_FIELD)
    return (chat_text(spec, prompt, where, True, tools, kwargs) if prompt else "",
            chat_text(spec, prompt + chosen, where, tools=tools, kwargs=kwargs),
            chat_text(spec, prompt + rejected, where, tools=tools, kwargs=kwargs), True)


def degenerate(spec: ExampleSpec, record: dict) -> str | None:
    """``identical`` (chosen equals rejected), ``empty`` (a completion is empty) or None, of a record that
    :func:`pair_texts` read."""
    chosen, rejected = record.get(spec.chosen_field), record.get(spec.rejected_field)
    prompt = record.get(spec.prompt_field)
    if prompt is None or conversational(chosen) != conversational(prompt):
        _, chosen, rejected = extract_prompt(chosen, rejected)
    if not chosen or not rejected:
        return "empty"
    return "identical" if chosen == rejected else None


def encode_pair(spec: ExampleSpec, tokenizer, record: dict,
                where: str) -> tuple[np.ndarray, np.ndarray, int, int] | None:
    """``(chosen ids, rejected ids, prompt length, bytes)``: both sequences start with the same
    ``prompt length`` ids; everything after them is the completion. None: a completion of no token
    at all, which nothing can score (``data.degenerate_pairs`` keep or drop; counted by the caller).

    Under ``data.pair_eos=always`` each completion ends with the EOS, appended where its last token
    is another (TRL's CPO and ORPO trainers: after a chat template's closing ``<|im_end|>\n``
    too)."""
    prompt, with_chosen, with_rejected, chat = pair_texts(spec, record, where)
    # a rendered chat holds its special tokens itself; plain text gets the tokenizer's own (TRL's
    # _tokenize)
    encode = tokenizer.encode_text if chat else tokenizer.encode_special
    prompt_ids = encode(prompt) if prompt else []
    chosen_ids, rejected_ids = encode(with_chosen), encode(with_rejected)
    n = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    if n == 0:
        raise CorpusError(
            f"{where}: the prompt is empty (no shared first token); expected a prompt the "
            "completions follow")
    if spec.pair_eos == "always":
        eos = tokenizer.token_id(spec.eos_token)
        chosen_ids, rejected_ids = ([*ids, eos] if len(ids) == n or ids[-1] != eos else ids
                                    for ids in (chosen_ids, rejected_ids))
    if n >= min(len(chosen_ids), len(rejected_ids)):
        if spec.degenerate_pairs != "error":
            return None
        raise CorpusError(
            f"{where}: a completion tokenizes to nothing after the prompt; expected at least "
            "one token of each (data.degenerate_pairs=drop leaves such a pair out)")
    return (np.asarray(chosen_ids, np.int64), np.asarray(rejected_ids, np.int64), n,
            len((with_chosen + with_rejected).encode("utf-8")))
