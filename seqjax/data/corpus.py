"""Text sources -> documents: WikiText-2 articles, plain-text files, JSONL records.

A *document* is the unit the rest of seqjax respects: the store separates
documents with end-of-text tokens, packers give each piece its own segment, and
``cross_document_attention`` is defined on them. So the reader's one job is to
find document boundaries exactly and lose nothing:

- **WikiText-2** (``data.corpus=wikitext2``, both variants): a split file is cut
  into its articles. An article starts at a `` = Title = `` line that stands
  between blank lines (section headings are `` = = Section = = ``); the article
  takes the blank line before its title with it, so joining the articles gives
  back the file byte for byte. The standard splits hold 600 / 60 / 60 articles.
- **Plain text** (``data.corpus=text``): one document per file. Files are the
  one boundary a plain-text corpus states for sure (a blank line may be a
  paragraph break inside a document); corpora with many documents per file
  should use JSONL. A folder entry means every ``*.txt`` file under it.
- **JSONL** (``data.corpus=jsonl``): one ``{"text": ...}`` object per line, one
  document each; blank lines are ignored.

Empty and whitespace-only documents are skipped and counted. Every file is
read as strict UTF-8; an invalid byte stops the run with the file and byte
offset.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from seqjax.config import DATA_DIR_ENV, Config
from seqjax.errors import CorpusError

SPLITS = ("train", "valid", "test")

WIKITEXT_FOLDERS = {"tokens": "wikitext-2", "raw": "wikitext-2-raw"}
WIKITEXT_ARCHIVES = {"tokens": "wikitext-2-v1.zip", "raw": "wikitext-2-raw-v1.zip"}


@dataclass
class SplitText:
    """The documents of one split, with what was dropped on the way."""

    name: str
    sources: list[Path]
    documents: list[str] = field(default_factory=list)
    skipped_empty: int = 0


# ---------------------------------------------------------------------------
# Counting


def split_lines(text: str) -> list[str]:
    """Lines with their ``\\n`` kept (only ``\\n`` ends a line, unlike str.splitlines); joining gives ``text``."""
    lines = text.split("\n")
    last = lines.pop()
    out = [line + "\n" for line in lines]
    if last:
        out.append(last)
    return out


def count_lines(text: str) -> int:
    """Lines in ``text``: every ``\\n``, plus an unterminated last line."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def count_words(text: str) -> int:
    """Words the way WikiText-2 perplexity is normalized: whitespace-separated words plus one end-of-line per line.

    On the word-level files this gives 2,088,628 / 217,646 / 245,569
    (train / valid / test), the counts of Merity et al. (2016).
    """
    return len(text.split()) + count_lines(text)


# ---------------------------------------------------------------------------
# Finding and reading files


def _bases(config: Config) -> list[tuple[str, Path]]:
    """The folders a relative corpus path may live in, each with where it came from."""
    bases = []
    if config.data.dir:
        bases.append(("data.dir", Path(config.data.dir).expanduser()))
    env = os.environ.get(DATA_DIR_ENV)
    if env and all(Path(env).expanduser() != b for _, b in bases):
        bases.append((f"${DATA_DIR_ENV}", Path(env).expanduser()))
    return bases


def _wikitext_file(config: Config, split: str) -> Path:
    variant = config.data.variant
    folder = WIKITEXT_FOLDERS[variant]
    name = f"wiki.{split}.{variant}"
    looked = []
    for origin, base in _bases(config):
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
            " valid/test with an existing tokenizer.path."
        )
    raise CorpusError(
        f"WikiText-2 file {name} not found. Looked in:\n  " + "\n  ".join(looked) + "\n"
        f"Get WikiText-2 (Merity et al. 2016) as {WIKITEXT_ARCHIVES['tokens']} (word-level, wiki.*.tokens) or "
        f"{WIKITEXT_ARCHIVES['raw']} (raw, wiki.*.raw), e.g. from the Hugging Face dataset Salesforce/wikitext; "
        f"unzip it so that DIR/{folder}/{name} exists, then set data.dir=DIR or {DATA_DIR_ENV}=DIR." + note
    )


def _listed_files(config: Config, split: str) -> list[Path]:
    entries = getattr(config.data, f"{split}_files")
    if not entries:
        raise CorpusError(
            f"data.{split}_files: got [], expected at least one file for data.corpus={config.data.corpus!r}"
        )
    suffix = ".txt" if config.data.corpus == "text" else ".jsonl"
    files: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        candidates = [path] if path.is_absolute() else [base / path for _, base in _bases(config)] + [Path.cwd() / path]
        found = next((c for c in candidates if c.exists()), None)
        if found is None:
            raise CorpusError(
                f"data.{split}_files: {entry!r} not found. Looked in:\n  " + "\n  ".join(map(str, candidates))
            )
        if found.is_dir():
            inside = sorted(found.rglob(f"*{suffix}"))
            if not inside:
                raise CorpusError(f"data.{split}_files: folder {found} holds no *{suffix} files")
            files += inside
        else:
            files.append(found)
    return files


def find_sources(config: Config, split: str) -> list[Path]:
    """The files that make up ``split``, or a CorpusError listing every place looked and how to get them."""
    if split not in SPLITS:
        raise CorpusError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    if config.data.corpus == "wikitext2":
        return [_wikitext_file(config, split)]
    return _listed_files(config, split)


def read_text(path: Path) -> str:
    """A file as strict UTF-8 with line endings untouched; invalid bytes raise with the file and offset."""
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


def _is_blank(line: str) -> bool:
    return not line.strip()


def _is_title(line: str) -> bool:
    body = line.rstrip("\n")
    return body.startswith(" = ") and not body.startswith(" = = ") and body.endswith(" = ") and len(body) > 4


def wikitext_articles(text: str) -> list[str]:
    """Cut a WikiText-2 split into its articles; ``"".join(result) == text``.

    An article starts at the blank line before a `` = Title = `` line that has
    a blank line on each side (at the very start of the file the title itself
    may open it). Text before the first title, if any, joins the first article.
    """
    lines = split_lines(text)
    starts = []
    for i, line in enumerate(lines):
        if _is_title(line) and (i == 0 or _is_blank(lines[i - 1])) and i + 1 < len(lines) and _is_blank(lines[i + 1]):
            starts.append(max(i - 1, 0))
    if not starts:
        return [text] if text else []
    starts[0] = 0
    bounds = starts + [len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def jsonl_documents(path: Path, text: str) -> list[str]:
    """The ``text`` field of each JSON line; a bad line raises with the file and line number."""
    docs = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(
                f'{path}:{number}: not valid JSON ({err.msg}); expected one {{"text": ...}} object per line'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise CorpusError(f"{path}:{number}: expected an object with a string field \"text\", got {line[:80]!r}")
        docs.append(record["text"])
    return docs


def read_split(config: Config, split: str, sources: list[Path] | None = None) -> SplitText:
    """Read ``split`` into documents, skipping (and counting) empty and whitespace-only ones."""
    sources = find_sources(config, split) if sources is None else sources
    result = SplitText(name=split, sources=sources)
    for path in sources:
        text = read_text(path)
        if config.data.corpus == "wikitext2":
            docs = wikitext_articles(text)
        elif config.data.corpus == "jsonl":
            docs = jsonl_documents(path, text)
        else:
            docs = [text]
        for doc in docs:
            if doc.strip():
                result.documents.append(doc)
            else:
                result.skipped_empty += 1
    return result
