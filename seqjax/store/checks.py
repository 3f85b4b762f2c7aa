"""A token store checked against its manifest: a usable manifest, every file's size (and, when asked, its
checksum and token range), each problem named with the file, what the manifest records and what is found."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from seqjax.core.errors import StoreError
from seqjax.store.layout import FORMAT_VERSION, MANIFEST, REBUILD_HINT, TOKENS, file_checksum, token_dtype
from seqjax.store.stream import TokenStream


def read_manifest(path: Path) -> dict[str, Any]:
    """The store's manifest, or a StoreError saying why there is no usable one."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise StoreError(
            f"no complete token store at {path} (missing {MANIFEST}); run python -m seqjax.prepare")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise StoreError(
            f"token store {path}: {MANIFEST} is not valid JSON ({err}); {REBUILD_HINT}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreError(
            f"token store {path} has format_version {manifest.get('format_version')}, "
            f"expected {FORMAT_VERSION}; rebuild it"
        )
    return manifest


def check_files(path: Path, manifest: dict[str, Any], *, checksums: bool) -> list[str]:
    """What is wrong with the store's files against its manifest: sizes always, checksums when
    asked."""
    return [
        problem for shard in manifest["shards"] for problem in shard_problems(
            path, shard, checksums=checksums, vocab_size=manifest["vocab_size"])
    ]


def shard_problems(path: Path, shard: dict[str, Any], *, checksums: bool, vocab_size: int) -> list[str]:
    """What is wrong with one shard's files: each problem names the file, what the manifest records
    and what is found.

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
            problems.append(
                f"{file} is {size:,} bytes, the manifest records {record['bytes']:,} (truncated or "
                "overwritten)")
        elif checksums and (found := file_checksum(file)) != record["xxh3"]:
            problem = (
                f"{file} has checksum xxh3:{found}, the manifest records xxh3:{record['xxh3']} (its contents "
                "changed after the build)")
            if name == TOKENS:
                tokens = np.memmap(file, dtype=token_dtype(vocab_size), mode="r")
                outside = np.flatnonzero(tokens >= vocab_size)
                if len(outside):
                    problem += (
                        f"; it holds token id {int(tokens[outside[0]])} at position {int(outside[0])}, "
                        f"outside the vocabulary of {vocab_size}")
            problems.append(problem)
    return problems


def id_range_problem(store, manifest: dict[str, Any]) -> str | None:
    """An out-of-vocabulary id in the tokens, or a maximum that disagrees with the manifest's, as a
    message."""
    tokens = store.tokens
    parts = tokens.parts if isinstance(tokens, TokenStream) else [tokens]
    found = max(int(np.max(p)) for p in parts)
    if found >= store.vocab_size:
        return f"its tokens hold id {found}, outside the vocabulary of {store.vocab_size}"
    if "max_id" in manifest and found != manifest["max_id"]:
        return f"its largest token id is {found}, the manifest records {manifest['max_id']}"
    return None
