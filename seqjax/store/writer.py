"""Writing token stores: a shard streamed to a hidden staging folder, renamed into place, then the
manifest.

The layout and the reader are in :mod:`seqjax.store.reader`; this module is the
other half, the atomic writes its docstring promises. :class:`ShardWriter`
streams documents into one shard, checksumming each file as it is written;
:func:`publish` writes the manifest of finished shards; :class:`StoreWriter`
and :func:`write_store` write a one-shard store (tests, small corpora).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from seqjax.core.errors import StoreError
from seqjax.core.files import write_text_atomic
from seqjax.store.layout import (
    DOC_IMAGES,
    DOC_OFFSETS,
    FILES,
    FORMAT_VERSION,
    IMAGE_FILES,
    IMAGE_SHAPES,
    LINE_OFFSETS,
    MANIFEST,
    MASK_DTYPE,
    OFFSET_DTYPE,
    PIXELS,
    SHARD_RECORD,
    TOKENS,
    WEIGHTS,
    token_dtype,
)
from seqjax.store.reader import TokenStore


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def staging_dir(path: Path, what: str) -> Path:
    """A fresh hidden folder beside ``path``; leftovers of builds whose process is gone are removed
    first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.*.tmp"):
        pid = old.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f".{path.name}.{what}.{os.getpid()}.", suffix=".tmp",
                         dir=path.parent))
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
    """Streams documents into one shard of the store at ``path``; :meth:`commit` publishes it as
    ``path/<name>``.

    Memory stays at one chunk of documents: tokens and offsets go to disk as
    they come, with their checksums. The shard is written in a hidden staging
    folder beside ``path`` and renamed into place only after its
    ``shard.json``, so a killed build leaves no shard that looks complete
    (the next build removes the staging folder). Use it as a context manager:
    leaving the block with an exception removes the staging folder.
    """

    def __init__(self, path: str | os.PathLike, name: str, *, eot_id: int, vocab_size: int,
                 scored: bool = False, weights_dtype: str = MASK_DTYPE.name, images: bool = False):
        self.path, self.name = Path(path), name
        self.scored = scored  # instruction examples: a weights.bin beside the tokens
        self.images = images  # chats with images: their pixels beside the tokens (IMAGE_FILES)
        # uint8 (0/1) or float32 (data.loss_weights_dtype)
        self.weights_dtype = np.dtype(weights_dtype)
        self.eot_id = int(eot_id)
        self.vocab_size = int(vocab_size)
        self.dtype = token_dtype(vocab_size)
        self._tmp = staging_dir(self.path, name)
        self._files = {n: _HashedFile(self._tmp / n)
                       for n in FILES + ((WEIGHTS,) if scored else ()) + (IMAGE_FILES if images else ())}
        if images:
            self._files[DOC_IMAGES].write(np.zeros(1, OFFSET_DTYPE))
            self.num_images = 0
        self._files[TOKENS].write(np.asarray([self.eot_id], self.dtype))
        if scored:
            self._files[WEIGHTS].write(np.zeros(1, self.weights_dtype))
        self._files[DOC_OFFSETS].write(np.asarray([1], OFFSET_DTYPE))
        self._files[LINE_OFFSETS].write(np.asarray([1], OFFSET_DTYPE))
        self.num_tokens, self.num_docs, self.num_lines = 1, 0, 0
        self.max_id = self.eot_id

    def add_chunk(self, ids: np.ndarray, doc_lengths: np.ndarray, line_lengths: np.ndarray,
                  weights: np.ndarray | None = None, images: list[np.ndarray] | None = None,
                  doc_images: np.ndarray | None = None) -> None:
        """Append documents given flat: all their text ids, tokens per document, tokens per line
        (EOTs are added).

        ``ids=[5, 6, 7]``, ``doc_lengths=[2, 1]``, ``line_lengths=[1, 1, 1]``
        appends ``5 6 EOT 7 EOT``: documents end at +3 and +5, lines at +1, +3, +5.
        A scored shard also takes ``weights``, one per appended token (each
        document's tokens, then its closing EOT): ``[0, 1, 1, 1, 0]`` above.
        A shard of images also takes ``images`` (uint8 [H, W, 3] each, in order) and ``doc_images``,
        how many of them each document has.
        """
        if self.scored != (weights is not None):
            raise StoreError(
                f"shard {self.name}: weights are required for a scored shard and only for one")
        ids, doc_lengths, line_lengths = (np.asarray(a) for a in (ids, doc_lengths, line_lengths))
        if len(doc_lengths) == 0:
            return
        if min(doc_lengths.min(),
               line_lengths.min()) < 1 or not len(ids) == doc_lengths.sum() == line_lengths.sum():
            raise StoreError(
                f"shard {self.name}: every document and line needs at least one token, and the lengths "
                "must add up to the ids given")
        if len(ids) and (int(ids.max()) >= self.vocab_size or int(ids.min()) < 0):
            raise StoreError(
                f"shard {self.name}: token id {int(ids.max())} is outside the vocabulary of "
                f"{self.vocab_size}")
        doc_ends = np.cumsum(doc_lengths)  # in ids, exclusive
        out_ends = doc_ends + np.arange(1, len(doc_ends) + 1)  # each document followed by its EOT
        out = np.full(int(out_ends[-1]), self.eot_id, self.dtype)
        keep = np.ones(len(out), bool)
        keep[out_ends - 1] = False
        out[keep] = ids
        # a line ends in the ids at its cumulative length; each line is shifted by the EOTs before
        # it, and a document's last line also takes its own EOT
        line_ends = np.cumsum(line_lengths)
        eots_before = np.searchsorted(doc_ends, line_ends, "left")
        line_ends_out = line_ends + eots_before + np.isin(line_ends, doc_ends)
        if weights is not None:
            if len(weights) != len(out):
                raise StoreError(f"shard {self.name}: {len(weights)} weights for {len(out)} tokens")
            self._files[WEIGHTS].write(np.asarray(weights, self.weights_dtype))
        if self.images:
            self._add_images(images or [], np.zeros(len(doc_lengths), np.int64) if doc_images is None else doc_images)
        self._files[TOKENS].write(out)
        self._files[DOC_OFFSETS].write((out_ends + self.num_tokens).astype(OFFSET_DTYPE))
        self._files[LINE_OFFSETS].write((line_ends_out + self.num_tokens).astype(OFFSET_DTYPE))
        self.num_tokens += len(out)
        self.num_docs += len(doc_lengths)
        self.num_lines += len(line_lengths)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))

    def _add_images(self, images: list[np.ndarray], doc_images: np.ndarray) -> None:
        if sum(doc_images) != len(images):
            raise StoreError(f"shard {self.name}: {len(images)} images for documents that have {sum(doc_images)}")
        for image in images:
            self._files[PIXELS].write(np.asarray(image, np.uint8))
        shapes = np.asarray([image.shape[:2] for image in images], np.int32).reshape(-1, 2)
        self._files[IMAGE_SHAPES].write(shapes)
        self._files[DOC_IMAGES].write((self.num_images + np.cumsum(doc_images)).astype(OFFSET_DTYPE))
        self.num_images += len(images)

    def add_document(self, lines: list[list[int]], weights: list[int] | None = None) -> None:
        """Append one document given as the token ids of each of its lines (text only; the EOT is
        added)."""
        lengths = [len(ids) for ids in lines]
        if not lengths or min(lengths) == 0:
            raise StoreError(
                f"document {self.num_docs}: every line needs at least one token, got lengths {lengths}"
            )
        flat = np.fromiter(itertools.chain.from_iterable(lines), np.int64, count=sum(lengths))
        self.add_chunk(flat, np.asarray([sum(lengths)]), np.asarray(lengths),
                       None if weights is None else np.asarray(weights))

    def commit(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the files, write ``shard.json`` and rename the shard into place; returns its
        manifest entry."""
        files = {n: f.close() for n, f in self._files.items()}
        if self.num_docs == 0:
            self.abort()
            raise StoreError(f"shard {self.name} of {self.path} holds no documents")
        entry = {
            **(record or {}), "name": self.name, "num_tokens": self.num_tokens,
            "num_docs": self.num_docs, "num_lines": self.num_lines, "max_id": self.max_id,
            "files": files
        }
        # (absent: uint8, as every store before float32 weights)
        if self.scored and self.weights_dtype != MASK_DTYPE:
            entry["weights_dtype"] = self.weights_dtype.name
        if self.images:
            entry["num_images"] = self.num_images
        write_text_atomic(self._tmp / SHARD_RECORD, json.dumps(entry, indent=2))
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / self.name
        # a leftover no manifest uses (a rebuild of a damaged shard moves the old one first)
        if target.exists():
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


def publish(path: str | os.PathLike, shards: list[dict[str, Any]], manifest: dict[str, Any], *,
            eot_id: int, vocab_size: int) -> dict[str, Any]:
    """Write the manifest naming ``shards`` (in stream order) atomically, then remove shard folders
    it does not name.

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
    # a format-1 store's files
    for old_file in ("tokens.bin", "doc_offsets.npy", "line_offsets.npy"):
        (path / old_file).unlink(missing_ok=True)
    for old in path.iterdir():
        if old.is_dir() and old.name.startswith("shard-") and old.name not in named:
            shutil.rmtree(old, ignore_errors=True)
    return full


def write_store(path: str | os.PathLike, store: TokenStore, manifest: dict[str, Any]) -> TokenStore:
    """Write an in-memory ``store`` to ``path`` as one shard, atomically, and return it opened from
    disk."""
    weights_dtype = MASK_DTYPE.name if store.mask is None else np.dtype(store.mask.dtype).name
    with StoreWriter(path, eot_id=store.eot_id, vocab_size=store.vocab_size, scored=store.mask
                     is not None, weights_dtype=weights_dtype) as writer:
        d, lines = np.asarray(store.doc_offsets), np.asarray(store.line_offsets)
        keep = np.ones(len(store.tokens), bool)
        keep[0] = False
        keep[d[1:] - 1] = False
        ids = np.asarray(store.tokens)[keep]
        line_lengths = np.diff(lines) - np.isin(lines[1:], d[1:])
        weights = None if store.mask is None else np.asarray(store.mask)[1:]
        writer.shard.add_chunk(ids, np.diff(d) - 1, line_lengths, weights)
        return writer.commit(manifest)


class StoreWriter:
    """A one-shard store at ``path``: documents stream in, :meth:`commit` publishes shard and
    manifest atomically.

    Use it as a context manager: leaving the block with an exception (or a
    kill) leaves the previous store at ``path`` as it was, and no new folder.
    """

    def __init__(self, path: str | os.PathLike, *, eot_id: int, vocab_size: int, scored: bool = False,
                 weights_dtype: str = MASK_DTYPE.name):
        self.path = Path(path)
        self.shard = ShardWriter(self.path, f"shard-00000-{uuid.uuid4().hex[:12]}", eot_id=eot_id,
                                 vocab_size=vocab_size, scored=scored, weights_dtype=weights_dtype)

    def add_document(self, lines: list[list[int]], weights: list[int] | None = None) -> None:
        self.shard.add_document(lines, weights)

    def commit(self, manifest: dict[str, Any]) -> TokenStore:
        entry = self.shard.commit()
        publish(self.path, [entry], manifest, eot_id=self.shard.eot_id,
                vocab_size=self.shard.vocab_size)
        return TokenStore.open(self.path)

    def abort(self) -> None:
        self.shard.abort()

    def __enter__(self) -> "StoreWriter":
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
