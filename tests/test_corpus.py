"""Corpus readers: WikiText-2 articles (byte-exact), plain text, JSONL, and the errors for missing or bad files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import DATA_DIR_ENV
from seqjax.store.corpus import (
    CorpusError,
    count_lines,
    count_words,
    find_sources,
    read_split,
    read_text,
)
from seqjax.store.lines import split_lines
from seqjax.store.wikitext import wikitext_articles

# The published WikiText-2 sizes: Merity et al. (2016), Table 1 (words = tokens incl. one <eos> per line).
ARTICLES = {"train": 600, "valid": 60, "test": 60}
WORDS = {"train": 2_088_628, "valid": 217_646, "test": 245_569}


def wikitext_files(root):
    for variant, folder in (("tokens", "wikitext-2"), ("raw", "wikitext-2-raw")):
        for split in ARTICLES:
            path = root / folder / f"wiki.{split}.{variant}"
            if path.is_file():
                yield variant, split, path


def test_wikitext_articles_are_the_published_counts_and_join_back_byte_exact(wikitext):
    seen = set()
    for variant, split, path in wikitext_files(wikitext):
        text = read_text(path)
        articles = wikitext_articles(text)
        assert len(articles) == ARTICLES[split], path
        assert "".join(articles) == text, path
        assert all(a.startswith(" \n = ") and not a.startswith(" \n = = ") for a in articles), path
        assert sum(count_words(a) for a in articles) == WORDS[split] == count_words(text), path
        seen.add(variant)
    assert seen == {"tokens", "raw"}


def test_read_split_finds_wikitext_through_the_environment(wikitext, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(wikitext))
    split = read_split(load_config(None, ["data.variant=raw"]), "valid")
    assert split.sources == [wikitext / "wikitext-2-raw" / "wiki.valid.raw"]
    assert len(split.documents) == 60 and split.skipped_empty == 0


# A generator of WikiText-shaped files whose article boundaries are known.
_words = st.lists(st.text("abcXYZ,.'@-", min_size=1, max_size=6), min_size=1, max_size=6).map(" ".join)
_paragraph = _words.map(lambda w: f" {w} \n \n")
_section = _words.map(lambda w: f" = = {w} = = \n \n")
_subsection = _words.map(lambda w: f" = = = {w} = = = \n \n")
_article = st.tuples(_words, st.lists(st.one_of(_paragraph, _section, _subsection), max_size=5)).map(
    lambda t: f" \n = {t[0]} = \n \n" + "".join(t[1])
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_article, min_size=1, max_size=5))
def test_article_boundaries_are_titles_between_blank_lines_not_section_headings(articles):
    text = "".join(articles)
    assert wikitext_articles(text) == articles


def test_a_title_like_line_inside_a_paragraph_does_not_start_an_article():
    text = " \n = A = \n \n text \n = not a title = \n more \n \n = B = \n \n body \n"
    assert wikitext_articles(text) == [" \n = A = \n \n text \n = not a title = \n more \n", " \n = B = \n \n body \n"]


@settings(max_examples=100, deadline=None)
@given(st.text(st.sampled_from("ab \n\t")))
def test_lines_and_words(text):
    lines = split_lines(text)
    assert "".join(lines) == text
    assert all(line.endswith("\n") for line in lines[:-1]) and all("\n" not in line[:-1] for line in lines)
    assert count_lines(text) == len(lines)
    assert count_words(text) == len(text.split()) + len(lines)


def test_invalid_utf8_names_the_file_and_byte_offset(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("héllo\n".encode() + b"ab\xffcd")
    with pytest.raises(CorpusError, match=r"bad.txt: invalid UTF-8 at byte offset 9 "):
        read_text(bad)
    config = load_config(None, ["data.corpus=text", f"data.train_files=[{bad}]"])
    with pytest.raises(CorpusError, match="byte offset 9"):
        read_split(config, "train")


def test_missing_wikitext_lists_every_place_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "from_env"))
    config = load_config(None, [f"data.dir={tmp_path / 'from_key'}", "data.variant=raw"])
    with pytest.raises(CorpusError) as err:
        find_sources(config, "train")
    message = str(err.value)
    for place in (
        tmp_path / "from_key" / "wikitext-2-raw" / "wiki.train.raw",
        tmp_path / "from_key" / "wiki.train.raw",
        tmp_path / "from_env" / "wikitext-2-raw" / "wiki.train.raw",
        tmp_path / "from_env" / "wiki.train.raw",
    ):
        assert str(place) in message
    assert "wikitext-2-v1.zip" in message and "wikitext-2-raw-v1.zip" in message
    assert "ships no wiki.train.raw" in message and DATA_DIR_ENV in message
    monkeypatch.delenv(DATA_DIR_ENV)
    with pytest.raises(CorpusError, match=f"neither data.dir nor \\${DATA_DIR_ENV} is set"):
        find_sources(load_config(None), "valid")


def test_missing_listed_file_lists_the_places_looked(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["data.corpus=jsonl", f"data.dir={tmp_path / 'data'}", "data.train_files=[x.jsonl]"])
    with pytest.raises(CorpusError) as err:
        find_sources(config, "train")
    assert "data.train_files: 'x.jsonl' not found" in str(err.value)
    assert str(tmp_path / "data" / "x.jsonl") in str(err.value) and str(tmp_path / "x.jsonl") in str(err.value)
    with pytest.raises(CorpusError, match="data.valid_files: got \\[\\]"):
        find_sources(config, "valid")


def test_text_source_is_one_document_per_file_and_skips_empty_ones(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "a.txt").write_text("first book\n\nsecond paragraph\n")
    (folder / "b.txt").write_text("  \n\t\n")
    (folder / "c.txt").write_text("last book, no newline")
    (folder / "ignored.md").write_text("not a .txt file")
    config = load_config(None, ["data.corpus=text", f"data.dir={tmp_path}", "data.train_files=[books]"])
    split = read_split(config, "train")
    assert split.documents == ["first book\n\nsecond paragraph\n", "last book, no newline"]
    assert split.skipped_empty == 1
    assert split.sources == [folder / "a.txt", folder / "b.txt", folder / "c.txt"]


def test_jsonl_source_reads_the_text_field_and_skips_empty_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    records = [{"text": "one\ntwo\n", "id": 1}, {"text": "   "}, {"text": "ünïcode ✓"}, {"text": ""}]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n\n")
    config = load_config(None, ["data.corpus=jsonl", f"data.train_files=[{path}]"])
    split = read_split(config, "train")
    assert split.documents == ["one\ntwo\n", "ünïcode ✓"]
    assert split.skipped_empty == 2


@pytest.mark.parametrize(
    "line, expected",
    [
        ("{not json", "docs.jsonl:2: not valid JSON"),
        ('{"txt": "x"}', "docs.jsonl:2: no field 'text' \\(keys: 'txt'\\)"),
        ('{"text": 3}', "docs.jsonl:2: field 'text' is int '3', expected a string"),
        ("[1, 2]", "docs.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, expected):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    config = load_config(None, ["data.corpus=jsonl", f"data.train_files=[{path}]"])
    with pytest.raises(CorpusError, match=expected):
        read_split(config, "train")
