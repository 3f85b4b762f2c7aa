"""Byte-level BPE with HF ``tokenizers``: train on the train split, save ``tokenizer.json``, load,
encode, decode.

Choices and why:

- **Byte level, no normalizer, no prefix space**: every string maps to bytes
  and back, so ``decode(encode(text)) == text`` exactly (raw files, random
  Unicode); bits-per-byte is then measured on the real bytes.
- **Lines are token boundaries**: text is encoded one line at a time (each
  line with its ``\\n``), and the saved tokenizer splits at ``\\n`` first, so
  any program loading ``tokenizer.json`` tokenizes text exactly like the store.
  fairseq-style block modes and evaluation are defined on lines.
- **Special tokens** come first in the vocabulary; the first is end-of-text.
  In the word-level WikiText-2 variant ``<unk>`` is added as one more special
  token, so it stays one token instead of ``<``, ``unk``, ``>``.
- The tokenizer's identity is the SHA-256 of its ``tokenizer.json``: token
  stores record it and are refused under any other tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from seqjax.config.tree import Config, SourceConfig
from seqjax.core.errors import TokenizerError
from seqjax.core.files import write_text_atomic
from seqjax.store.cache import BUILDER_VERSION, ProcessGroup, digest, file_identity, locked
from seqjax.store.corpus import file_documents, file_records
from seqjax.store.lines import split_lines

log = logging.getLogger(__name__)

BYTE_ALPHABET = 256
WORD_LEVEL_UNK = "<unk>"
NEWLINE_SYMBOL = "\u010a"  # how the byte-level alphabet writes b"\n" ("Ċ")


class Tokenizer:
    """A loaded ``tokenizer.json`` plus the facts seqjax needs: end-of-text id, vocabulary size,
    hash."""

    def __init__(self, path: str | os.PathLike, eot_token: str, bos_token: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(
                f"tokenizer.path: {str(self.path)!r} not found (expected a tokenizer.json file)")
        data = self.path.read_bytes()
        try:
            self._hf = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(
                f"tokenizer.path: {str(self.path)!r} is not a valid tokenizer.json ({err})"
            ) from None
        self.hash = hashlib.sha256(data).hexdigest()
        eot_id = self._hf.token_to_id(eot_token)
        if eot_id is None:
            raise TokenizerError(
                f"tokenizer {self.path}: has no token {eot_token!r}; "
                "expected tokenizer.special_tokens[0] to be its end-of-text token"
            )
        self.eot_token = eot_token
        self.bos_token = bos_token
        self.eot_id = int(eot_id)
        # What opens a prompt or an lm_eval window: a Llama tokenizer's BOS, else the end-of-text
        # token.
        self.bos_id = self.eot_id
        if bos_token is not None:
            bos_id = self._hf.token_to_id(bos_token)
            if bos_id is None:
                raise TokenizerError(
                    f"tokenizer {self.path}: has no token {bos_token!r} (tokenizer.bos_token)")
            self.bos_id = int(bos_id)
        self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))

    @property
    def separator_id(self) -> int:
        """The token between documents in a token store, which opens every document: the tokenizer's
        own framing.

        A tokenizer that opens text with a BOS (``tokenizer.bos_token``, e.g. an
        imported Llama's ``<s>``, as its ``add_bos_token`` says) gives ``<s> doc1
        <s> doc2 <s>``: each document reads as transformers tokenizes it, and the
        model learns where one ends by predicting the next one's BOS. Any other
        gives ``EOT doc1 EOT doc2 EOT`` (GPT-2's ``<|endoftext|>`` convention).
        """
        return self.bos_id

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. ``<unk>``), or None if the vocabulary lacks it."""
        return self._hf.token_to_id(token)

    def encode_lines(self, lines: Sequence[str]) -> list[list[int]]:
        """Token ids of each line; lines are encoded independently, in parallel (Rust threads)."""
        return [e.ids for e in self._hf.encode_batch_fast(list(lines), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, line by line, exactly as the token store holds them."""
        return [i for ids in self.encode_lines(split_lines(text)) for i in ids]

    def opened(self, ids: list[int]) -> list[int]:
        """A prompt's ids as a document of the store starts: after the opening token
        (:attr:`separator_id`). A prompt that already opens with it (a chat template's ``<s>``)
        keeps one, as transformers' templates render it."""
        return ids if ids[:1] == [self.separator_id] else [self.separator_id] + ids

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of the tokenizer's added special tokens (``<|im_end|>``,
        ``</s>``, ...)."""
        token = self._hf.get_added_tokens_decoder().get(token_id)
        return token is not None and token.special

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` as one string (special tokens in it recognized, none added) and each
        one's character span."""
        encoding = self._hf.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_default(self, text: str) -> list[int]:
        """Ids of ``text`` with the tokenizer's default special tokens, as transformers'
        ``tokenizer(text)`` gives them for this tokenizer once exported: its own post-processor's (a
        Llama's ``<s>``), or, for a tokenizer without one, the opening token seqjax's export adds
        (:func:`seqjax.hf.folders.write_folder`)."""
        if self._hf.post_processor is not None:
            return self._hf.encode(text, add_special_tokens=True).ids
        return [self.bos_id] + self.encode_text(text)

    def encode_special(self, text: str) -> list[int]:
        """Ids of ``text`` as transformers' ``tokenizer(text)`` gives them for this tokenizer.json:
        with the special tokens its own post-processor adds (a Llama's BOS), none otherwise (TRL
        tokenizes standard preference text so)."""
        return self._hf.encode(text, add_special_tokens=True).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` encoded as one string, without special tokens (as HF's ``encode``
        with ``add_special_tokens=False``, which the lm-evaluation-harness uses); may differ from
        :meth:`encode` at line starts for tokenizers that do not split at newlines (SentencePiece's
        ``▁``, Llama 3's ``\n\n``)."""
        return self._hf.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def splits_at_newlines(self) -> bool:
        """Whether the pre-tokenizer cuts at every ``\\n`` first (seqjax's own do), so no token
        spans two lines."""
        pre = json.loads(self._hf.to_str()).get("pre_tokenizer") or {}
        first = (pre.get("pretokenizers") or [{}])[0] if pre.get("type") == "Sequence" else pre
        return (first.get("type") == "Split" and first.get("pattern") == {"String": "\n"}
                and first.get("behavior") == "MergedWithPrevious" and not first.get("invert"))

    @functools.cached_property
    def _ends_line(self) -> np.ndarray:
        """For each id, whether its token ends with a newline, i.e. ends a line (under
        ``splits_at_newlines``)."""
        ends = np.zeros(self.vocab_size, bool)
        for token, i in self._hf.get_vocab(with_added_tokens=False).items():
            ends[i] = token.endswith(NEWLINE_SYMBOL)
        return ends

    def encode_documents(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Many documents at once, as the store holds them: (all ids, flat; tokens per document;
        tokens per line).

        Each document needs at least one token (no empty text). ``["a\\nbc", "d"]``
        gives the ids of ``a\\n``, ``bc`` and ``d`` one after another, document
        lengths ``[len(a\\n) + len(bc), len(d)]`` and line lengths ``[len(a\\n),
        len(bc), len(d)]``, exactly what :meth:`encode` gives line by line.
        When the tokenizer cuts at newlines itself, whole documents are encoded
        and line ends are read off the ids (fewer, larger calls); any other
        tokenizer encodes line by line.
        """
        if self.splits_at_newlines:
            ids = [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]
            doc_lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64,
                               count=int(doc_lengths.sum()))
            ends = self._ends_line[flat]
            ends[np.cumsum(doc_lengths) - 1] = True  # a document's last line may lack its newline
            line_lengths = np.diff(np.flatnonzero(ends), prepend=-1)
            return flat, doc_lengths, line_lengths
        lines = [split_lines(t) for t in texts]
        encoded = self.encode_lines([line for doc in lines for line in doc])
        line_lengths = np.fromiter(map(len, encoded), np.int64, count=len(encoded))
        per_doc = np.fromiter(map(len, lines), np.int64, count=len(lines))
        doc_lengths = np.add.reduceat(line_lengths,
                                      np.cumsum(per_doc) - per_doc) if len(lines) else per_doc
        flat = np.fromiter(itertools.chain.from_iterable(encoded), np.int64,
                           count=int(line_lengths.sum()))
        return flat, doc_lengths, line_lengths

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept as their text so that round trips are exact."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def decode_text(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without the special tokens (what a reward function reads, as transformers'
        ``batch_decode(..., skip_special_tokens=True)`` gives it to TRL's)."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def decode_whole(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without a last character they hold only part of (byte-level tokens can end inside a
        UTF-8 character, where generation stopped: decoded as a whole it reads U+FFFD), as a
        streamer holds it back until its other bytes come."""
        ids = [int(i) for i in ids]
        text = self.decode(ids)
        for cut in range(1, min(4, len(ids)) + 1):  # (a character is at most four bytes)
            if not text.endswith("\ufffd"):
                break
            text = self.decode(ids[:-cut])
        return text if not text.endswith("\ufffd") else self.decode(ids)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id}, hash={self.hash[:12]})"
        )


def special_tokens_for(special_tokens: Sequence[str], word_level: bool) -> list[str]:
    """The configured special tokens, plus ``<unk>`` for the word-level WikiText-2 variant."""
    tokens = list(special_tokens)
    if word_level and WORD_LEVEL_UNK not in tokens:
        tokens.append(WORD_LEVEL_UNK)
    return tokens


def check_vocab_size(vocab_size: int, special_tokens: Sequence[str]) -> None:
    """A byte-level BPE needs all 256 bytes plus the special tokens before it can merge anything."""
    need = BYTE_ALPHABET + len(special_tokens)
    if vocab_size < need:
        raise TokenizerError(
            f"tokenizer.vocab_size: got {vocab_size}, expected at least {need} "
            f"({BYTE_ALPHABET} byte tokens + {len(special_tokens)} special tokens {list(special_tokens)})"
        )


def _training_pieces(lines: Iterable[str], special_tokens: Sequence[str]) -> Iterator[str]:
    """Lines cut around special-token text, as encoding will see them, so no merge is wasted on
    ``<unk>``'s pieces."""
    pattern = re.compile("|".join(re.escape(t) for t in special_tokens))
    for line in lines:
        yield from (piece for piece in pattern.split(line) if piece)


def new_tokenizer() -> HFTokenizer:
    """An untrained byte-level BPE with the seqjax pipeline (split at newlines, then GPT-2
    byte-level rules)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    return hf


def train_tokenizer(
    lines: Iterable[str],
    path: str | os.PathLike,
    *,
    vocab_size: int,
    special_tokens: Sequence[str],
    min_frequency: int = 2,
    num_lines: int | None = None,
) -> Tokenizer:
    """Train on ``lines``, write ``tokenizer.json`` atomically to ``path``, and load it back."""
    check_vocab_size(vocab_size, special_tokens)
    hf = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_training_pieces(lines, special_tokens), trainer, length=num_lines)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    hf.save(str(tmp))
    os.replace(tmp, path)
    return Tokenizer(path, special_tokens[0])


# ---------------------------------------------------------------------------
# The tokenizer of a prepare run: given, cached, or trained now


def special_tokens(config: Config) -> list[str]:
    """The configured special tokens, plus ``<unk>`` when reading word-level WikiText-2."""
    word_level = any(s.corpus == "wikitext2" and s.variant == "tokens"
                     for s in config.data.resolved_sources())
    return special_tokens_for(config.tokenizer.special_tokens, word_level)


def train_sample(sources: list[SourceConfig], files: dict[str, list[Path]], budget: int,
                 data: Any = None) -> Iterator[str]:
    """Lines of whole train documents, about ``budget`` bytes of them, streamed.

    The budget is shared between sources by weight, and within a source
    between its files in turn (what a file leaves unused goes to the files
    after it), each read from its start: ``budget=100`` over files of 30, 500
    and 500 bytes reads all of the first and about 35 bytes of each other.
    """
    total_weight = sum(s.weight for s in sources) or 1.0
    for source in sources:
        left = budget * source.weight / total_weight
        paths = files[source.name]
        for i, path in enumerate(paths):
            quota, taken = left / (len(paths) - i), 0
            for doc in _source_texts(source, path, data):
                if taken >= quota:
                    break
                if doc.strip():
                    taken += len(doc.encode("utf-8"))
                    yield from split_lines(doc)
            left -= taken


def _source_texts(source: SourceConfig, path: Path, data: Any = None) -> Iterator[str]:
    """The text a tokenizer learns from: documents, or the prompts, answers and messages of
    examples."""
    if source.format == "text":
        yield from file_documents(source, path)
    elif source.format == "tokenized":
        raise TokenizerError(
            f"data.format=tokenized: {path} holds token ids, no text to train a tokenizer on; "
            "set tokenizer.path to the tokenizer that made them")
    else:
        data = data if data is not None else Config().data
        fields = {"prompt_completion": (data.prompt_field, data.completion_field),
                  "preference": (data.chosen_field, data.rejected_field, data.prompt_field),
                  "prompt": (data.prompt_field, )}.get(
                      source.format, (data.messages_field, ))
        for _, record in file_records(source, path, fields):
            texts = []
            for f in fields:
                values = record.get(f)
                if isinstance(values, list):
                    texts += [str(m.get("content", "")) for m in values if isinstance(m, dict)]
                elif values is not None:
                    texts.append(str(values))
            yield "\n".join(texts)


def obtain_tokenizer(config: Config, sources: list[SourceConfig],
                     train_files: dict[str, list[Path]] | None, run: ProcessGroup) -> Tokenizer:
    """Load ``tokenizer.path``, or the cached tokenizer trained on these train files, or train it
    now (process 0)."""
    specials = special_tokens(config)
    if config.tokenizer.path:
        return Tokenizer(
            Path(config.tokenizer.path).expanduser(), specials[0], config.tokenizer.bos_token)
    recipe = {
        "builder_version": BUILDER_VERSION,
        "sources": [{
            "corpus": s.corpus, "text_field": s.text_field, "format": s.format, "weight": s.weight,
            "files": [file_identity(p, config.data.cache_identity == "content") for p in train_files[s.name]]
        } for s in sources],
        "train_bytes": config.tokenizer.train_bytes,
        "vocab_size": config.tokenizer.vocab_size,
        "min_frequency": config.tokenizer.min_frequency,
        "special_tokens": specials,
    }
    folder = Path(config.data.cache_dir).expanduser() / "tokenizers" / digest(recipe)[:16]
    path = folder / "tokenizer.json"
    if run.main and not path.is_file():  # (a trained tokenizer is read as it is: no lock, none written)
        with locked(folder):
            if not path.is_file():
                log.info("training a %d-token byte-level BPE on up to %s bytes of the train split",
                         config.tokenizer.vocab_size, f"{config.tokenizer.train_bytes:,}")
                start = time.perf_counter()
                tokenizer = train_tokenizer(
                    train_sample(sources, train_files, config.tokenizer.train_bytes, config.data),
                    path,
                    vocab_size=config.tokenizer.vocab_size,
                    special_tokens=specials,
                    min_frequency=config.tokenizer.min_frequency,
                )
                write_text_atomic(folder / "recipe.json", json.dumps(recipe, indent=2))
                log.info("tokenizer %s trained in %.1fs -> %s", tokenizer.hash[:12],
                         time.perf_counter() - start, path)
    run.wait("seqjax-prepare-tokenizer")  # the other processes load what process 0 trained
    return Tokenizer(path, specials[0])
