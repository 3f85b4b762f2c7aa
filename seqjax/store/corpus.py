"""Text sources -> documents: WikiText-2 articles, plain-text files, JSONL (plain, .gz, .zst),
parquet, HF datasets.

A *document* is the unit the rest of seqjax respects: the store separates
documents with end-of-text tokens, packers give each piece its own segment, and
``cross_document_attention`` is defined on them. So the reader's one job is to
find document boundaries exactly and lose nothing:

- **WikiText-2** (``corpus=wikitext2``, both variants): a split file is cut
  into its articles. An article starts at a `` = Title = `` line that stands
  between blank lines (section headings are `` = = Section = = ``); the article
  takes the blank line before its title with it, so joining the articles gives
  back the file byte for byte. The standard splits hold 600 / 60 / 60 articles.
- **Plain text** (``corpus=text``): one document per file. Files are the
  one boundary a plain-text corpus states for sure (a blank line may be a
  paragraph break inside a document); corpora with many documents per file
  should use JSONL or parquet.
- **JSONL** (``corpus=jsonl``): one object per line, the document in its
  ``text_field`` key; blank lines are ignored. ``.jsonl.gz`` and ``.jsonl.zst``
  are decompressed as they stream (``.zst`` needs the ``zst`` extra).
- **Parquet** (``corpus=parquet``): one document per row of the string
  column ``text_field``, read with pyarrow one row group at a time.
- **HF datasets** (``corpus=hf``, the ``hf`` extra): a folder written by
  ``Dataset.save_to_disk``, or local data files (json/jsonl, parquet, csv,
  txt, arrow) that ``datasets.load_dataset`` streams (``streaming=True``).
  Nothing is downloaded: the library runs offline.

Every reader streams: a file is never read whole except WikiText-2 splits and
plain-text documents (each is one document). A split's entries are files,
folders (every file of the corpus's kinds under it) or globs. Empty and
whitespace-only documents are skipped and counted by the caller. Bad input
names the file, the line or row, and what was expected.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from seqjax.config.tree import DATA_DIR_ENV, Config, SourceConfig
from seqjax.core.errors import CorpusError
from seqjax.store.lines import damaged, raw_lines, stream_errors
from seqjax.store.wikitext import wikitext_articles

SPLITS = ("train", "valid", "test")

WIKITEXT_FOLDERS = {"tokens": "wikitext-2", "raw": "wikitext-2-raw"}
WIKITEXT_ARCHIVES = {"tokens": "wikitext-2-v1.zip", "raw": "wikitext-2-raw-v1.zip"}
# What a folder entry lists, per corpus kind (an hf folder written by save_to_disk is itself the
# entry).
SUFFIXES = {
    "text": (".txt", ),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"),
    "parquet": (".parquet", ),
    "hf": (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".parquet", ".csv", ".txt",
           ".arrow"),
}
# datasets.load_dataset's packaged builder for each kind of local data file
HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
               ".arrow": "arrow"}
HF_BATCH = 1000  # rows per batch read from a datasets source


@dataclass
class SplitText:
    """The documents of one split, with what was dropped on the way."""

    name: str
    sources: list[Path]
    documents: list[str] = field(default_factory=list)
    skipped_empty: int = 0


# ---------------------------------------------------------------------------
# Counting


def count_lines(text: str) -> int:
    """Lines in ``text``: every ``\\n``, plus an unterminated last line."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def count_words(text: str) -> int:
    """Words the way WikiText-2 perplexity is normalized: whitespace-separated words plus one
    end-of-line per line.

    On the word-level files this gives 2,088,628 / 217,646 / 245,569
    (train / valid / test), the counts of Merity et al. (2016).
    """
    return len(text.split()) + count_lines(text)


# ---------------------------------------------------------------------------
# Finding and reading files


def source_key(source: SourceConfig) -> str:
    """How messages name a source's keys: ``data`` for the one ``data.*`` corpus, else
    ``data.sources[<name>]``."""
    return "data" if source.name == "main" else f"data.sources[{source.name}]"


def _bases(source: SourceConfig) -> list[tuple[str, Path]]:
    """The folders a relative corpus path may live in, each with where it came from."""
    bases = []
    if source.dir:
        bases.append((f"{source_key(source)}.dir", Path(source.dir).expanduser()))
    env = os.environ.get(DATA_DIR_ENV)
    if env and all(Path(env).expanduser() != b for _, b in bases):
        bases.append((f"${DATA_DIR_ENV}", Path(env).expanduser()))
    return bases


def _wikitext_file(source: SourceConfig, split: str) -> Path:
    variant = source.variant
    folder = WIKITEXT_FOLDERS[variant]
    name = f"wiki.{split}.{variant}"
    looked = []
    for origin, base in _bases(source):
        for candidate in (base / folder / name, base / name):
            if candidate.is_file():
                return candidate
            looked.append(f"{candidate} (from {origin})")
    if not looked:
        looked.append(f"nowhere: neither data.dir nor ${DATA_DIR_ENV} is set")
    note = ""
    if variant == "raw" and split == "train":
        note = (
            " Note: the shared WikiText-2 copy ships no wiki.train.raw; use data.variant=tokens, or prepare only"
            " valid/test with an existing tokenizer.path.")
    raise CorpusError(
        f"WikiText-2 file {name} not found. Looked in: " + "; ".join(looked) + ". "
        f"Get WikiText-2 (Merity et al. 2016) as {WIKITEXT_ARCHIVES['tokens']} (word-level, wiki.*.tokens) or "
        f"{WIKITEXT_ARCHIVES['raw']} (raw, wiki.*.raw), e.g. from the Hugging Face dataset Salesforce/wikitext; "
        f"unzip it so that DIR/{folder}/{name} exists, then set data.dir=DIR or {DATA_DIR_ENV}=DIR."
        + note)


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets.Dataset.save_to_disk`` (or a DatasetDict's)."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def _folder_files(folder: Path, kind: str, key: str) -> list[Path]:
    if kind == "hf" and is_saved_dataset(folder):
        return [folder]
    suffixes = SUFFIXES[kind]
    inside = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not inside:
        raise CorpusError(
            f"{key}: folder {folder} holds no {' / '.join('*' + x for x in suffixes)} files")
    return inside


def _is_glob(entry: str) -> bool:
    return any(c in entry for c in "*?[")


def _listed_files(source: SourceConfig, split: str) -> list[Path]:
    key = f"{source_key(source)}.{split}_files"
    entries = getattr(source, f"{split}_files")
    if not entries:
        raise CorpusError(f"{key}: got [], expected at least one file for corpus={source.corpus!r}")
    files: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        bases = [] if path.is_absolute() else [base for _, base in _bases(source)] + [Path.cwd()]
        candidates = [path] if path.is_absolute() else [base / path for base in bases]
        if _is_glob(entry):
            for pattern in candidates:
                matched = sorted(Path(m) for m in glob.glob(str(pattern), recursive=True))
                if matched:
                    break
            else:
                raise CorpusError(f"{key}: the glob {entry!r} matches no file. Tried: " +
                                  "; ".join(map(str, candidates)))
            for match in matched:
                files += _folder_files(match, source.corpus, key) if match.is_dir() else [match]
            continue
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise CorpusError(f"{key}: {entry!r} not found. Looked in: " +
                              "; ".join(map(str, candidates)))
        files += _folder_files(found, source.corpus, key) if found.is_dir() else [found]
    return files


def source_files(source: SourceConfig, split: str) -> list[Path]:
    """The files (or saved-dataset folders) that make up ``split`` of one resolved source, in
    reading order."""
    if split not in SPLITS:
        raise CorpusError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    if source.corpus == "wikitext2":
        return [_wikitext_file(source, split)]
    return _listed_files(source, split)


def find_sources(config: Config, split: str) -> list[Path]:
    """The files of ``split`` of the one ``data.*`` corpus, or a CorpusError listing every place
    looked."""
    return source_files(config.data.resolved_sources()[0], split)


def read_text(path: Path) -> str:
    """A file as strict UTF-8 with line endings untouched; invalid bytes raise with the file and
    offset."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"{path}: invalid UTF-8 at byte offset {err.start} ({data[err.start:err.start + 4]!r}); "
            "seqjax reads corpora as UTF-8"
        ) from None


# ---------------------------------------------------------------------------
# Cutting files into documents


def jsonl_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The ``text_field`` of each JSON line, streamed; a bad line raises with the file and line
    number."""
    number = 0
    try:
        for number, raw in enumerate(raw_lines(path), start=1):
            yield _jsonl_record(path, number, raw, text_field)
    except stream_errors() as err:
        raise damaged(path, number + 1, err) from None


def _jsonl_record(path: Path, number: int, raw: bytes, text_field: str) -> str | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"{path}:{number}: invalid UTF-8 at byte {err.start} of the line; expected UTF-8 JSON"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(
            f'{path}:{number}: not valid JSON ({err.msg}); expected one {{"{text_field}": ...}} object per line'
        ) from None
    if not isinstance(record, dict):
        raise CorpusError(
            f"{path}:{number}: expected a JSON object with a string field {text_field!r}, "
            f"got {line[:80]!r}")
    if text_field not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise CorpusError(
            f"{path}:{number}: no field {text_field!r} (keys: {keys}); expected data.text_field to "
            "name the key holding the text")
    value = record[text_field]
    if not isinstance(value, str):
        raise CorpusError(
            f"{path}:{number}: field {text_field!r} is {type(value).__name__} {str(value)[:40]!r}, "
            "expected a string")
    return value


def parquet_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """The string column ``text_field``, one row group at a time; a bad file, column or row raises
    naming it."""
    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise CorpusError(
            f"{path}: not a readable parquet file ({err}); expected a complete parquet file"
        ) from None
    with reader:
        schema = reader.schema_arrow
        if text_field not in schema.names:
            raise CorpusError(
                f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); expected "
                "data.text_field to name the text column")
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)):
            raise CorpusError(
                f"{path}: column {text_field!r} has type {kind}, expected a string column")
        row = 0
        for group in range(reader.num_row_groups):
            try:
                values = reader.read_row_group(group, columns=[text_field]).column(0).to_pylist()
            except (pa.ArrowException, OSError) as err:
                raise CorpusError(
                    f"{path}: row group {group} (rows from {row}) is unreadable ({err}); expected a "
                    "complete parquet file") from None
            for j, value in enumerate(values):
                if value is None:
                    raise CorpusError(
                        f"{path}: row {row + j}: {text_field!r} is null, expected a string")
            row += len(values)
            yield from values


def _datasets():
    """The ``datasets`` library, offline; an optional extra."""
    # Never reach the network: a local folder or local files are all a source may name.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        # optional and slow to import (pandas, fsspec, ...): only data.corpus=hf needs it
        import datasets
    except ImportError:
        raise CorpusError("data.corpus=hf needs the datasets library; pip install -e '.[hf]'") from None
    datasets.disable_progress_bars()
    return datasets


def hf_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Rows of a ``save_to_disk`` folder or of local data files, streamed with the ``datasets``
    library."""
    datasets = _datasets()
    if is_saved_dataset(path):
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise CorpusError(
                f"{path}: a DatasetDict folder (splits {', '.join(splits)}); expected one split's "
                f"folder, e.g. {path / (splits[0] if splits else 'train')}")
        dataset = datasets.load_from_disk(str(path))
        if text_field not in dataset.column_names:
            raise CorpusError(
                f"{path}: no column {text_field!r} (columns: {', '.join(dataset.column_names)}); "
                "expected data.text_field to name the text column")
        rows = dataset.select_columns([text_field]).to_iterable_dataset()
    else:
        builder = next((b for suffix, b in HF_BUILDERS.items()
                        if path.name.endswith((suffix, suffix + ".gz", suffix + ".zst"))), None)
        if builder is None:
            raise CorpusError(f"{path}: no datasets builder for this file; expected one of "
                              f"{', '.join(SUFFIXES['hf'])} or a save_to_disk folder")
        rows = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)
    row = 0
    try:
        for batch in rows.iter(batch_size=HF_BATCH):
            if text_field not in batch:
                raise CorpusError(
                    f"{path}: row {row}: no field {text_field!r} (fields: {', '.join(batch)}); "
                    "expected data.text_field to name the text column")
            values = batch[text_field]
            for j, value in enumerate(values):
                if not isinstance(value, str):
                    raise CorpusError(
                        f"{path}: row {row + j}: {text_field!r} is {type(value).__name__} "
                        f"{str(value)[:40]!r}, expected a string")
            row += len(values)
            yield from values
    except (datasets.exceptions.DatasetGenerationError, pa.ArrowException) as err:
        raise CorpusError(
            f"{path}: unreadable after row {row} ({str(err).splitlines()[0]}); expected a complete "
            "data file") from None


def file_documents(source: SourceConfig, path: Path) -> Iterator[str]:
    """Every document of one file of ``source``, empty ones included (the caller skips and counts
    them)."""
    kind = source.corpus
    if kind == "wikitext2":
        yield from wikitext_articles(read_text(path))
    elif kind == "text":
        yield read_text(path)
    elif kind == "jsonl":
        yield from (doc for doc in jsonl_documents(path, source.text_field) if doc is not None)
    elif kind == "parquet":
        yield from parquet_documents(path, source.text_field)
    else:
        yield from hf_documents(path, source.text_field)


# ---------------------------------------------------------------------------
# Records: instruction examples (data.format != text) read several fields of a row


def lone_surrogate(value: Any) -> str | None:
    """The first lone UTF-16 surrogate in a record's strings (JSON's ``"\\ud800"`` reads as one), or None."""
    if isinstance(value, str):
        return None if value.isascii() else next((c for c in value if "\ud800" <= c <= "\udfff"), None)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((found for found in map(lone_surrogate, items) if found is not None), None)


# In file_records' fields: every column of a record, beside the named ones.
ALL_FIELDS = "*"


def _pick(where: str, row: dict, fields: tuple[str, ...]) -> dict:
    """The ``fields`` of one row present (at least the first), its strings checked; else one line."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object with the field {fields[0]!r}, got "
                          f"{type(row).__name__}")
    if fields[0] not in row or row[fields[0]] is None:
        keys = ", ".join(map(repr, list(row)[:8])) or "none"
        raise CorpusError(
            f"{where}: no field {fields[0]!r} (keys: {keys}); expected the data.*_field key to "
            "name it")
    every = ALL_FIELDS in fields  # (the prompts of an RL run keep every column, for the reward functions)
    record = {f: v for f, v in row.items() if v is not None and (every or f in fields)}
    surrogate = lone_surrogate(record)
    if surrogate is not None:
        raise CorpusError(f"{where}: holds a lone UTF-16 surrogate ({surrogate!r}), which no tokenizer reads; "
                          "expected valid Unicode text (an escaped pair such as \\ud83d\\ude00 is one "
                          "character, one half alone is not)")
    return record


def file_records(source: SourceConfig, path: Path,
                 fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each row of a jsonl/parquet/hf file: the ``fields`` present (at least
    the first).

    ``where`` names the file and line or row, for messages about that record.
    """

    if source.corpus == "jsonl":
        number = 0
        try:
            for number, raw in enumerate(raw_lines(path), start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    raise CorpusError(
                        f"{path}:{number}: not valid UTF-8 JSON ({err}); expected one object per "
                        "line") from None
                yield f"{path}:{number}", _pick(f"{path}:{number}", row, fields)
        except stream_errors() as err:
            raise damaged(path, number + 1, err) from None
    elif source.corpus == "parquet":
        try:
            reader = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise CorpusError(
                f"{path}: not a readable parquet file ({err}); expected a complete parquet file"
            ) from None
        with reader:
            columns = [f for f in reader.schema_arrow.names if ALL_FIELDS in fields or f in fields]
            if fields[0] not in columns:
                raise CorpusError(
                    f"{path}: no column {fields[0]!r} (columns: "
                    f"{', '.join(reader.schema_arrow.names)}); expected the data.*_field key to name it"
                )
            row = 0
            for group in range(reader.num_row_groups):
                for record in reader.read_row_group(group, columns=columns).to_pylist():
                    yield f"{path}: row {row}", _pick(f"{path}: row {row}", record, fields)
                    row += 1
    elif source.corpus == "hf":
        datasets = _datasets()
        if is_saved_dataset(path):
            rows = datasets.load_from_disk(str(path)).to_iterable_dataset()
        else:
            builder = next((b for suffix, b in HF_BUILDERS.items() if path.name.endswith(
                (suffix, suffix + ".gz", suffix + ".zst"))), None)
            if builder is None:
                raise CorpusError(f"{path}: no datasets builder for this file; expected one of "
                                  f"{', '.join(SUFFIXES['hf'])} or a save_to_disk folder")
            rows = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)
        for row, record in enumerate(rows):
            yield f"{path}: row {row}", _pick(f"{path}: row {row}", record, fields)
    else:
        raise CorpusError(
            f"data.format: instruction examples need corpus jsonl, parquet or hf, not {source.corpus!r}"
        )


def read_split(config: Config, split: str, sources: list[Path] | None = None) -> SplitText:
    """Read ``split`` of the one ``data.*`` corpus into memory, skipping (and counting) empty
    documents.

    For small corpora and tests; prepare streams files with :func:`file_documents` instead.
    """
    source = config.data.resolved_sources()[0]
    sources = source_files(source, split) if sources is None else sources
    result = SplitText(name=split, sources=sources)
    for path in sources:
        for doc in file_documents(source, path):
            if doc.strip():
                result.documents.append(doc)
            else:
                result.skipped_empty += 1
    return result
