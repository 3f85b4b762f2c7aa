"""One shard of a token store: its files' documents (or instruction records) read in chunks, encoded
on every core in order, and written atomically with its record (the counts prepare's summary
reports)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from seqjax.config.tree import SourceConfig
from seqjax.core.errors import CorpusError
from seqjax.store.cache import content_hash, file_identity
from seqjax.store.corpus import file_documents, file_records
from seqjax.store.encoding import encode_in_order
from seqjax.store.image_chats import image_parts
from seqjax.store.spec import IMAGE_BASE, ExampleSpec
from seqjax.store.splits import in_carved_split
from seqjax.store.tokenizer import Tokenizer
from seqjax.store.writer import ShardWriter

# Characters of text per encoding task: large enough to amortize the hand-off, small enough for
# bounded memory.
CHUNK_CHARS = 1 << 22
# Chats with images: what one image adds to a chunk's size (its resized pixels, up to a few MB,
# cross the process boundary).
IMAGE_CHARS = 1 << 17
# A shard with less source than this is encoded in this process: starting worker processes would
# cost more.
POOL_MIN_BYTES = 1 << 23
# preference stores: pairs of equal completions, of an empty one, and pairs left out
# (data.degenerate_pairs)
log = logging.getLogger(__name__)

PAIR_COUNTS = ("pairs_identical", "pairs_empty", "pairs_dropped")


@dataclass
class Counts:
    documents: int = 0
    skipped_empty: int = 0
    bytes: int = 0
    words: int = 0
    lines: int = 0
    scored_tokens: int = 0
    scored_bytes: int = 0
    dropped_unscored: int = 0
    pairs_identical: int = 0
    pairs_empty: int = 0
    pairs_dropped: int = 0
    carved_out: int = 0
    sources: list[dict[str, Any]] = field(default_factory=list)


def plan_shards(identities: list[dict[str, Any]], shard_bytes: int) -> list[list[int]]:
    """Consecutive files grouped into shards of up to ``shard_bytes`` of source (a larger file
    alone).

    Sizes ``[5, 5, 20, 1]`` with ``shard_bytes=10`` give ``[[0, 1], [2], [3]]``:
    the same plan whoever builds it, so one process and many build one store.
    """
    shards: list[list[int]] = []
    size = 0
    for i, identity in enumerate(identities):
        if not shards or size + identity["bytes"] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += identity["bytes"]
    return shards


def records(source: SourceConfig, files: list[Path], spec: ExampleSpec, counts: Counts,
             carve: tuple[str, float] | None = None) -> Iterator[list]:
    """The ``(where, record)`` examples of ``files`` in chunks of about CHUNK_CHARS characters of
    JSON."""
    chunk, size = [], 0
    for path in files:
        for where, record in file_records(source, path, spec.fields):
            if carve is not None and not in_carved_split(json.dumps(record, sort_keys=True), carve):
                counts.carved_out += 1
                continue
            if spec.image_spec is not None:  # where its image paths start (after the carve: not part of its hash)
                record[IMAGE_BASE] = str(path.parent)
            chunk.append((where, record))
            # an image counts as IMAGE_CHARS: a chunk holds a few dozen resized images, not
            # thousands
            size += len(str(record)) + IMAGE_CHARS * len(image_parts(record.get(spec.messages_field) or []))
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def documents(source: SourceConfig, files: list[Path], counts: Counts,
               carve: tuple[str, float] | None = None) -> Iterator[list[str]]:
    """The non-empty documents of ``files`` in chunks of about CHUNK_CHARS characters (empty ones
    are counted)."""
    chunk, size = [], 0
    for path in files:
        for doc in file_documents(source, path):
            if not doc.strip():
                counts.skipped_empty += 1
                continue
            if carve is not None and not in_carved_split(doc, carve):
                counts.carved_out += 1
                continue
            chunk.append(doc)
            size += len(doc)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def build_shard(path: Path, name: str, source: SourceConfig, files: list[Path], tokenizer: Tokenizer,
                workers: int, bar: Any, spec: ExampleSpec | None = None,
                carve: tuple[str, float] | None = None) -> dict[str, Any]:
    """Tokenize ``files`` into the shard ``path/name`` (atomically); returns its record."""
    counts = Counts()
    source_bytes = sum(file_identity(p)["bytes"] for p in files)
    use = workers if source_bytes >= POOL_MIN_BYTES else 1
    chunks = documents(source, files, counts, carve) if spec is None else records(
        source, files, spec, counts, carve)
    with ShardWriter(path, name, eot_id=tokenizer.separator_id, vocab_size=tokenizer.vocab_size,
                     scored=spec is not None,
                     weights_dtype=spec.weights_dtype if spec else "uint8",
                     images=spec is not None and spec.image_spec is not None) as writer:
        read: set[tuple[str, int, int]] = set()  # image files
        for chunk in encode_in_order(tokenizer, chunks, use, spec):
            writer.add_chunk(chunk.ids, chunk.doc_lengths, chunk.line_lengths, chunk.weights, chunk.images,
                             chunk.doc_images)
            read.update(chunk.image_files or [])
            counts.documents += len(chunk.doc_lengths)
            for key in ("bytes", "words", "lines", "scored_tokens", "scored_bytes", "dropped_unscored",
                        *PAIR_COUNTS):
                setattr(counts, key, getattr(counts, key) + getattr(chunk, key))
            bar.update(chunk.bytes)
        if counts.documents == 0 and getattr(counts, "pairs_dropped", 0):  # (data.degenerate_pairs=drop took all)
            raise CorpusError(
                f"{', '.join(map(str, files))}: every pair was dropped by "
                f"data.degenerate_pairs=drop ({counts.pairs_identical} with equal completions, "
                f"{counts.pairs_empty} with an empty one); expected pairs whose completions "
                "differ, or data.degenerate_pairs=keep (TRL trains them)")
        if counts.documents == 0:
            what = (f"{counts.dropped_unscored} examples with no scored token" if spec is not None
                    else f"{counts.skipped_empty} empty or whitespace-only")
            raise CorpusError(
                f"{', '.join(map(str, files))}: no non-empty {'examples' if spec else 'documents'} "
                f"({what})")
        sources = [{**file_identity(p), "xxh3": content_hash(p)} for p in files]
        keys = ("documents", "skipped_empty", "bytes", "words", "lines")
        if spec is not None:
            keys += ("scored_tokens", "scored_bytes", "dropped_unscored")
        if spec is not None and spec.format == "preference":
            keys += PAIR_COUNTS
            if counts.pairs_dropped:
                log.warning("%s: data.degenerate_pairs=drop left out %d pair(s) (%d with equal completions, %d with "
                            "an empty one)", name, counts.pairs_dropped, counts.pairs_identical, counts.pairs_empty)
        if carve is not None:  # documents that went to the other split of the carve
            keys += ("carved_out",)
        stats = {k: getattr(counts, k) for k in keys}
        record: dict[str, Any] = {"sources": sources, "stats": stats}
        if writer.images:  # what a batch finds an image's tokens by; the files a reuse checks
            record["image_token_id"] = tokenizer.token_id(spec.image_token)
            record["image_files"] = [list(f) for f in sorted(read)]
        return writer.commit(record)
