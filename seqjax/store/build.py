"""Build (or reuse) the tokenizer and the token stores: the one entry point is :func:`prepare`.

Cache layout under ``data.cache_dir``::

    tokenizers/<recipe>/tokenizer.json     trained tokenizers, keyed by what they were trained from
    stores/<tokenizer hash>/<corpus>-<key>/
        train/ (or valid/, test/)          a sharded token store (see seqjax.store.reader); the key covers only
                                           what makes that split (its files, field, format), so
                                           adding a validation file never moves or rebuilds the
                                           train store (WikiText-2's three splits share
                                           wikitext2-<variant>/)
        damaged/                           shards found damaged, set aside before they were rebuilt
        config.yaml                        the resolved config of the last prepare run

**Streaming, bounded memory.** A split's files are cut into shards (consecutive
files up to ``data.shard_bytes`` of source each). A shard's documents stream
from the reader in chunks to a pool of tokenizer processes
(:mod:`seqjax.store.encoding`) and on to the shard writer, so memory holds a
few chunks, never the corpus. The tokenizer trains on a streamed sample of
``tokenizer.train_bytes`` of the train split.

**Reuse.** A shard's name carries a key: the tokenizer's hash, the corpus
settings and each of its source files' path, size and modification time. A
store is reused when its manifest names the shards the current files give;
re-validating a large cache therefore reads no source file. ``verify=True``
(``prepare --verify``) also re-hashes every source file against the hash
recorded at build time.

**Integrity.** On reuse every file's size is checked against the manifest,
and its checksum too: on every reuse for stores up to
:data:`VERIFY_EVERY_REUSE_BYTES`, once (recorded in the manifest, and again
whenever a file's modification time changes) for larger ones, and always under
``verify``. A damaged shard is reported, set aside in ``damaged/`` and rebuilt;
the other shards are kept. A shard whose build was killed left only a hidden
staging folder, so a re-run builds exactly the shards that are missing.

**Processes.** Under a multi-host launch (``process_count > 1``, with a
``barrier`` that all processes reach), process ``p`` builds shards ``p, p + P,
...``, and after a barrier process 0 writes the manifest; the store is the same
as one process builds. Without one, a file lock per folder lets several
independent processes call prepare at once: one builds, the others wait and reuse.

Tokenizer mismatch policy: inside this cache the folder is keyed by the
tokenizer hash, so prepare never uses a store with another tokenizer's ids. A
store opened by path elsewhere goes through ``TokenStore.open(path,
tokenizer_hash=...)``, which *refuses* a mismatch and changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from seqjax.config.tree import Config, ConfigError, SourceConfig
from seqjax.core.errors import CorpusError, StoreError
from seqjax.core.files import write_text_atomic
from seqjax.core.progress import progress_bar
from seqjax.store.cache import (
    BUILDER_VERSION,
    ProcessGroup,
    content_hash,
    corpus_key,
    digest,
    file_identity,
    locked,
    writable,
)
from seqjax.store.checks import read_manifest, shard_problems
from seqjax.store.corpus import SPLITS, source_files
from seqjax.store.encoding import available_cores
from seqjax.store.examples import ExampleSpec, example_spec
from seqjax.store.image_chats import changed_images
from seqjax.store.layout import MANIFEST, REBUILD_HINT
from seqjax.store.reader import TokenStore
from seqjax.store.shard import PAIR_COUNTS, build_shard, plan_shards
from seqjax.store.splits import carved, split_sources
from seqjax.store.tokenizer import Tokenizer, check_vocab_size, obtain_tokenizer, special_tokens
from seqjax.store.writer import publish, read_shard

log = logging.getLogger(__name__)

# Stores up to this size are checksummed on every reuse (xxh3 reads several GB/s); larger ones once,
# recorded.
VERIFY_EVERY_REUSE_BYTES = 1 << 30


@dataclass
class Prepared:
    """What :func:`prepare` returns: the tokenizer, one opened store per split, and the summary
    printed by the CLI.

    For a mixture (``data.sources``), each split's store holds every source's
    documents one source after another (``store.sources`` says whose are whose).
    """

    tokenizer: Tokenizer
    stores: dict[str, TokenStore]
    summary: dict[str, dict[str, Any]]
    root: Path


def _set_aside(path: Path, shards: list[str], why: list[str]) -> None:
    """Move damaged or stale shards of the store at ``path`` to ``damaged/`` and drop its manifest;
    say so."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name in shards:
        dest = path.parent / "damaged" / f"{path.name}-{name}-{stamp}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        if (path / name).exists():
            os.replace(path / name, dest)
        log.warning("token store %s: %s; set aside in %s, rebuilding it", path, "; ".join(why), dest)
    (path / MANIFEST).unlink(missing_ok=True)


def _stale_sources(shard: dict[str, Any]) -> list[str]:
    """Sources of a shard whose content no longer hashes as at build time (``verify``)."""
    stale = []
    for record in shard.get("sources", []):
        source = Path(record["path"])
        if not source.exists() or content_hash(source) != record["xxh3"]:
            stale.append(f"source {source} changed since the build (same size and time, other content)")
    return stale


def _shard_problems(path: Path, shard: dict[str, Any], checksums: bool, vocab_size: int, verify: bool) -> list[str]:
    """Why a built shard cannot be reused: its files against its record, the images it read (chats with
    images: the data files name them), and under ``verify`` its sources' contents."""
    problems = shard_problems(path, shard, checksums=checksums, vocab_size=vocab_size) or changed_images(shard)
    return problems or (_stale_sources(shard) if verify else [])


def _reuse(path: Path, build_key: dict[str, Any], run: ProcessGroup, read_only: bool = False) -> bool:
    """Process 0: whether the store at ``path`` can be reused as it is; damaged shards are set
    aside (on a read-only mount they are named in one line instead)."""
    try:
        manifest = read_manifest(path)
    except StoreError:
        return False
    if manifest.get("build_key") != build_key:
        return False
    total = sum(f["bytes"] for shard in manifest["shards"] for f in shard["files"].values())
    stamps = {f"{shard['name']}/{name}": _stamp(path / shard["name"] / name)
              for shard in manifest["shards"] for name in shard["files"]}
    checksums = run.verify or total <= VERIFY_EVERY_REUSE_BYTES or manifest.get("verified") != stamps
    damaged: dict[str, list[str]] = {}
    for shard in manifest["shards"]:
        problems = _shard_problems(path, shard, checksums, manifest["vocab_size"], run.verify)
        if problems:
            damaged[shard["name"]] = problems
    if damaged and read_only:
        first = next(iter(damaged.values()))[0]
        raise StoreError(f"token store {path} is damaged ({first}) and read-only, so it cannot be rebuilt there; "
                         f"{REBUILD_HINT}")
    if damaged:
        _set_aside(path, list(damaged), [p for ps in damaged.values() for p in ps])
        return False
    # verified once: later reuses trust unchanged files
    if checksums and total > VERIFY_EVERY_REUSE_BYTES and not read_only:
        write_text_atomic(path / MANIFEST, json.dumps({**manifest, "verified": stamps}, indent=2))
    return True


def _stamp(file: Path) -> list[int] | None:
    try:
        stat = file.stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _finished_shard(path: Path, name: str, run: ProcessGroup, vocab_size: int) -> bool:
    """A shard an earlier (perhaps killed) build finished: present and whole; a damaged one is set
    aside."""
    record = read_shard(path, name)
    if record is None:
        return False
    problems = _shard_problems(path, record, True, vocab_size, run.verify)
    if problems:
        _set_aside(path, [name], problems)
        return False
    return True


def prepare_store(path: Path, source: SourceConfig, split: str, files: list[Path],
                  tokenizer: Tokenizer, config: Config, run: ProcessGroup,
                  spec: ExampleSpec | None = None) -> tuple[TokenStore, bool]:
    """The store of one source's split at ``path``: reused, completed or built; returns it opened
    and if reused."""
    identities = [file_identity(p, config.data.cache_identity == "content") for p in files]
    corpus = {"corpus": source.corpus, "text_field": source.text_field,
              "variant": source.variant if source.corpus == "wikitext2" else None}
    corpus["separator"] = tokenizer.separator_id  # the framing: a store's documents open with it
    carve = carved(source, split, config.data.validation_split_percentage)
    if carve is not None:  # a train/valid carve: which side, and how much
        corpus["carve"] = list(carve)
    # instruction examples: how records become ids and weights is part of the key
    if spec is not None:
        corpus["examples"] = spec.identity()
    names = []
    for i, group in enumerate(plan_shards(identities, config.data.shard_bytes)):
        key = digest({"builder_version": BUILDER_VERSION, "tokenizer_hash": tokenizer.hash, **corpus,
                       "files": [identities[j] for j in group]})
        names.append((f"shard-{i:05d}-{key[:12]}", [files[j] for j in group]))
    build_key = {"builder_version": BUILDER_VERSION, "tokenizer_hash": tokenizer.hash, **corpus,
                 "shards": [name for name, _ in names]}
    # a complete store on a read-only mount is read as it is: reading takes no lock that writes
    read_only = run.process_count == 1 and not writable(path.parent)
    lock = locked(path.parent) if run.process_count == 1 and not read_only else nullcontext()
    with lock:
        reused = _reuse(path, build_key, run, read_only) if run.main else False
        if read_only and not reused:
            raise StoreError(f"data.cache_dir: {path.parent} is read-only and holds no complete {split} store for "
                             "this config and tokenizer; expected a writable folder, or one prepared for this "
                             "config (python -m seqjax.prepare)")
        run.wait(f"seqjax-prepare-reuse-{path}")
        if run.process_count > 1:
            reused = _manifest_key(path) == build_key
        if not reused:
            start = time.perf_counter()
            mine = [(n, fs) for i, (n, fs) in enumerate(names)
                    if i % run.process_count == run.process_index]
            todo = [(n, fs) for n, fs in mine
                    if not _finished_shard(path, n, run, tokenizer.vocab_size)]
            size = sum(file_identity(p)["bytes"] for _, fs in todo for p in fs)
            if todo:
                log.info("%s: building the token store at %s: %d of its %d shards", split, path,
                         len(todo), len(names))
            with progress_bar(total=size, desc=f"tokenize {split}", unit="B", unit_scale=True,
                              mininterval=0.5, enabled=bool(todo)) as bar:
                for name, group in todo:
                    build_shard(path, name, source, group, tokenizer, run.workers, bar, spec, carve)
            run.wait(f"seqjax-prepare-shards-{path}")
            if run.main:
                _publish(path, names, build_key, split, tokenizer, time.perf_counter() - start)
            run.wait(f"seqjax-prepare-manifest-{path}")
    return TokenStore.open(path, tokenizer_hash=tokenizer.hash), reused


def _manifest_key(path: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(path).get("build_key")
    except StoreError:
        return None


def _publish(path: Path, names: list[tuple[str, list[Path]]], build_key: dict[str, Any], split: str,
             tokenizer: Tokenizer, seconds: float) -> None:
    records = []
    for name, files in names:
        record = read_shard(path, name)
        if record is None:
            raise StoreError(
                f"token store {path}: shard {name} (from {files[0]}) is missing after every process "
                "finished; run python -m seqjax.prepare again to build it")
        records.append(record)
    stats = {k: sum(r["stats"][k] for r in records) for k in records[0]["stats"]}
    manifest = {
        "split": split, "build_key": build_key, "tokenizer_hash": tokenizer.hash,
        "tokenizer_path": str(tokenizer.path.resolve()), "stats": stats,
        "build_seconds": round(seconds, 3)
    }
    publish(path, records, manifest, eot_id=tokenizer.separator_id, vocab_size=tokenizer.vocab_size)


def summarize(store: TokenStore, seconds: float, reused: bool) -> dict[str, Any]:
    """One split's summary line: counts from the manifest, tokens as evaluation scores them."""
    stats = store.manifest["stats"]
    examples = {}
    if "scored_tokens" in stats:  # instruction examples: what the loss sees, and what was dropped
        examples = {
            "scored_tokens": stats["scored_tokens"],
            "scored_fraction": round(stats["scored_tokens"] / max(1, store.predicted_tokens), 4),
            "scored_bytes": stats["scored_bytes"], "dropped_unscored": stats["dropped_unscored"],
            **{key: stats[key] for key in PAIR_COUNTS if key in stats},
        }
    return {
        "documents": stats["documents"],
        "tokens": store.predicted_tokens,
        **examples,
        "bytes": stats["bytes"],
        "words": stats["words"],
        "tokens_per_word": round(store.predicted_tokens /
                                 stats["words"], 4) if stats["words"] else None,
        "seconds": round(seconds, 3),
        "skipped_empty": stats["skipped_empty"],
        "lines": stats["lines"],
        "reused": reused,
        **({"carved_out": stats["carved_out"]} if "carved_out" in stats else {}),
        "shards": len(store.manifest.get("shards", [])),
        "store": str(store.path),
    }


def framing(tokenizer: Tokenizer) -> str:
    """How the store frames documents, as text: ``<s> document <s> document ...`` for a Llama
    tokenizer."""
    sep = tokenizer.decode([tokenizer.separator_id])
    return f"{sep} document {sep} document ... (each document opens with {sep}, the tokenizer's own framing)"


def prepare(
    config: Config,
    splits: Sequence[str] = SPLITS,
    *,
    process_index: int = 0,
    process_count: int = 1,
    barrier: Callable[[str], None] | None = None,
    verify: bool = False,
) -> Prepared:
    """Tokenizer and token stores for ``splits``: reused when nothing changed, else (re)built
    atomically.

    Every input is checked before any work: unknown splits, missing files, and
    a vocabulary too small for the byte alphabet plus the special tokens.
    Under a multi-host launch give ``process_index``, ``process_count`` and a
    ``barrier(name)`` that returns once every process has called it.
    """
    cache = cache_dir(config)
    try:
        return _prepare(config, splits, process_index=process_index, process_count=process_count,
                        barrier=barrier, verify=verify)
    except OSError as err:
        target = None if err.filename is None else Path(err.filename).resolve()
        if target is None or (target != cache.resolve() and cache.resolve() not in target.parents):
            raise
        # A cache on a read-only or full file system: one line, naming the folder and the OS error.
        raise StoreError(
            f"data.cache_dir: cannot write {err.filename} ({err.strerror}); expected a writable folder "
            "(set data.cache_dir to one)") from None


def cache_dir(config: Config, writable: bool = False) -> Path:
    """``data.cache_dir``; a file there is one line. ``writable``: also create it, refusing one that
    cannot be.

    prepare itself creates nothing before its inputs are checked (and nothing at all when it only
    reuses): a cache it cannot write is named when the first write fails.
    """
    cache = Path(config.data.cache_dir).expanduser()
    if cache.exists() and not cache.is_dir():
        raise StoreError(
            f"data.cache_dir: {cache} is a file; expected a folder to build the tokenizer and stores in"
        )
    if not writable:
        return cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(f"data.cache_dir: cannot create {cache} ({err.strerror}); expected a writable "
                         "folder") from None
    if not os.access(cache, os.W_OK):
        raise StoreError(
            f"data.cache_dir: {cache} is not writable; expected a writable folder (set data.cache_dir)"
        )
    return cache


def _check_request(config: Config, splits: list[str], process_count: int, barrier) -> None:
    """What a prepare call asks for, checked before any work: known splits, the train files it reads."""
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise CorpusError(f"splits: got {unknown}, expected some of {', '.join(SPLITS)}")
    if process_count > 1 and barrier is None:
        raise StoreError(f"prepare with process_count={process_count} needs a barrier shared by the processes")
    d = config.data
    needs_train = not config.tokenizer.path
    if d.corpus != "wikitext2" and not d.sources and not d.train_files and (needs_train or "train" in splits):
        why = "the train split" if "train" in splits else \
            "the tokenizer, trained on the train split (or set tokenizer.path)"
        raise ConfigError(f"data.train_files: got [], expected at least one file for data.corpus={d.corpus!r}: "
                          f"{why} reads them")
    if needs_train:
        check_vocab_size(config.tokenizer.vocab_size, special_tokens(config))


def _prepare(config: Config, splits: Sequence[str], *, process_index: int, process_count: int,
             barrier: Callable[[str], None] | None, verify: bool) -> Prepared:
    splits = list(dict.fromkeys(splits))
    _check_request(config, splits, process_count, barrier)
    sources = config.data.resolved_sources()
    # the files in the order a run needs them: the tokenizer's train files first
    train_files = None if config.tokenizer.path else {s.name: source_files(s, "train") for s in sources}
    percentage = config.data.validation_split_percentage
    per_split = {split: split_sources(sources, split, percentage) for split in splits}
    # every split's files are found before any work: a missing one is refused before the tokenizer
    # trains
    files = {(s.name, split): source_files(s, "train" if carved(s, split, percentage) else split)
             for split in splits for s in per_split[split]}
    run = ProcessGroup(process_index, process_count, barrier, verify, config.data.workers or available_cores())
    # chat templates are read before any work: a missing one is one line, not a trained tokenizer
    # and a refusal
    token_path = Path(config.tokenizer.path).expanduser() if config.tokenizer.path else None
    specs = {s.name: example_spec(config, s, token_path, special_tokens(config)[0]) for s in sources}
    tokenizer = obtain_tokenizer(config, sources, train_files, run)
    base = Path(config.data.cache_dir).expanduser() / "stores" / tokenizer.hash[:16]
    stores, summary = {}, {}
    for split in splits:
        stores[split], summary[split] = _split_store(config, split, per_split[split], files, base, tokenizer, run,
                                                     specs)
    folders = {_folder(config, sources[0], "train" if carved(sources[0], split, percentage) else split, files)
               for split in splits}
    root = base / folders.pop() if len(sources) == 1 and len(folders) == 1 else base
    return Prepared(tokenizer=tokenizer, stores=stores, summary=summary, root=root)


def _folder(config: Config, source: SourceConfig, split: str, files: dict) -> str:
    """A source's store folder for ``split``: by its files' paths, or under ``data.cache_identity=content`` by
    what they hold (a cache moved with its sources finds its stores)."""
    content = config.data.cache_identity == "content" and source.corpus != "wikitext2"
    return corpus_key(source, split, files.get((source.name, split)) if content else None)


def _split_store(config: Config, split: str, sources: list[SourceConfig], files: dict, base: Path,
                 tokenizer: Tokenizer, run: ProcessGroup, specs: dict[str, Any]) -> tuple[TokenStore, dict[str, Any]]:
    """One split's store (each source's, concatenated for a mixture) and its summary."""
    start, percentage = time.perf_counter(), config.data.validation_split_percentage
    built, entries = [], {}
    for source in sources:
        origin = "train" if carved(source, split, percentage) else split  # a carve lives beside its train store
        path = base / _folder(config, source, origin, files) / split
        store, reused = prepare_store(path, source, split, files[(source.name, split)], tokenizer, config, run,
                                      specs[source.name])
        built.append((source, store))
        entry = entries[source.name] = {**summarize(store, time.perf_counter() - start, reused),
                                        "framing": framing(tokenizer)}
        log.info("%s: %s %s %d documents, %s tokens in %d shard(s)", split, source.name,
                 "reused" if reused else "built", entry["documents"], f"{entry['tokens']:,}", entry["shards"])
    if len(config.data.resolved_sources()) == 1:
        return built[0][1], entries[sources[0].name]
    store = TokenStore.concat([s for _, s in built], [src.name for src, _ in built],
                              [src.weight for src, _ in built])
    total = summarize(store, time.perf_counter() - start, all(e["reused"] for e in entries.values()))
    total |= {"shards": sum(e["shards"] for e in entries.values()), "store": str(base),
              "framing": framing(tokenizer)}
    return store, {**total, "sources": entries}
