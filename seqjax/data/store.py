"""The token store: one split as shards of memory-mapped tokens plus offsets, read as one stream, checked on open.

Layout of a store folder (one per split)::

    manifest.json         dtype, eot_id, vocab_size, counts, max_id, the build key, and the shards in order,
                          each with its files' sizes and xxh3 checksums; written last: the completion marker
    shard-00000-<key>/    tokens.bin        the shard's stream, uint16 when the vocabulary fits, else uint32
                          doc_offsets.bin   int64 [n_docs + 1], raw
                          line_offsets.bin  int64 [n_lines + 1], raw
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
place (prepare does that on reuse, see :mod:`seqjax.data.build`).

**Atomic writes.** A shard is written in a hidden staging folder beside the
store and renamed into place only after its ``shard.json``; the manifest is
replaced atomically after all its shards exist, and only then are shards no
manifest names removed. So a killed build never leaves a shard or a store
that looks complete, an existing store is never half-overwritten, and a
re-run finds the shards that were finished. :class:`ShardWriter` streams
token chunks to disk; :class:`StoreWriter` and :func:`write_store` write a
one-shard store. ``TokenStore.open(path, tokenizer_hash=...)`` refuses a
store built by another tokenizer.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from seqjax.errors import StoreError
from seqjax.files import write_text_atomic

MANIFEST = "manifest.json"
SHARD_RECORD = "shard.json"
FORMAT_VERSION = 2
TOKENS, DOC_OFFSETS, LINE_OFFSETS = "tokens.bin", "doc_offsets.bin", "line_offsets.bin"
FILES = (TOKENS, DOC_OFFSETS, LINE_OFFSETS)
OFFSET_DTYPE = np.dtype("<i8")
READ_BLOCK = 1 << 24  # bytes per read when checksumming a file
REBUILD_HINT = "delete it and run python -m seqjax.prepare to rebuild it (inside its cache prepare does this itself)"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the memory and bandwidth whenever the ids fit."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def file_checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes, read in blocks (several GB/s, memory flat)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Reading several shards as one stream


class TokenStream:
    """Shards' token arrays read as one stream, each shard after the first losing the EOT it shares with the one before.

    Indexing works like a numpy array's: an int gives a token, a slice a
    numpy array, an integer array a gather. With parts ``[0 5 0]`` and
    ``[0 6 7 0]`` the stream is ``[0 5 0 6 7 0]``: part ``k``'s local index
    ``q`` is logical index ``bases[k] + q``. ``np.asarray(stream)`` copies the
    whole stream into memory; indexing reads only what it touches.
    """

    def __init__(self, parts: list[np.ndarray]):
        if not parts:
            raise StoreError("a token stream needs at least one shard")
        self.parts = parts
        sizes = np.asarray([len(p) for p in parts], np.int64)
        self.bases = np.concatenate([[0], np.cumsum(sizes[:-1] - 1)]).astype(np.int64)
        self.ends = self.bases + sizes  # exclusive
        self.dtype = parts[0].dtype
        self._len = int(self.ends[-1])

    def __len__(self) -> int:
        return self._len

    @property
    def shape(self) -> tuple[int]:
        return (self._len,)

    def _part_of(self, index: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bases, index, "right") - 1

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._len)
            if step != 1:
                return self[np.arange(start, stop, step)]
            if stop <= start:
                return np.zeros(0, self.dtype)
            k = int(self._part_of(np.asarray(start)))
            if stop <= self.ends[k]:  # inside one shard: a view of its memmap
                return self.parts[k][start - self.bases[k] : stop - self.bases[k]]
            pieces = []  # across shards: each shard's stretch, its shared first EOT once
            while start < stop:
                end = min(stop, int(self.ends[k]))
                pieces.append(self.parts[k][start - self.bases[k] : end - self.bases[k]])
                start, k = end, k + 1
            return np.concatenate(pieces)
        index = np.asarray(key)
        if index.ndim == 0:
            i = int(index) + (self._len if int(index) < 0 else 0)
            if not 0 <= i < self._len:
                raise IndexError(f"index {int(index)} is out of bounds for a stream of {self._len} tokens")
            k = int(self._part_of(np.asarray(i)))
            return self.parts[k][i - self.bases[k]]
        return self.take(index)

    def take(self, index: np.ndarray) -> np.ndarray:
        """``stream[index]`` for an integer array: one gather per shard it touches (one in the common case)."""
        index = np.asarray(index)
        if index.size == 0:
            return np.zeros(index.shape, self.dtype)
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self._len:
            raise IndexError(f"index {lo if lo < 0 else hi} is out of bounds for a stream of {self._len} tokens")
        first, last = (int(k) for k in self._part_of(np.asarray([lo, hi])))
        if first == last or hi < self.ends[first]:
            return self.parts[first][index - self.bases[first]]
        part = self._part_of(index)
        out = np.empty(index.shape, self.dtype)
        for k in range(first, last + 1):
            mask = part == k
            out[mask] = self.parts[k][index[mask] - self.bases[k]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([self.parts[0], *(p[1:] for p in self.parts[1:])])
        return whole if dtype is None else whole.astype(dtype)

    def __iter__(self):
        return itertools.chain(iter(self.parts[0]), *(iter(p[1:]) for p in self.parts[1:]))


def concat_offsets(parts: list[np.ndarray], bases: np.ndarray) -> np.ndarray:
    """Shards' local offsets as offsets into the logical stream: part ``k`` shifted by ``bases[k]``, shared ends once.

    Shard ``k``'s first offset (1: its first document starts after its EOT)
    is the same stream position as shard ``k - 1``'s last, so it is dropped.
    """
    pieces = [np.asarray(parts[0], np.int64) + bases[0]]
    pieces += [np.asarray(p[1:], np.int64) + b for p, b in zip(parts[1:], bases[1:])]
    return np.concatenate(pieces)


# ---------------------------------------------------------------------------
# The store


class _LoadedOnFirstUse:
    """An array attribute that may be set to a zero-argument loader: the first read calls it and keeps the array."""

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

    Build with :class:`StoreWriter` / :func:`write_store` / prepare; open with
    :meth:`open`; in memory with :meth:`from_documents`. ``doc_offsets`` and
    ``line_offsets`` may be given as zero-argument loaders: an opened store
    reads them on first use, so opening a large store costs only its manifest.
    """

    def __init__(self, tokens, doc_offsets, line_offsets, eot_id: int, vocab_size: int,
                 manifest: dict[str, Any] | None = None, path: Path | None = None):
        self.tokens = tokens
        self.doc_offsets = doc_offsets
        self.line_offsets = line_offsets
        self.eot_id = int(eot_id)
        self.vocab_size = int(vocab_size)
        self.manifest = manifest if manifest is not None else {}
        self.path = path
        # the mixture's sources, one (name, weight, first document, end document) each; see concat()
        self.sources: list[tuple[str, float, int, int]] = []
        self.source_stores: list[TokenStore] = []
        if manifest is None:  # built in memory: check it now (an opened store was checked when it was built)
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
    ) -> "TokenStore":
        """An in-memory store from token lists (text only, no EOT). For tests and small corpora.

        ``lines``, if given, holds for each document the token lengths of its
        lines (summing to the document's length); by default a document is one line.
        """
        dtype = token_dtype(vocab_size)
        pieces = [np.asarray([eot_id], dtype)]
        doc_offsets = [1]
        line_offsets = [1]
        for i, doc in enumerate(docs):
            doc = np.asarray(doc, dtype)
            pieces += [doc, np.asarray([eot_id], dtype)]
            doc_offsets.append(doc_offsets[-1] + len(doc) + 1)
            lengths = list(lines[i]) if lines is not None else [len(doc)]
            if sum(lengths) != len(doc):
                raise StoreError(f"document {i}: line lengths {lengths} do not sum to its length {len(doc)}")
            lengths[-1] += 1  # the closing EOT belongs to the last line
            for n in lengths:
                line_offsets.append(line_offsets[-1] + n)
        tokens = np.concatenate(pieces)
        return cls(tokens, np.asarray(doc_offsets, np.int64), np.asarray(line_offsets, np.int64),
                   eot_id=int(eot_id), vocab_size=int(vocab_size))

    @classmethod
    def open(cls, path: str | os.PathLike, *, tokenizer_hash: str | None = None, verify: bool = False) -> "TokenStore":
        """Memory-map a finished store; refuse an incomplete, foreign or damaged one, naming what is wrong.

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
            # mapped now (no read, and a later rebuild that removes these files cannot pull them away),
            # joined into one array only when first used
            parts = [np.memmap(s / name, dtype=OFFSET_DTYPE, mode="r") for s in shards]
            return parts[0] if len(parts) == 1 else lambda: concat_offsets(parts, stream.bases)

        store = cls(tokens, offsets(DOC_OFFSETS), offsets(LINE_OFFSETS), eot_id=manifest["eot_id"],
                    vocab_size=manifest["vocab_size"], manifest=manifest, path=path)
        if verify:
            store.validate()
            problem = id_range_problem(store, manifest)
            if problem:
                raise StoreError(f"token store {path} is damaged: {problem}; {REBUILD_HINT}")
        return store

    @classmethod
    def concat(cls, stores: list["TokenStore"], names: list[str], weights: list[float]) -> "TokenStore":
        """Several stores of one tokenizer as one (a mixture's split); ``sources`` says which documents are whose."""
        parts = [p for s in stores for p in (s.tokens.parts if isinstance(s.tokens, TokenStream) else [s.tokens])]
        stream = TokenStream(parts)
        ends = np.cumsum([len(s.tokens) for s in stores]) - np.arange(len(stores))  # exclusive, shared EOTs once
        bases = np.concatenate([[0], ends[:-1] - 1])
        docs = np.cumsum([0] + [s.num_docs for s in stores])

        def offsets(name: str) -> Callable[[], np.ndarray]:
            return lambda: concat_offsets([getattr(s, name) for s in stores], bases)

        stats: dict[str, int] = {}
        for s in stores:
            for key, value in s.manifest.get("stats", {}).items():
                stats[key] = stats.get(key, 0) + value
        sources = [{"name": n, "weight": w, "store": str(s.path)} for n, w, s in zip(names, weights, stores)]
        manifest = {"split": stores[0].manifest.get("split"), "stats": stats, "max_id": max(s.max_id for s in stores),
                    "tokenizer_hash": stores[0].manifest.get("tokenizer_hash"), "sources": sources}
        merged = cls(stream, offsets("doc_offsets"), offsets("line_offsets"), eot_id=stores[0].eot_id,
                     vocab_size=stores[0].vocab_size, manifest=manifest)
        merged.sources = [(n, float(w), int(docs[i]), int(docs[i + 1])) for i, (n, w) in enumerate(zip(names, weights))]
        merged.source_stores = list(stores)
        return merged

    # -- queries ----------------------------------------------------------

    @property
    def text_identity(self) -> list[str]:
        """The content hashes (xxh3) of the files this store was built from, in stream order; a mixture lists
        each source's in turn. Checkpoints record them, so that a resume on other text is seen."""
        if self.source_stores:
            return [h for store in self.source_stores for h in store.text_identity]
        return [record["xxh3"] for shard in self.manifest.get("shards", []) for record in shard.get("sources", [])]

    @property
    def num_docs(self) -> int:
        manifest = getattr(self, "manifest", None) or {}  # (a store made field by field may have none)
        if "num_docs" in manifest:
            return int(manifest["num_docs"])
        return len(self.doc_offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Length of the stream, separators included."""
        return len(self.tokens)

    @property
    def predicted_tokens(self) -> int:
        """Tokens that have context: every text token plus each document's closing EOT."""
        return len(self.tokens) - 1

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

    def doc(self, i: int) -> np.ndarray:
        """Document ``i`` with its closing EOT (no leading EOT)."""
        return self.tokens[self.doc_offsets[i] : self.doc_offsets[i + 1]]

    def doc_with_context(self, i: int) -> np.ndarray:
        """``[EOT] + text + [EOT]``: the sequence a per-document strategy trains and scores on."""
        return self.tokens[self.doc_offsets[i] - 1 : self.doc_offsets[i + 1]]

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


# ---------------------------------------------------------------------------
# Manifests and integrity


def read_manifest(path: Path) -> dict[str, Any]:
    """The store's manifest, or a StoreError saying why there is no usable one."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise StoreError(f"no complete token store at {path} (missing {MANIFEST}); run python -m seqjax.prepare")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise StoreError(f"token store {path}: {MANIFEST} is not valid JSON ({err}); {REBUILD_HINT}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(
            f"token store {path} has format_version {manifest.get('format_version')}, "
            f"expected {FORMAT_VERSION}; rebuild it"
        )
    return manifest


def check_files(path: Path, manifest: dict[str, Any], *, checksums: bool) -> list[str]:
    """What is wrong with the store's files against its manifest: sizes always, checksums when asked."""
    return [problem for shard in manifest["shards"]
            for problem in shard_problems(path, shard, checksums=checksums, vocab_size=manifest["vocab_size"])]


def shard_problems(path: Path, shard: dict[str, Any], *, checksums: bool, vocab_size: int) -> list[str]:
    """What is wrong with one shard's files: each problem names the file, what the manifest records and what is found.

    Sizes are always compared; with ``checksums`` every file is hashed too,
    and a token file whose checksum changed is searched for out-of-vocabulary
    ids, so that damage is named for what it would do.
    """
    problems = []
    for name, record in shard["files"].items():
        file = path / shard["name"] / name
        if not file.is_file():
            problems.append(f"{file} is missing (the manifest records {record['bytes']:,} bytes)")
            continue
        size = file.stat().st_size
        if size != record["bytes"]:
            problems.append(f"{file} is {size:,} bytes, the manifest records {record['bytes']:,} (truncated or "
                            "overwritten)")
        elif checksums and (found := file_checksum(file)) != record["xxh3"]:
            problem = (f"{file} has checksum xxh3:{found}, the manifest records xxh3:{record['xxh3']} (its contents "
                       "changed after the build)")
            if name == TOKENS:
                tokens = np.memmap(file, dtype=token_dtype(vocab_size), mode="r")
                outside = np.flatnonzero(tokens >= vocab_size)
                if len(outside):
                    problem += (f"; it holds token id {int(tokens[outside[0]])} at position {int(outside[0])}, "
                                f"outside the vocabulary of {vocab_size}")
            problems.append(problem)
    return problems


def id_range_problem(store: TokenStore, manifest: dict[str, Any]) -> str | None:
    """An out-of-vocabulary id in the tokens, or a maximum that disagrees with the manifest's, as a message."""
    tokens = store.tokens
    parts = tokens.parts if isinstance(tokens, TokenStream) else [tokens]
    found = max(int(np.max(p)) for p in parts)
    if found >= store.vocab_size:
        return f"its tokens hold id {found}, outside the vocabulary of {store.vocab_size}"
    if "max_id" in manifest and found != manifest["max_id"]:
        return f"its largest token id is {found}, the manifest records {manifest['max_id']}"
    return None


# ---------------------------------------------------------------------------
# Writing


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def staging_dir(path: Path, what: str) -> Path:
    """A fresh hidden folder beside ``path``; leftovers of builds whose process is gone are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.*.tmp"):
        pid = old.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{what}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's private 0700 would hide a shared cache from other users
    return tmp


class _HashedFile:
    """An append-only file whose size and xxh3 are kept as it is written."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.digest = xxhash.xxh3_64()
        self.bytes = 0

    def write(self, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self.file.write(data)
        self.digest.update(data)
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        self.file.close()
        return {"bytes": self.bytes, "xxh3": self.digest.hexdigest()}


class ShardWriter:
    """Streams documents into one shard of the store at ``path``; :meth:`commit` publishes it as ``path/<name>``.

    Memory stays at one chunk of documents: tokens and offsets go to disk as
    they come, with their checksums. The shard is written in a hidden staging
    folder beside ``path`` and renamed into place only after its
    ``shard.json``, so a killed build leaves no shard that looks complete
    (the next build removes the staging folder). Use it as a context manager:
    leaving the block with an exception removes the staging folder.
    """

    def __init__(self, path: str | os.PathLike, name: str, *, eot_id: int, vocab_size: int):
        self.path, self.name = Path(path), name
        self.eot_id = int(eot_id)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(vocab_size)
        self._tmp = staging_dir(self.path, name)
        self._files = {n: _HashedFile(self._tmp / n) for n in FILES}
        self._files[TOKENS].write(np.asarray([self.eot_id], self.dtype))
        self._files[DOC_OFFSETS].write(np.asarray([1], OFFSET_DTYPE))
        self._files[LINE_OFFSETS].write(np.asarray([1], OFFSET_DTYPE))
        self.num_tokens, self.num_docs, self.num_lines = 1, 0, 0
        self.max_id = self.eot_id

    def add_chunk(self, ids: np.ndarray, doc_lengths: np.ndarray, line_lengths: np.ndarray) -> None:
        """Append documents given flat: all their text ids, tokens per document, tokens per line (EOTs are added).

        ``ids=[5, 6, 7]``, ``doc_lengths=[2, 1]``, ``line_lengths=[1, 1, 1]``
        appends ``5 6 EOT 7 EOT``: documents end at +3 and +5, lines at +1, +3, +5.
        """
        ids, doc_lengths, line_lengths = (np.asarray(a) for a in (ids, doc_lengths, line_lengths))
        if len(doc_lengths) == 0:
            return
        if min(doc_lengths.min(), line_lengths.min()) < 1 or not len(ids) == doc_lengths.sum() == line_lengths.sum():
            raise StoreError(f"shard {self.name}: every document and line needs at least one token, and the lengths "
                             "must add up to the ids given")
        if len(ids) and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise StoreError(f"shard {self.name}: token id {int(ids.max())} is outside the vocabulary of "
                             f"{self.vocab_size}")
        doc_ends = np.cumsum(doc_lengths)  # in ids, exclusive
        out_ends = doc_ends + np.arange(1, len(doc_ends) + 1)  # each document followed by its EOT
        out = np.full(int(out_ends[-1]), self.eot_id, self.dtype)
        keep = np.ones(len(out), bool)
        keep[out_ends - 1] = False
        out[keep] = ids
        # a line ends in the ids at its cumulative length; each line is shifted by the EOTs before it, and a
        # document's last line also takes its own EOT
        line_ends = np.cumsum(line_lengths)
        eots_before = np.searchsorted(doc_ends, line_ends, "left")
        line_ends_out = line_ends + eots_before + np.isin(line_ends, doc_ends)
        self._files[TOKENS].write(out)
        self._files[DOC_OFFSETS].write((out_ends + self.num_tokens).astype(OFFSET_DTYPE))
        self._files[LINE_OFFSETS].write((line_ends_out + self.num_tokens).astype(OFFSET_DTYPE))
        self.num_tokens += len(out)
        self.num_docs += len(doc_lengths)
        self.num_lines += len(line_lengths)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))

    def add_document(self, lines: list[list[int]]) -> None:
        """Append one document given as the token ids of each of its lines (text only; the EOT is added)."""
        lengths = [len(ids) for ids in lines]
        if not lengths or min(lengths) == 0:
            raise StoreError(f"document {self.num_docs}: every line needs at least one token, got lengths {lengths}")
        flat = np.fromiter(itertools.chain.from_iterable(lines), np.int64, count=sum(lengths))
        self.add_chunk(flat, np.asarray([sum(lengths)]), np.asarray(lengths))

    def commit(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the files, write ``shard.json`` and rename the shard into place; returns its manifest entry."""
        files = {n: f.close() for n, f in self._files.items()}
        if self.num_docs == 0:
            self.abort()
            raise StoreError(f"shard {self.name} of {self.path} holds no documents")
        entry = {**(record or {}), "name": self.name, "num_tokens": self.num_tokens, "num_docs": self.num_docs,
                 "num_lines": self.num_lines, "max_id": self.max_id, "files": files}
        write_text_atomic(self._tmp / SHARD_RECORD, json.dumps(entry, indent=2))
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / self.name
        if target.exists():  # a leftover no manifest uses (a rebuild of a damaged shard moves the old one first)
            shutil.rmtree(target)
        os.replace(self._tmp, target)
        return entry

    def abort(self) -> None:
        for f in self._files.values():
            f.file.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def read_shard(path: Path, name: str) -> dict[str, Any] | None:
    """A finished shard's record (``shard.json``), or None when it is absent or unreadable."""
    try:
        return json.loads((path / name / SHARD_RECORD).read_text())
    except (OSError, ValueError):
        return None


def publish(path: str | os.PathLike, shards: list[dict[str, Any]], manifest: dict[str, Any], *,
            eot_id: int, vocab_size: int) -> dict[str, Any]:
    """Write the manifest naming ``shards`` (in stream order) atomically, then remove shard folders it does not name.

    The manifest is the store's completion marker; until it is replaced the
    previous store (its manifest and shards) stays whole.
    """
    path = Path(path)
    full = {
        **manifest,
        "format_version": FORMAT_VERSION,
        "dtype": token_dtype(vocab_size).name,
        "eot_id": int(eot_id),
        "vocab_size": int(vocab_size),
        "num_tokens": sum(s["num_tokens"] for s in shards) - (len(shards) - 1),
        "num_docs": sum(s["num_docs"] for s in shards),
        "num_lines": sum(s["num_lines"] for s in shards),
        "max_id": max(s["max_id"] for s in shards),
        "shards": shards,
    }
    write_text_atomic(path / MANIFEST, json.dumps(full, indent=2))
    named = {s["name"] for s in shards}
    for old_file in ("tokens.bin", "doc_offsets.npy", "line_offsets.npy"):  # a format-1 store's files
        (path / old_file).unlink(missing_ok=True)
    for old in path.iterdir():
        if old.is_dir() and old.name.startswith("shard-") and old.name not in named:
            shutil.rmtree(old, ignore_errors=True)
    return full


def write_store(path: str | os.PathLike, store: TokenStore, manifest: dict[str, Any]) -> TokenStore:
    """Write an in-memory ``store`` to ``path`` as one shard, atomically, and return it opened from disk."""
    with StoreWriter(path, eot_id=store.eot_id, vocab_size=store.vocab_size) as writer:
        d, lines = np.asarray(store.doc_offsets), np.asarray(store.line_offsets)
        keep = np.ones(len(store.tokens), bool)
        keep[0] = False
        keep[d[1:] - 1] = False
        ids = np.asarray(store.tokens)[keep]
        line_lengths = np.diff(lines) - np.isin(lines[1:], d[1:])
        writer.shard.add_chunk(ids, np.diff(d) - 1, line_lengths)
        return writer.commit(manifest)


class StoreWriter:
    """A one-shard store at ``path``: documents stream in, :meth:`commit` publishes shard and manifest atomically.

    Use it as a context manager: leaving the block with an exception (or a
    kill) leaves the previous store at ``path`` as it was, and no new folder.
    """

    def __init__(self, path: str | os.PathLike, *, eot_id: int, vocab_size: int):
        self.path = Path(path)
        self.shard = ShardWriter(self.path, f"shard-00000-{uuid.uuid4().hex[:12]}", eot_id=eot_id,
                                 vocab_size=vocab_size)

    def add_document(self, lines: list[list[int]]) -> None:
        self.shard.add_document(lines)

    def commit(self, manifest: dict[str, Any]) -> TokenStore:
        entry = self.shard.commit()
        publish(self.path, [entry], manifest, eot_id=self.shard.eot_id, vocab_size=self.shard.vocab_size)
        return TokenStore.open(self.path)

    def abort(self) -> None:
        self.shard.abort()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
