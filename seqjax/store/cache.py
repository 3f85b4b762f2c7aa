"""The prepare cache's bookkeeping: what identifies a source file and a corpus, locks, and the
process group.

:func:`seqjax.store.build.prepare` keys every cached folder by what made it (the
layout is in its docstring): a source file by path, size and modification
time (:func:`file_identity`), a corpus by its settings (:func:`corpus_key`),
a tokenizer by its training recipe. Folders are built under a file lock
(:func:`locked`), and a multi-host prepare waits at barriers (:class:`ProcessGroup`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from seqjax.config.tree import Config, SourceConfig

# Bump when the way text becomes a store changes, so old caches are rebuilt rather than trusted.
BUILDER_VERSION = 3  # 3: instruction examples stored as they are (no separator trained)


@dataclass
class ProcessGroup:
    """What one prepare call shares between its steps: who this process is, and how to wait for the
    others."""

    process_index: int = 0
    process_count: int = 1
    barrier: Callable[[str], None] | None = None
    verify: bool = False
    workers: int = 1

    @property
    def main(self) -> bool:
        return self.process_index == 0

    def wait(self, name: str) -> None:
        if self.process_count > 1:
            self.barrier(name)


def file_identity(path: Path, content: bool = False) -> dict[str, Any]:
    """What reuse compares for a source: path, size and modification time (a folder: over the files
    inside); ``content`` (``data.cache_identity=content``): its name, size and an xxh3 of its bytes,
    the same wherever the file was moved or copied."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [p.stat() for p in files]
    if content:
        return {"name": path.name, "bytes": sum(s.st_size for s in stats), "xxh3": content_hash(path)}
    return {"path": str(path.resolve()), "bytes": sum(s.st_size for s in stats),
            "mtime_ns": max((s.st_mtime_ns for s in stats), default=0)}


def content_hash(path: Path) -> str:
    """xxh3-128 of a source's bytes (a folder: of its files in order), recorded at build, compared
    by ``verify``."""
    digest = xxhash.xxh3_128()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        with open(file, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    return digest.hexdigest()


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def corpus_key(source: SourceConfig | Config, split: str = "train", files: list[Path] | None = None) -> str:
    """The folder of one split's store: ``wikitext2-tokens``, or ``jsonl-<hash of what makes that
    split>``.

    The hash covers only that split's files and how they are read (field, format),
    so adding a validation file never moves (or rebuilds) the train store.
    """
    if isinstance(source, Config):
        source = source.data.resolved_sources()[0]
    if source.corpus == "wikitext2":
        return f"wikitext2-{source.variant}"
    # (data.cache_identity=content passes the split's files: named by what they hold, not where they
    # are)
    settings = [getattr(source, f"{split}_files") if files is None else [file_identity(p, True) for p in files]]
    if source.text_field != "text":
        settings.append(source.text_field)
    if source.format != "text":
        settings.append(source.format)
    return f"{source.corpus}-{digest(settings)[:12]}"


def writable(folder: Path) -> bool:
    """Whether ``folder`` (or, when it does not exist yet, its nearest existing parent) can be written."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK)


@contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if needed) while building in it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
