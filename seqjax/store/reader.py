"""The token store: one split as shards of memory-mapped tokens plus offsets, read as one stream,
checked on open.

Layout of a store folder (one per split)::

    manifest.json         dtype, eot_id, vocab_size, counts, max_id, the build key, and the shards in order,
                          each with its files' sizes and xxh3 checksums; written last: the
                          completion marker
    shard-00000-<key>/    tokens.bin        the shard's stream, uint16 when the vocabulary fits, else uint32
                          doc_offsets.bin   int64 [n_docs + 1], raw
                          line_offsets.bin  int64 [n_lines + 1], raw
                          weights.bin       one per token: the target's loss weight, uint8 0/1 (1: scored), or
                                            float32 where shard.json says "weights_dtype": "float32"
                                            (instruction data only, data.format != text; see
                                            seqjax.store.examples)
                          shard.json        the shard's own record (the manifest's entry): its completion marker
    shard-00001-<key>/    ...

The stream is ``EOT, doc_0, EOT, doc_1, EOT, ..., doc_{n-1}, EOT``: one
end-of-text token before the first document and one after every document.
Document ``i`` is ``tokens[doc_offsets[i]:doc_offsets[i+1]]`` and *ends with*
its EOT; the token just before it is always an EOT. So:

- ``doc_offsets[0] == 1`` and ``doc_offsets[-1] == len(tokens)``;
- the sequence a packer trains on, ``[EOT] + text + [EOT]``, is the contiguous
  slice ``tokens[doc_offsets[i] - 1 : doc_offsets[i + 1]]``: the model learns
  how articles start and that they end;
- every token after position 0 has context, so evaluation scores
  ``len(tokens) - 1`` tokens in every mode (the ``predicted_tokens`` count).

**Instruction examples are stored as they are.** A store of instruction
examples (``data.format`` prompt_completion, chat or tokenized) has the same
stream, but an example's sequence is its ids alone, ``tokens[doc_offsets[i] :
doc_offsets[i + 1] - 1]``: the separators around it belong to no example, so a
chat trains on exactly the ids transformers renders (:meth:`TokenStore.doc_spans`
says which sequence each document is). It also holds ``weights.bin``:
``mask[p]`` is 1 when predicting ``tokens[p]`` counts in the loss (an answer's
token), 0 on prompts, on each example's first token (it has no context) and on
every separator. It has the tokens' shards, checksums and reuse rules, and
becomes the batch contract's ``weights`` (:class:`seqjax.data.scored.TargetWeights`).
A text store has no mask: every target is scored.

``line_offsets`` are token boundaries of the text's lines (each line was
tokenized on its own, so line boundaries are token boundaries). Every document
boundary is a line boundary; each document's closing EOT belongs to its last
line. fairseq's block break modes are defined on lines.

**Shards read as one stream.** Each shard is a stream of the same form, so
shard ``k + 1`` begins with the EOT that shard ``k`` ends with; the logical
stream keeps that EOT once. A store of shards ``[EOT a EOT]`` and
``[EOT b c EOT]`` reads as ``[EOT a EOT b c EOT]``, with ``doc_offsets``
``[1, 3, 6]``: exactly the store one shard would hold, so every strategy sees
the same stream however the store was cut. :class:`TokenStream` reads
several shards' memmaps as that one array (slices and fancy indexing).

Why flat arrays: every chunking strategy becomes index arithmetic on
offsets (vectorized numpy, O(n)), reads are zero-copy slices of a memmap, and
many processes can share the pages.

**Integrity.** Every file's size and xxh3-64 checksum are recorded at build
time (computed while writing, so they cost no second read), and so is the
largest token id. :meth:`TokenStore.open` compares every file's size with the
manifest, every time: a truncated or grown file is refused, naming the file,
what was expected and what was found. ``open(..., verify=True)`` also
recomputes the checksums and the largest id, which catches ids overwritten in
place (prepare does that on reuse, see :mod:`seqjax.store.build`).

**Atomic writes.** A shard is written in a hidden staging folder beside the
store and renamed into place only after its ``shard.json``; the manifest is
replaced atomically after all its shards exist, and only then are shards no
manifest names removed. So a killed build never leaves a shard or a store
that looks complete, an existing store is never half-overwritten, and a
re-run finds the shards that were finished. The writers (:class:`~seqjax.store.writer.ShardWriter`,
:class:`~seqjax.store.writer.StoreWriter`, :func:`~seqjax.store.writer.write_store`)
live in :mod:`seqjax.store.writer`. ``TokenStore.open(path, tokenizer_hash=...)`` refuses a
store built by another tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from seqjax.core.errors import StoreError
from seqjax.store.checks import check_files, id_range_problem, read_manifest
from seqjax.store.layout import (
    DOC_IMAGES,
    DOC_OFFSETS,
    LINE_OFFSETS,
    MASK_DTYPE,
    OFFSET_DTYPE,
    REBUILD_HINT,
    TOKENS,
    WEIGHTS,
    token_dtype,
)
from seqjax.store.stored_images import StoredImages
from seqjax.store.stream import TokenStream, concat_offsets

# ---------------------------------------------------------------------------
# The store


class _LoadedOnFirstUse:
    """An array attribute that may be set to a zero-argument loader: the first read calls it and
    keeps the array."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if callable(value):
            value = value()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, value)


class TokenStore:
    """A read-only view of one split (or of several sources' splits, one after another).

    Build with :mod:`seqjax.store.writer` or prepare; open with
    :meth:`open`; in memory with :meth:`from_documents`. ``doc_offsets`` and
    ``line_offsets`` may be given as zero-argument loaders: an opened store
    reads them on first use, so opening a large store costs only its manifest.
    """

    def __init__(self, tokens, doc_offsets, line_offsets, eot_id: int, vocab_size: int,
                 manifest: dict[str, Any] | None = None, path: Path | None = None, mask=None):
        self.tokens = tokens
        # a weight per token (uint8 0/1, or float32; 0: not scored), or None: every target scored
        self.mask = mask
        self.doc_offsets = doc_offsets
        self.line_offsets = line_offsets
        self.eot_id = int(eot_id)
        self.vocab_size = int(vocab_size)
        self.manifest = manifest if manifest is not None else {}
        self.path = path
        # the mixture's sources, one (name, weight, first document, end document) each; see concat()
        self.sources: list[tuple[str, float, int, int]] = []
        self.source_stores: list[TokenStore] = []
        self.source_bases = np.zeros(0, np.int64)  # where each source's stream starts in this one
        # chats with images: each document's images (seqjax.store.stored_images.StoredImages), or
        # None
        self.images: StoredImages | None = None
        # built in memory: check it now (an opened store was checked when it was built)
        if manifest is None:
            self.validate()

    doc_offsets = _LoadedOnFirstUse()
    line_offsets = _LoadedOnFirstUse()

    # -- construction -----------------------------------------------------

    @classmethod
    def from_documents(
        cls,
        docs: list[np.ndarray] | list[list[int]],
        eot_id: int,
        vocab_size: int,
        lines: list[list[int]] | None = None,
        weights: list[list[int]] | None = None,
    ) -> "TokenStore":
        """An in-memory store from token lists (text only, no EOT). For tests and small corpora.

        ``lines``, if given, holds for each document the token lengths of its
        lines (summing to the document's length); by default a document is one line.
        ``weights``, if given, makes a store of instruction examples (stored as they are: see
        :meth:`doc_spans`): for each document, the weight of each token as a target (the first one's
        is taken as 0: nothing comes before it), as prepare stores them.
        """
        dtype = token_dtype(vocab_size)
        # 0/1 weights as bytes, as prepare keeps them; any others as float32
        if weights is not None:
            if [len(w) for w in weights] != [len(d) for d in docs]:
                raise StoreError("weights: expected one weight per token of each document")
            mask = np.concatenate([np.zeros(1)] + [np.r_[0, np.asarray(w[1:], np.float64), 0] for w in weights])
            mask = mask.astype(MASK_DTYPE if np.all((mask == 0) | (mask == 1)) else np.float32)
        else:
            mask = None
        pieces = [np.asarray([eot_id], dtype)]
        doc_offsets = [1]
        line_offsets = [1]
        for i, doc in enumerate(docs):
            doc = np.asarray(doc, dtype)
            pieces += [doc, np.asarray([eot_id], dtype)]
            doc_offsets.append(doc_offsets[-1] + len(doc) + 1)
            lengths = list(lines[i]) if lines is not None else [len(doc)]
            if sum(lengths) != len(doc):
                raise StoreError(
                    f"document {i}: line lengths {lengths} do not sum to its length {len(doc)}")
            lengths[-1] += 1  # the closing EOT belongs to the last line
            for n in lengths:
                line_offsets.append(line_offsets[-1] + n)
        tokens = np.concatenate(pieces)
        return cls(tokens, np.asarray(doc_offsets, np.int64), np.asarray(line_offsets, np.int64),
                   eot_id=int(eot_id), vocab_size=int(vocab_size), mask=mask)

    @classmethod
    def open(cls, path: str | os.PathLike, *, tokenizer_hash: str | None = None,
             verify: bool = False) -> "TokenStore":
        """Memory-map a finished store; refuse an incomplete, foreign or damaged one, naming what is
        wrong.

        Every file's size is compared with the manifest. With
        ``tokenizer_hash``, a store built by any other tokenizer is refused (its
        ids would mean different text, silently). With ``verify``, every
        file's checksum and the token ids' range are checked as well.
        """
        path = Path(path)
        manifest = read_manifest(path)
        built_with = manifest.get("tokenizer_hash")
        if tokenizer_hash is not None and built_with != tokenizer_hash:
            raise StoreError(
                f"token store {path} was built with tokenizer {str(built_with)[:12]}, but the tokenizer in use is "
                f"{tokenizer_hash[:12]}; refusing it. Rebuild the store with this tokenizer (python -m seqjax.prepare)"
            )
        problems = check_files(path, manifest, checksums=verify)
        if problems:
            raise StoreError(f"token store {path} is damaged: {problems[0]}; {REBUILD_HINT}")
        dtype = np.dtype(manifest["dtype"])
        shards = [path / shard["name"] for shard in manifest["shards"]]
        stream = TokenStream([np.memmap(s / TOKENS, dtype=dtype, mode="r") for s in shards])
        tokens = stream.parts[0] if len(shards) == 1 else stream

        def offsets(name: str) -> np.ndarray | Callable[[], np.ndarray]:
            # mapped now (no read, and a later rebuild that removes these files cannot pull them
            # away), joined into one array only when first used
            parts = [np.memmap(s / name, dtype=OFFSET_DTYPE, mode="r") for s in shards]
            return parts[0] if len(parts) == 1 else lambda: concat_offsets(parts, stream.bases)

        mask = None
        if all(WEIGHTS in shard["files"] for shard in manifest["shards"]):
            masks = [
                np.memmap(s / WEIGHTS, dtype=record.get("weights_dtype", MASK_DTYPE.name), mode="r")
                for s, record in zip(shards, manifest["shards"])
            ]
            mask = masks[0] if len(masks) == 1 else TokenStream(masks)
        store = cls(tokens, offsets(DOC_OFFSETS), offsets(LINE_OFFSETS), eot_id=manifest["eot_id"],
                    vocab_size=manifest["vocab_size"], manifest=manifest, path=path, mask=mask)
        if all(DOC_IMAGES in shard["files"] for shard in manifest["shards"]):
            store.images = StoredImages(shards, int(manifest["shards"][0]["image_token_id"]))
        if verify:
            store.validate()
            problem = id_range_problem(store, manifest)
            if problem:
                raise StoreError(f"token store {path} is damaged: {problem}; {REBUILD_HINT}")
        return store

    @classmethod
    def concat(cls, stores: list["TokenStore"], names: list[str], weights: list[float]) -> "TokenStore":
        """Several stores of one tokenizer as one (a mixture's split); ``sources`` says which
        documents are whose."""
        parts = [
            p for s in stores
            for p in (s.tokens.parts if isinstance(s.tokens, TokenStream) else [s.tokens])
        ]
        stream = TokenStream(parts)
        # exclusive, shared EOTs once
        ends = np.cumsum([len(s.tokens) for s in stores]) - np.arange(len(stores))
        bases = np.concatenate([[0], ends[:-1] - 1])
        docs = np.cumsum([0] + [s.num_docs for s in stores])

        def offsets(name: str) -> Callable[[], np.ndarray]:
            return lambda: concat_offsets([getattr(s, name) for s in stores], bases)

        stats: dict[str, int] = {}
        for s in stores:
            for key, value in s.manifest.get("stats", {}).items():
                stats[key] = stats.get(key, 0) + value
        sources = [{"name": n, "weight": w, "store": str(s.path)}
                   for n, w, s in zip(names, weights, stores)]
        manifest = {
            "split": stores[0].manifest.get("split"), "stats": stats,
            "max_id": max(s.max_id for s in stores),
            "tokenizer_hash": stores[0].manifest.get("tokenizer_hash"), "sources": sources
        }
        mask = None
        # a text source among instruction ones: all its targets count
        if any(s.mask is not None for s in stores):
            def parts(s: TokenStore) -> list:
                if s.mask is None:
                    return [np.concatenate([[0], np.ones(len(s.tokens) - 1, MASK_DTYPE)]).astype(MASK_DTYPE)]
                return s.mask.parts if isinstance(s.mask, TokenStream) else [s.mask]

            masks = [p for s in stores for p in parts(s)]
            mask = TokenStream(masks)
        merged = cls(stream, offsets("doc_offsets"), offsets("line_offsets"), eot_id=stores[0].eot_id,
                     vocab_size=stores[0].vocab_size, manifest=manifest, mask=mask)
        merged.sources = [(n, float(w), int(docs[i]), int(docs[i + 1]))
                          for i, (n, w) in enumerate(zip(names, weights))]
        merged.source_stores = list(stores)
        merged.source_bases = bases
        return merged

    # -- queries ----------------------------------------------------------

    @property
    def text_identity(self) -> list[str]:
        """The content hashes (xxh3) of the files this store was built from, in stream order; a
        mixture lists each source's in turn. Checkpoints record them, so that a resume on other text
        is seen."""
        if self.source_stores:
            return [h for store in self.source_stores for h in store.text_identity]
        return [
            record["xxh3"] for shard in self.manifest.get("shards", [])
            for record in shard.get("sources", [])
        ]

    @property
    def num_docs(self) -> int:
        # (a store made field by field may have none)
        manifest = getattr(self, "manifest", None) or {}
        if "num_docs" in manifest:
            return int(manifest["num_docs"])
        return len(self.doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Length of the stream, separators included."""
        return len(self.tokens)

    @property
    def predicted_tokens(self) -> int:
        """Targets the documents' sequences hold: every text token plus each document's closing EOT;
        each example's ids but its first."""
        if self.source_stores:
            return sum(s.predicted_tokens for s in self.source_stores)
        return int(self.doc_predictions.sum()) if self.examples else len(self.tokens) - 1

    @property
    def scored_tokens(self) -> int:
        """Targets the loss counts: every predicted token of a text store, the masked ones of
        instruction data."""
        if self.mask is None:
            return self.predicted_tokens
        stats = (getattr(self, "manifest", None) or {}).get("stats", {})
        if "scored_tokens" in stats and not self.source_stores:
            return int(stats["scored_tokens"])
        parts = self.mask.parts if isinstance(self.mask, TokenStream) else [self.mask]
        # (each part's first entry, a shared EOT, is 0)
        return int(sum(np.count_nonzero(p) for p in parts))

    @property
    def max_id(self) -> int:
        """The largest token id in the store: recorded at build time, else read."""
        manifest = getattr(self, "manifest", None) or {}
        if "max_id" in manifest:
            return int(manifest["max_id"])
        return int(np.asarray(self.tokens).max())

    @property
    def doc_lengths(self) -> np.ndarray:
        """Length of each document, its closing EOT included."""
        return np.diff(self.doc_offsets)

    @property
    def examples(self) -> bool:
        """Whether the documents are instruction examples, stored as they are (see :meth:`doc_spans`)."""
        return self.mask is not None and not self.source_stores

    def doc_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, lengths)`` in the stream of the sequence each document trains and is scored as.

        A text document's is ``[EOT] + text + [EOT]``: ``tokens[doc_offsets[i] - 1 :
        doc_offsets[i + 1]]``, its opening separator as context and its closing one as its last
        target. An instruction example's is its ids exactly, without the separators around them
        (``tokens[doc_offsets[i] : doc_offsets[i + 1] - 1]``): what transformers renders and TRL
        trains on. A mixture's are each source's, in stream order.
        """
        if getattr(self, "_spans", None) is None:  # (computed once: a read of doc_offsets)
            if self.source_stores:
                spans = [s.doc_spans() for s in self.source_stores]
                self._spans = (np.concatenate([a + b for (a, _), b in zip(spans, self.source_bases)]),
                               np.concatenate([n for _, n in spans]))
            else:
                offsets = np.asarray(self.doc_offsets, np.int64)
                self._spans = (offsets[:-1], np.diff(offsets) - 1) if self.examples else \
                    (offsets[:-1] - 1, np.diff(offsets) + 1)
        return self._spans

    @property
    def doc_predictions(self) -> np.ndarray:
        """How many targets each document's sequence has (:meth:`doc_spans` lengths - 1)."""
        return self.doc_spans()[1] - 1

    def doc(self, i: int) -> np.ndarray:
        """Document ``i`` with its closing EOT (no leading EOT)."""
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    def documents_at(self, positions: np.ndarray) -> np.ndarray:
        """The document each stream position lies in (an example's first id is at its ``doc_offsets``
        entry)."""
        return np.searchsorted(np.asarray(self.doc_offsets), positions, "right") - 1

    def doc_sequence(self, i: int) -> np.ndarray:
        """The sequence document ``i`` trains and is scored as (:meth:`doc_spans`): ``[EOT] + text +
        [EOT]``, or an instruction example's ids."""
        starts, lengths = self.doc_spans()
        return np.asarray(self.tokens[starts[i] : starts[i] + lengths[i]])

    def validate(self) -> None:
        """Check the layout invariants above; a store that breaks them is refused, not used."""
        where = f" ({self.path})" if self.path else ""
        n = len(self.tokens)
        d, lines = np.asarray(self.doc_offsets), np.asarray(self.line_offsets)
        if n == 0 or len(d) < 2:
            raise StoreError(f"token store{where} is empty: it holds no documents")
        if d[0] != 1 or d[-1] != n or np.any(np.diff(d) < 1):
            raise StoreError(f"token store{where}: doc_offsets must rise from 1 to {n}")
        if lines[0] != 1 or lines[-1] != n or np.any(np.diff(lines) < 1):
            raise StoreError(f"token store{where}: line_offsets must rise from 1 to {n}")
        if not np.all(np.isin(d, lines)):
            raise StoreError(f"token store{where}: every document boundary must be a line boundary")
        if self.tokens[0] != self.eot_id or np.any(self.tokens[d[1:] - 1] != self.eot_id):
            raise StoreError(f"token store{where}: documents must be separated by eot_id={self.eot_id}")
        if self.mask is not None and (len(self.mask) != n or self.mask[0] != 0):
            raise StoreError(
                f"token store{where}: the scored-token mask must have one entry per token ({n}) and 0 "
                "for the first")


# ---------------------------------------------------------------------------
# Manifests and integrity
