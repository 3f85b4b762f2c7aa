"""Build (or reuse) the tokenizer and the token stores: the one entry point is :func:`prepare`.

Cache layout under ``data.cache_dir``::

    tokenizers/<recipe>/tokenizer.json     trained tokenizers, keyed by what they were trained from
    stores/<tokenizer hash>/<corpus>/      one folder per tokenizer and corpus, so several coexist
        train/ valid/ test/                token stores (see seqjax.data.store)
        config.yaml                        the resolved config of the last prepare run

Each store's manifest records a *build key*: the tokenizer's SHA-256, the
SHA-256 of every source file, the corpus settings and the builder version. A
store is reused when its key equals the key the current config and files give
(hashing ~13 MB of WikiText-2 takes milliseconds, so reuse stays well under a
second); otherwise it is rebuilt in a staging folder and swapped in atomically.

Tokenizer mismatch policy: inside this cache the folder is keyed by the
tokenizer hash, so prepare never uses a store with another tokenizer's ids; a
store whose manifest disagrees is rebuilt, because prepare owns those folders.
A store opened by path elsewhere goes through ``TokenStore.open(path,
tokenizer_hash=...)``, which *refuses* a mismatch and changes nothing.

Builds take a file lock per folder, so several processes (one per host or per
test worker) may call prepare at once: one builds, the others wait and reuse.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from seqjax.config import Config
from seqjax.data.corpus import (
    SPLITS,
    CorpusError,
    SplitText,
    count_lines,
    count_words,
    find_sources,
    read_split,
    split_lines,
)
from seqjax.data.store import MANIFEST, StoreWriter, TokenStore
from seqjax.data.tokenizer import Tokenizer, check_vocab_size, special_tokens_for, train_tokenizer

log = logging.getLogger(__name__)

# Bump when the way text becomes a store changes, so old caches are rebuilt rather than trusted.
BUILDER_VERSION = 1
# Lines per encode_batch call: large enough to keep the Rust threads busy, small enough for a live progress bar.
ENCODE_CHUNK_LINES = 4096


@dataclass
class Prepared:
    """What :func:`prepare` returns: the tokenizer, one opened store per split, and the summary printed by the CLI."""

    tokenizer: Tokenizer
    stores: dict[str, TokenStore]
    summary: dict[str, dict[str, Any]]
    root: Path


def file_record(path: Path) -> dict[str, Any]:
    """A source file's identity: content hash and size (the path is kept for people, not compared)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": digest}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def corpus_key(config: Config) -> str:
    """A folder name for the corpus a config reads: ``wikitext2-tokens``, ``jsonl-<hash of the file lists>``, ..."""
    d = config.data
    if d.corpus == "wikitext2":
        return f"wikitext2-{d.variant}"
    return f"{d.corpus}-{_digest([d.train_files, d.valid_files, d.test_files])[:12]}"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (created if needed) while building in it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------
# Tokenizer


def special_tokens(config: Config) -> list[str]:
    """The configured special tokens, plus ``<unk>`` when reading word-level WikiText-2."""
    word_level = config.data.corpus == "wikitext2" and config.data.variant == "tokens"
    return special_tokens_for(config.tokenizer.special_tokens, word_level)


def obtain_tokenizer(config: Config, train_sha256: list[str] | None, read_train: Callable[[], SplitText]) -> Tokenizer:
    """Load ``tokenizer.path``, or the cached tokenizer trained on these train files, or train it now."""
    specials = special_tokens(config)
    if config.tokenizer.path:
        return Tokenizer(Path(config.tokenizer.path).expanduser(), specials[0], config.tokenizer.bos_token)
    recipe = {
        "builder_version": BUILDER_VERSION,
        "corpus": config.data.corpus,
        "train_sha256": train_sha256,
        "vocab_size": config.tokenizer.vocab_size,
        "min_frequency": config.tokenizer.min_frequency,
        "special_tokens": specials,
    }
    folder = Path(config.data.cache_dir).expanduser() / "tokenizers" / _digest(recipe)[:16]
    path = folder / "tokenizer.json"
    with _locked(folder):
        if path.is_file():
            return Tokenizer(path, specials[0])
        train: SplitText = read_train()
        lines = [line for doc in train.documents for line in split_lines(doc)]
        log.info("training a %d-token byte-level BPE on %s train lines", config.tokenizer.vocab_size, f"{len(lines):,}")
        start = time.perf_counter()
        tokenizer = train_tokenizer(
            lines,
            path,
            vocab_size=config.tokenizer.vocab_size,
            special_tokens=specials,
            min_frequency=config.tokenizer.min_frequency,
            num_lines=len(lines),
        )
        (folder / "recipe.json").write_text(json.dumps(recipe, indent=2))
        log.info("tokenizer %s trained in %.1fs -> %s", tokenizer.hash[:12], time.perf_counter() - start, path)
        return tokenizer


# ---------------------------------------------------------------------------
# Stores


def _reusable(path: Path, build_key: dict[str, Any]) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("build_key") == build_key


def _encoded_documents(
    tokenizer: Tokenizer, documents: list[str], sizes: list[int], desc: str
) -> Iterator[list[list[int]]]:
    """Each document as the token ids of its lines, encoded in parallel chunks with a byte progress bar."""
    with tqdm(total=sum(sizes), desc=desc, unit="B", unit_scale=True, file=sys.stderr, mininterval=0.5) as bar:
        start = 0
        while start < len(documents):
            batch, num_lines, stop = [], 0, start
            while stop < len(documents) and (not batch or num_lines < ENCODE_CHUNK_LINES):
                batch.append(split_lines(documents[stop]))
                num_lines += len(batch[-1])
                stop += 1
            ids = iter(tokenizer.encode_lines([line for lines in batch for line in lines]))
            for lines in batch:
                yield [next(ids) for _ in lines]
            bar.update(sum(sizes[start:stop]))
            start = stop


def build_store(
    path: Path, tokenizer: Tokenizer, split: SplitText, build_key: dict[str, Any], sources: list[dict]
) -> TokenStore:
    """Tokenize ``split`` once into a store at ``path`` (atomically) and return it opened."""
    docs = split.documents
    if not docs:
        raise CorpusError(f"split {split.name}: no non-empty documents in {', '.join(map(str, split.sources))}")
    start = time.perf_counter()
    sizes = [len(d.encode("utf-8")) for d in docs]
    with StoreWriter(path, eot_id=tokenizer.eot_id, vocab_size=tokenizer.vocab_size) as writer:
        for lines in _encoded_documents(tokenizer, docs, sizes, f"tokenize {split.name}"):
            writer.add_document(lines)
        stats = {
            "documents": len(docs),
            "skipped_empty": split.skipped_empty,
            "bytes": sum(sizes),
            "words": sum(count_words(d) for d in docs),
            "lines": sum(count_lines(d) for d in docs),
        }
        manifest = {
            "split": split.name,
            "build_key": build_key,
            "tokenizer_hash": tokenizer.hash,
            "tokenizer_path": str(tokenizer.path.resolve()),
            "sources": sources,
            "stats": stats,
            "build_seconds": round(time.perf_counter() - start, 3),
        }
        return writer.commit(manifest)


def summarize(store: TokenStore, seconds: float, reused: bool) -> dict[str, Any]:
    """One split's summary line: counts from the manifest, tokens as evaluation scores them."""
    stats = store.manifest["stats"]
    return {
        "documents": stats["documents"],
        "tokens": store.predicted_tokens,
        "bytes": stats["bytes"],
        "words": stats["words"],
        "tokens_per_word": round(store.predicted_tokens / stats["words"], 4),
        "seconds": round(seconds, 3),
        "skipped_empty": stats["skipped_empty"],
        "lines": stats["lines"],
        "reused": reused,
        "store": str(store.path),
    }


def prepare(config: Config, splits: Sequence[str] = SPLITS) -> Prepared:
    """Tokenizer and token stores for ``splits``: reused when nothing changed, else (re)built atomically.

    Every input is checked before any work: unknown splits, missing files, and
    a vocabulary too small for the byte alphabet plus the special tokens.
    """
    splits = list(dict.fromkeys(splits))
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise CorpusError(f"splits: got {unknown}, expected some of {', '.join(SPLITS)}")
    needs_train = not config.tokenizer.path
    if needs_train:
        check_vocab_size(config.tokenizer.vocab_size, special_tokens(config))
    sources = {s: find_sources(config, s) for s in SPLITS if s in splits or (s == "train" and needs_train)}
    records = {s: [file_record(p) for p in paths] for s, paths in sources.items()}
    if config.data.workers:
        os.environ.setdefault("RAYON_NUM_THREADS", str(config.data.workers))  # tokenizers' Rust thread pool

    texts: dict[str, SplitText] = {}

    def text_of(split: str) -> SplitText:
        if split not in texts:
            texts[split] = read_split(config, split, sources[split])
        return texts[split]

    train_sha256 = [r["sha256"] for r in records["train"]] if needs_train else None
    tokenizer = obtain_tokenizer(config, train_sha256, lambda: text_of("train"))
    root = Path(config.data.cache_dir).expanduser() / "stores" / tokenizer.hash[:16] / corpus_key(config)
    stores, summary = {}, {}
    for split in splits:
        start = time.perf_counter()
        build_key = {
            "builder_version": BUILDER_VERSION,
            "tokenizer_hash": tokenizer.hash,
            "corpus": config.data.corpus,
            "variant": config.data.variant if config.data.corpus == "wikitext2" else None,
            "sources_sha256": [r["sha256"] for r in records[split]],
        }
        path = root / split
        with _locked(root):
            reused = _reusable(path, build_key)
            if reused:
                store = TokenStore.open(path, tokenizer_hash=tokenizer.hash)
            else:
                log.info("%s: building the token store at %s", split, path)
                store = build_store(path, tokenizer, text_of(split), build_key, records[split])
        texts.pop(split, None)
        stores[split] = store
        summary[split] = summarize(store, time.perf_counter() - start, reused)
        log.info("%s: %s %d documents, %s tokens", split, "reused" if reused else "built", summary[split]["documents"],
                 f"{summary[split]['tokens']:,}")
    return Prepared(tokenizer=tokenizer, stores=stores, summary=summary, root=root)

