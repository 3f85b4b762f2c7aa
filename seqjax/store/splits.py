"""Which sources give a split, and the validation split carved from train files.

A source that lists no ``valid_files``, under ``data.validation_split_percentage > 0``, gives its
validation split from its train documents: those whose text hashes below the percentage go to valid,
the others stay in train (run_clm's ``validation_split_percentage``, but by hash rather than
position, so the same documents in every run, process and file order).
"""

from __future__ import annotations

import xxhash

from seqjax.config.tree import Config, SourceConfig
from seqjax.core.errors import CorpusError


def carved(source: SourceConfig, split: str, percentage: float) -> tuple[str, float] | None:
    """``(split, percentage)`` when ``split`` of ``source`` is cut from its train files, else None.

    A source that lists no valid_files, under ``data.validation_split_percentage > 0``,
    gives its validation split from its train documents: those whose text hashes
    below the percentage go to valid, the others stay in train.
    """
    if source.corpus == "wikitext2" or source.valid_files or percentage <= 0 or split not in (
            "train", "valid"):
        return None
    return split, percentage


def in_carved_split(text: str, carve: tuple[str, float]) -> bool:
    """Whether a document (or a record's JSON) belongs to ``carve[0]``: a hash of its text, never
    its position, so the split is the same in every run, process and file order."""
    below = xxhash.xxh3_64_intdigest(text.encode("utf-8")) % 10_000 < carve[1] * 100
    return below if carve[0] == "valid" else not below


def has_split(config: Config, split: str) -> bool:
    """Whether some source gives ``split``: WikiText-2, listed files, or (valid) a carve of the
    train files."""
    percentage = config.data.validation_split_percentage
    return split == "train" or any(
        s.corpus == "wikitext2" or getattr(s, f"{split}_files") or carved(s, split, percentage)
        for s in config.data.resolved_sources())


def split_sources(sources: list[SourceConfig], split: str,
                  percentage: float = 0.0) -> list[SourceConfig]:
    """The sources that hold ``split``: all for train; for valid/test those that list files
    (WikiText-2 always) or, for valid, carve it from their train files."""
    if split == "train":
        return sources
    found = [s for s in sources
             if s.corpus == "wikitext2" or getattr(s, f"{split}_files") or carved(s, split, percentage)]
    if not found:
        what = "data.sources: no source lists" if len(sources) > 1 else "data:"
        raise CorpusError(f"{what} {split}_files: got [], expected at least one file"
                          + (" (or data.validation_split_percentage > 0 to carve it from train)"
                             if split == "valid" else ""))
    return found
