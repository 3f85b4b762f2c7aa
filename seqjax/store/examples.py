"""Instruction examples -> token ids plus a scored-token mask: prompt/completion pairs, chats,
pre-tokenized rows.

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

**Stored as they are.** An example's ids are exactly what transformers'
tokenizer or ``apply_chat_template(..., tokenize=True)`` gives: no token is
added before or after them. The store still separates examples with its
separator token (:mod:`seqjax.store.reader`), but for instruction data that
token belongs to no example: a packed row trains on each example's ids alone
(inputs ``ids[:-1]``, targets ``ids[1:]``), as TRL does. A Qwen chat
``<|im_start|>user ... <|im_end|>\n`` is stored between separators and trained
as those ids, with no ``<|endoftext|>`` before it; a Llama 3 chat keeps the
``<|begin_of_text|>`` its template renders. The first id is never a target.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seqjax.config.tree import Config, SourceConfig
from seqjax.core.errors import CorpusError
from seqjax.core.progress import log_once
from seqjax.store.chat import chat_spans, chat_template, twin_template
from seqjax.store.image_chats import expand_images, image_files, image_sources, read_image_spec, without_nulls
from seqjax.store.pairs import degenerate, encode_pair
from seqjax.store.spec import KWARGS_FIELD, NOT_SCORED, ExampleSpec

log = logging.getLogger(__name__)


# The objectives whose TRL trainers (CPOTrainer, ORPOTrainer) put an EOS after every completion.
ALWAYS_EOS = ("simpo", "orpo", "odds_ratio", "sft_sequence")


def pair_eos(config: Config) -> str:
    """``data.pair_eos`` resolved: auto is always for the objectives TRL trains with its CPO and ORPO trainers."""
    if config.data.pair_eos != "auto":
        return config.data.pair_eos
    return "always" if set(config.train.objective) & set(ALWAYS_EOS) else "template"


def example_spec(config: Config, source: SourceConfig, tokenizer_path: Path | None,
                 eot_token: str) -> ExampleSpec | None:
    """The spec of ``source``'s records, or None for text; the chat template is read now (a missing
    one is one line)."""
    if source.format == "text":
        return None
    d = config.data
    loss_on = d.loss_on
    if loss_on == "auto":
        loss_on = {"prompt_completion": "completion", "chat": "assistant", "tokenized": "labels",
                   "preference": "completion", "prompt": "completion"}[source.format]
    template, name, twin = None, "", None
    if source.format in ("preference", "prompt"):  # conversational ones render through the template, if any
        template, name = chat_template(d.chat_template, tokenizer_path, required=False)
    if source.format == "chat":
        template, name = chat_template(d.chat_template, tokenizer_path)
        twin = twin_template(template, config.tokenizer.bos_token, eot_token)
        if twin is not None:
            log_once(log, logging.INFO,
                     f"the chat template {name} has no {{% generation %}} blocks; its chats are scored as seqjax's "
                     f"{twin} template marks them wherever that renders them the same (docs/instruction.md)")
    return ExampleSpec(format=source.format, loss_on=loss_on, prompt_field=d.prompt_field,
                       completion_field=d.completion_field, prompt_separator=d.prompt_separator,
                       chosen_field=d.chosen_field, rejected_field=d.rejected_field,
                       messages_field=d.messages_field, tools_field=d.tools_field,
                       input_ids_field=d.input_ids_field, labels_field=d.labels_field,
                       loss_weights_field=d.loss_weights_field, chat_template=template,
                       template_name=name, bos_token=config.tokenizer.bos_token,
                       eos_token=eot_token, weights_dtype=d.loss_weights_dtype, twin=twin,
                       template_kwargs=json.dumps(d.chat_template_kwargs, sort_keys=True),
                       **({"pair_eos": pair_eos(config), "degenerate_pairs": d.degenerate_pairs}
                          if source.format == "preference" else {}),
                       image_spec=read_image_spec(d.image_processor) if source.format == "chat" else None,
                       images_field=d.images_field, image_token=d.image_token)


def char_spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (character ``offsets[i] = (start, end)``) that shares a character with a
    span.

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
    """One example as the store keeps it: its ids exactly (what transformers' tokenizer or chat
    template gives), and the weight of each id as a target. The first id is never a target (nothing
    comes before it), so its weight is 0 whatever the record says."""

    ids: np.ndarray
    mask: np.ndarray
    bytes: int
    scored_bytes: int
    images: list[np.ndarray] = field(default_factory=list)  # chats with images: each resized, uint8 [H, W, 3]
    image_files: list[tuple[str, int, int]] = field(default_factory=list)  # (path, bytes, mtime_ns) of each file

    def __post_init__(self) -> None:
        if len(self.mask):
            self.mask = self.mask.copy()
            self.mask[0] = 0

    @property
    def scored(self) -> int:
        """Targets with a weight above 0 (a count, whatever the weights are)."""
        return int(np.count_nonzero(self.mask))


def _text_ids(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    encoding = tokenizer.encode_with_offsets(text)
    return np.asarray(encoding[0], np.int64), np.asarray(encoding[1], np.int64).reshape(-1, 2)


def encode_example(spec: ExampleSpec, tokenizer, record: dict, where: str) -> Example:
    """One record as ids and mask (before framing); a bad record is one line naming ``where`` and
    the field."""
    if spec.format == "prompt_completion":
        prompt, completion = (record.get(f) for f in spec.fields)
        for name, value in zip(spec.fields, (prompt, completion)):
            if not isinstance(value, str):
                raise CorpusError(
                    f"{where}: field {name!r} is {type(value).__name__}, expected a string")
        head = [tokenizer.token_id(spec.bos_token)] if spec.bos_token else []
        p_ids = np.asarray(head + tokenizer.encode_text(prompt), np.int64)
        answer = spec.prompt_separator + completion
        c_ids = np.asarray(
            tokenizer.encode_text(answer) + [tokenizer.token_id(spec.eos_token)], np.int64)
        ids = np.concatenate([p_ids, c_ids])
        mask = np.concatenate([np.full(len(p_ids), spec.loss_on == "all"),
                               np.ones(len(c_ids))]).astype(np.uint8)
        scored_bytes = len(answer.encode("utf-8")) if spec.loss_on != "all" else len(
            (prompt + answer).encode())
        return Example(ids, mask, len((prompt + answer).encode("utf-8")), scored_bytes)
    if spec.format == "chat":
        record = {**record, spec.messages_field: without_nulls(record.get(spec.messages_field))}
        sources = image_sources(spec, record, where)
        text, spans = chat_spans(spec, record.get(spec.messages_field), where,
                                 record.get(spec.tools_field), record.get(KWARGS_FIELD))
        ids, offsets = _text_ids(tokenizer, text)
        mask = char_spans_to_mask(offsets, spans)
        scored_bytes = _scored_bytes(text, offsets, mask)
        images = []
        if sources:
            ids, mask, images = expand_images(ids, mask, sources, spec, tokenizer.token_id(spec.image_token), where)
        return Example(ids, mask, len(text.encode("utf-8")), scored_bytes, images, image_files(sources))
    ids = record.get(spec.input_ids_field)
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CorpusError(
            f"{where}: field {spec.input_ids_field!r} must be a non-empty list of integers")
    # in Python: an id past int64 cannot overflow
    outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if outside:
        raise CorpusError(
            f"{where}: {spec.input_ids_field!r} holds id {outside[0]}, outside the tokenizer's "
            f"vocabulary of {tokenizer.vocab_size}")
    ids = np.asarray(ids, np.int64)
    if spec.loss_on == "all":
        mask = np.ones(len(ids), np.uint8)
    elif spec.labels_field in record:
        mask = labels_mask(spec, record[spec.labels_field], ids, where)
    elif spec.loss_weights_field in record:
        mask = loss_weights(spec, record[spec.loss_weights_field], len(ids), where)
    else:
        raise CorpusError(
            f"{where}: neither {spec.labels_field!r} nor {spec.loss_weights_field!r}; expected one of "
            "them, or data.loss_on=all to score every token")
    text_bytes = len(tokenizer.decode(ids).encode("utf-8"))
    return Example(ids, mask, text_bytes,
                   len(tokenizer.decode(ids[mask.astype(bool)]).encode("utf-8")))


def pair_examples(spec: ExampleSpec, tokenizer, record: dict, where: str) -> tuple[Example, ...]:
    """A preference record as its two examples (:mod:`seqjax.store.pairs`): prompt + chosen and
    prompt + rejected, each scored on its completion; none for a pair left out
    (``data.degenerate_pairs``)."""
    encoded = encode_pair(spec, tokenizer, record, where)
    if encoded is None or (spec.degenerate_pairs == "drop" and degenerate(spec, record)):
        return ()
    chosen, rejected, n, size = encoded
    out = []
    for ids in (chosen, rejected):
        mask = (np.arange(len(ids)) >= n).astype(np.uint8)
        out.append(Example(ids, mask, size // 2, len(tokenizer.decode(ids[n:]).encode("utf-8"))))
    return out[0], out[1]


def labels_mask(spec: ExampleSpec, labels: Any, ids: np.ndarray, where: str) -> np.ndarray:
    """A tokenized record's ``labels`` as a 0/1 mask, HF's convention: at each position -100 (not
    scored) or the input id itself (scored; the model shifts it into place). Anything else is one
    line naming the position: a label of another token would otherwise be scored as if it were that
    position's own."""
    field = spec.labels_field
    integers = isinstance(labels, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in labels)
    if not integers or len(labels) != len(ids):
        raise CorpusError(
            f"{where}: field {field!r} must be a list of integers as long as {spec.input_ids_field!r} "
            f"({len(ids)})")
    for position, (label, token) in enumerate(zip(labels, ids.tolist())):
        if label != NOT_SCORED and label != token:
            raise CorpusError(
                f"{where}: {field!r}[{position}] is {label}; expected {NOT_SCORED} (not scored) or the "
                f"input id at that position ({token})")
    return (np.asarray(labels, np.int64) != NOT_SCORED).astype(np.uint8)


def loss_weights(spec: ExampleSpec, weights: Any, n: int, where: str) -> np.ndarray:
    """A tokenized record's ``loss_weights`` as the store keeps them; anything else is one line
    naming the record.

    Under ``data.loss_weights_dtype=uint8`` they must be 0/1 (or booleans); ``float32`` keeps any
    finite weight >= 0 (Levanter's prebuilt form carries 0.1 and 1.0, for instance).
    """
    field = spec.loss_weights_field
    numbers = isinstance(weights, list) and all(
        isinstance(w, (int, float)) and abs(w) < 1e300 for w in weights)
    if not numbers or len(weights) != n:
        raise CorpusError(
            f"{where}: field {field!r} must be a list of numbers as long as {spec.input_ids_field!r} "
            f"({n})")
    values = np.asarray(weights, np.float64)
    bad = values[~(np.isfinite(values) & (values >= 0))]
    if len(bad):
        raise CorpusError(f"{where}: field {field!r} holds {float(bad[0])}; expected weights >= 0")
    if spec.weights_dtype == "uint8" and not np.all((values == 0) | (values == 1)):
        bad = float(values[(values != 0) & (values != 1)][0])
        raise CorpusError(
            f"{where}: field {field!r} holds {bad}; data.loss_weights_dtype=uint8 keeps 0/1 weights "
            "only (set data.loss_weights_dtype=float32 to keep fractional ones)")
    return values.astype(spec.weights_dtype)
