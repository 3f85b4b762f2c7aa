"""The token store: one split as a flat, memory-mapped token array plus document and line offsets.

Layout of a store folder (one per split)::

    tokens.bin        the stream, uint16 when the vocabulary fits, else uint32
    doc_offsets.npy   int64 [n_docs + 1]
    line_offsets.npy  int64 [n_lines + 1]
    manifest.json     dtype, counts, eot_id, vocab_size, tokenizer and source hashes

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

Why one flat array: every chunking strategy becomes index arithmetic on
offsets (vectorized numpy, O(n)), reads are zero-copy slices of a memmap, and
many processes can share the pages.

Writes are atomic: files go to a temporary sibling folder that is renamed into
place only when complete, so a killed build never leaves a store that looks
complete, and an existing store is never half-overwritten. :class:`StoreWriter`
streams documents to disk (prepare uses it); :func:`write_store` writes an
in-memory store. ``TokenStore.open(path, tokenizer_hash=...)`` refuses a store
built by another tokenizer.
"""

from __future__ import annotations

import array
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seqjax.errors import StoreError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the memory and bandwidth whenever the ids fit."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


@dataclass
class TokenStore:
    """A read-only view of one split. Build with :func:`write_store` / open with :meth:`open`."""

    tokens: np.ndarray
    doc_offsets: np.ndarray
    line_offsets: np.ndarray
    eot_id: int
    vocab_size: int
    manifest: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def __post_init__(self) -> None:
        self.validate()

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
        return cls(
            tokens=tokens,
            doc_offsets=np.asarray(doc_offsets, np.int64),
            line_offsets=np.asarray(line_offsets, np.int64),
            eot_id=int(eot_id),
            vocab_size=int(vocab_size),
        )

    @classmethod
    def open(cls, path: str | os.PathLike, *, tokenizer_hash: str | None = None) -> "TokenStore":
        """Memory-map a finished store folder; refuse one without a manifest (an interrupted build).

        With ``tokenizer_hash``, also refuse a store built by any other
        tokenizer: its ids would mean different text, silently.
        """
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise StoreError(f"no complete token store at {path} (missing {MANIFEST}); run python -m seqjax.prepare")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format_version") != FORMAT_VERSION:
            raise StoreError(
                f"token store {path} has format_version {manifest.get('format_version')}, "
                f"expected {FORMAT_VERSION}; rebuild it"
            )
        built_with = manifest.get("tokenizer_hash")
        if tokenizer_hash is not None and built_with != tokenizer_hash:
            raise StoreError(
                f"token store {path} was built with tokenizer {str(built_with)[:12]}, but the tokenizer in use is "
                f"{tokenizer_hash[:12]}; refusing it. Rebuild the store with this tokenizer (python -m seqjax.prepare)"
            )
        tokens = np.memmap(path / "tokens.bin", dtype=np.dtype(manifest["dtype"]), mode="r")
        return cls(
            tokens=tokens,
            doc_offsets=np.load(path / "doc_offsets.npy"),
            line_offsets=np.load(path / "line_offsets.npy"),
            eot_id=int(manifest["eot_id"]),
            vocab_size=int(manifest["vocab_size"]),
            manifest=manifest,
            path=path,
        )

    # -- queries ----------------------------------------------------------

    @property
    def num_docs(self) -> int:
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
        d, lines = self.doc_offsets, self.line_offsets
        if n == 0 or self.num_docs < 1:
            raise StoreError(f"token store{where} is empty: it holds no documents")
        if d[0] != 1 or d[-1] != n or np.any(np.diff(d) < 1):
            raise StoreError(f"token store{where}: doc_offsets must rise from 1 to {n}")
        if lines[0] != 1 or lines[-1] != n or np.any(np.diff(lines) < 1):
            raise StoreError(f"token store{where}: line_offsets must rise from 1 to {n}")
        if not np.all(np.isin(d, lines)):
            raise StoreError(f"token store{where}: every document boundary must be a line boundary")
        if self.tokens[0] != self.eot_id or np.any(self.tokens[d[1:] - 1] != self.eot_id):
            raise StoreError(f"token store{where}: documents must be separated by eot_id={self.eot_id}")


def _staging_dir(path: Path) -> Path:
    """A fresh hidden folder beside ``path``; leftovers of builds whose process is gone are removed first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.*.tmp"):
        pid = old.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp's private 0700 would hide a shared cache from other users
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(tmp: Path, path: Path, doc_offsets, line_offsets, dtype: np.dtype, num_tokens: int,
             eot_id: int, vocab_size: int, manifest: dict[str, Any]) -> TokenStore:
    """Finish a staging folder whose ``tokens.bin`` is written, and rename it into place.

    The manifest is the completion marker, so it is written last; an existing
    store at ``path`` is replaced only by the final renames.
    """
    np.save(tmp / "doc_offsets.npy", np.asarray(doc_offsets, np.int64))
    np.save(tmp / "line_offsets.npy", np.asarray(line_offsets, np.int64))
    full = {
        **manifest,
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "eot_id": int(eot_id),
        "vocab_size": int(vocab_size),
        "num_tokens": int(num_tokens),
        "num_docs": len(doc_offsets) - 1,
        "num_lines": len(line_offsets) - 1,
    }
    (tmp / MANIFEST).write_text(json.dumps(full, indent=2))
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return TokenStore.open(path)


def write_store(path: str | os.PathLike, store: TokenStore, manifest: dict[str, Any]) -> TokenStore:
    """Write an in-memory ``store`` to ``path`` atomically and return it opened from disk."""
    path = Path(path)
    tmp = _staging_dir(path)
    try:
        dtype = token_dtype(store.vocab_size)
        np.asarray(store.tokens, dtype).tofile(tmp / "tokens.bin")
        return _publish(tmp, path, store.doc_offsets, store.line_offsets, dtype, store.num_tokens,
                        store.eot_id, store.vocab_size, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class StoreWriter:
    """Streams documents into a staging folder beside ``path``; :meth:`commit` publishes the store atomically.

    Memory stays at one document's tokens plus the offsets, so a corpus larger
    than RAM can be written. Use it as a context manager: leaving the block
    with an exception (or a kill) leaves no folder at ``path``, only a hidden
    staging folder that the next build removes.
    """

    def __init__(self, path: str | os.PathLike, *, eot_id: int, vocab_size: int):
        self.path = Path(path)
        self.eot_id = int(eot_id)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(vocab_size)
        self._tmp = _staging_dir(self.path)
        self._file = open(self._tmp / "tokens.bin", "wb")
        self._file.write(np.asarray([self.eot_id], self.dtype).tobytes())
        self.num_tokens = 1
        # int64 arrays, not lists: 8 bytes per offset instead of a Python int's ~36
        self.doc_offsets = array.array("q", [1])
        self.line_offsets = array.array("q", [1])

    def add_document(self, lines: list[list[int]]) -> None:
        """Append one document given as the token ids of each of its lines (text only; the EOT is added)."""
        lengths = [len(ids) for ids in lines]
        if not lengths or min(lengths) == 0:
            raise StoreError(
                f"document {len(self.doc_offsets) - 1}: every line needs at least one token, got lengths {lengths}"
            )
        lengths[-1] += 1  # the closing EOT belongs to the last line
        count = sum(lengths)
        flat = np.fromiter(
            itertools.chain(itertools.chain.from_iterable(lines), (self.eot_id,)), self.dtype, count=count
        )
        self._file.write(flat.tobytes())
        ends = itertools.accumulate(lengths, initial=self.num_tokens)
        next(ends)  # the start, recorded by the previous document
        self.line_offsets.extend(ends)
        self.num_tokens += count
        self.doc_offsets.append(self.num_tokens)

    def commit(self, manifest: dict[str, Any]) -> TokenStore:
        """Finish the files, publish the folder at ``path`` and return the store opened from disk."""
        self._file.close()
        return _publish(self._tmp, self.path, self.doc_offsets, self.line_offsets, self.dtype, self.num_tokens,
                        self.eot_id, self.vocab_size, manifest)

    def abort(self) -> None:
        self._file.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
