"""Every corpus kind reads the same documents as a plain reference reader; every bad input names file, line or row."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.store.build import prepare
from seqjax.store.corpus import CorpusError, file_records, find_sources, read_split

DOCS = ["first doc\nwith two lines\n", "", "naïve café 🙂", "   \n", "last one\n\n", '{"json": "inside"}\n']


def reference_documents(jsonl_path) -> list[str]:
    """The plain reader: every line json-decoded, its text kept unless blank."""
    docs = [json.loads(line)["text"] for line in jsonl_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [d for d in docs if d.strip()]


def write_jsonl(path, docs, field="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({field: doc, "id": len(doc)}, ensure_ascii=False) + "\n")


def write_zst(path, docs, field="text"):
    raw = "".join(json.dumps({field: d}) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))


def write_parquet(path, docs, field="text", row_group_size=2):
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)


def read(tmp_path, kind, files, *extra):
    config = load_config(None, [f"data.corpus={kind}", f"data.dir={tmp_path}", f"data.train_files={files}", *extra])
    return read_split(config, "train")


@pytest.fixture
def corpus(tmp_path):
    """The same documents as every kind of file, and the reference reader's answer."""
    write_jsonl(tmp_path / "plain.jsonl", DOCS)
    write_jsonl(tmp_path / "gz.jsonl.gz", DOCS, opener=gzip.open)
    write_zst(tmp_path / "zst.jsonl.zst", DOCS)
    write_parquet(tmp_path / "docs.parquet", DOCS)
    write_jsonl(tmp_path / "content.jsonl", DOCS, field="content")
    return reference_documents(tmp_path / "plain.jsonl")


@pytest.mark.parametrize("kind, files, extra", [
    ("jsonl", "[plain.jsonl]", []),
    ("jsonl", "[gz.jsonl.gz]", []),
    ("jsonl", "[zst.jsonl.zst]", []),
    ("jsonl", "[content.jsonl]", ["data.text_field=content"]),
    ("parquet", "[docs.parquet]", []),
    ("hf", "[plain.jsonl]", []),
    ("hf", "[gz.jsonl.gz]", []),
    ("hf", "[docs.parquet]", []),
])
def test_every_source_kind_reads_the_documents_of_the_plain_reader(tmp_path, corpus, kind, files, extra):
    split = read(tmp_path, kind, files, *extra)
    assert split.documents == corpus
    assert split.skipped_empty == 2


def test_a_saved_hf_dataset_folder_reads_the_documents_of_the_plain_reader(tmp_path, corpus):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(tmp_path / "saved"))
    assert read(tmp_path, "hf", "[saved]").documents == corpus
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(CorpusError, match=r"dd: a DatasetDict folder \(splits train\); expected one split's folder"):
        read(tmp_path, "hf", "[dd]")


@settings(max_examples=15, deadline=None)
@given(st.lists(st.text(st.characters(blacklist_categories=["Cs"]), max_size=30), min_size=1, max_size=12),
       st.integers(1, 4))
def test_parquet_row_groups_and_gzip_streams_keep_every_document_in_order(tmp_path_factory, docs, group):
    tmp = tmp_path_factory.mktemp("p")
    write_parquet(tmp / "d.parquet", docs, row_group_size=group)
    write_jsonl(tmp / "d.jsonl.gz", docs, opener=gzip.open)
    kept = [d for d in docs if d.strip()]
    assert read(tmp, "parquet", "[d.parquet]").documents == kept
    assert read(tmp, "jsonl", "[d.jsonl.gz]").documents == kept


def test_globs_and_folders_list_the_files_of_a_split_in_order(tmp_path):
    for i, name in enumerate(["b/2.jsonl.gz", "a/1.jsonl", "a/3.jsonl.zst", "a/skip.txt"]):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        if name.endswith(".gz"):
            write_jsonl(tmp_path / name, [f"doc {i}"], opener=gzip.open)
        elif name.endswith(".zst"):
            write_zst(tmp_path / name, [f"doc {i}"])
        else:
            write_jsonl(tmp_path / name, [f"doc {i}"])
    config = load_config(None, ["data.corpus=jsonl", f"data.dir={tmp_path}", "data.train_files=[a, 'b/*.jsonl.gz']"])
    assert [p.relative_to(tmp_path).as_posix() for p in find_sources(config, "train")] == [
        "a/1.jsonl", "a/3.jsonl.zst", "b/2.jsonl.gz"]
    assert read_split(config, "train").documents == ["doc 1", "doc 2", "doc 0"]


# ---------------------------------------------------------------------------
# Bad input: the file, the line or row, and what was expected


def test_a_corrupt_parquet_file_names_the_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(CorpusError, match=r"bad.parquet: not a readable parquet file .*expected a complete parquet"):
        read(tmp_path, "parquet", "[bad.parquet]")


def test_a_parquet_file_cut_short_names_the_file(tmp_path):
    write_parquet(tmp_path / "d.parquet", DOCS * 50)
    data = (tmp_path / "d.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"cut.parquet: not a readable parquet file"):
        read(tmp_path, "parquet", "[cut.parquet]")


def test_a_truncated_gzip_names_the_file_and_the_line_reached(tmp_path):
    write_jsonl(tmp_path / "d.jsonl.gz", [f"document number {i} " * 20 for i in range(300)], opener=gzip.open)
    data = (tmp_path / "d.jsonl.gz").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"cut.jsonl.gz: line \d+: the gzip stream is truncated or corrupt"):
        read(tmp_path, "jsonl", "[cut.jsonl.gz]")


def test_a_truncated_zstd_stream_names_the_file(tmp_path):
    write_zst(tmp_path / "d.jsonl.zst", [f"document number {i} " * 20 for i in range(300)])
    data = (tmp_path / "d.jsonl.zst").read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match=r"cut.jsonl.zst: line \d+: the zstd stream is truncated or corrupt"):
        read(tmp_path, "jsonl", "[cut.jsonl.zst]")


@pytest.mark.parametrize("name, kind", [("empty.jsonl.gz", "gzip"), ("empty.jsonl.zst", "zstd")])
@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_a_compressed_file_of_0_bytes_is_refused_as_damaged_not_read_as_empty(tmp_path, name, kind, fmt):
    """An interrupted copy leaves a 0-byte file: gzip once read it as an empty stream and prepare exited 0."""
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(CorpusError, match=rf"{name}: line 1: the {kind} stream is truncated or corrupt"):
        if fmt == "text":
            read(tmp_path, "jsonl", f"[{name}]")
        else:  # instruction records are read by file_records
            source = load_config(None, ["data.corpus=jsonl", f"data.train_files=[{name}]", "data.format=chat"])
            list(file_records(source.data.resolved_sources()[0], tmp_path / name, ("messages",)))


@pytest.mark.parametrize("kind, file, message", [
    ("jsonl", "plain.jsonl", r"plain.jsonl:1: no field 'body' \(keys: 'text', 'id'\); expected data.text_field"),
    ("parquet", "docs.parquet", r"docs.parquet: no column 'body' \(columns: text, n\); expected data.text_field"),
    ("hf", "plain.jsonl", r"plain.jsonl: row 0: no field 'body' \(fields: text, id\)"),
])
def test_a_missing_text_field_names_the_file_and_what_it_holds(tmp_path, corpus, kind, file, message):
    with pytest.raises(CorpusError, match=message):
        read(tmp_path, kind, f"[{file}]", "data.text_field=body")


def test_a_non_string_value_names_the_file_and_the_line_or_row(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "fine"}\n{"text": ["a", "list"]}\n')
    with pytest.raises(CorpusError, match=r"d.jsonl:2: field 'text' is list .*expected a string"):
        read(tmp_path, "jsonl", "[d.jsonl]")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(CorpusError, match=r"ints.parquet: column 'text' has type int64, expected a string column"):
        read(tmp_path, "parquet", "[ints.parquet]")
    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "nulls.parquet", row_group_size=2)
    with pytest.raises(CorpusError, match=r"nulls.parquet: row 2: 'text' is null, expected a string"):
        read(tmp_path, "parquet", "[nulls.parquet]")


def test_an_empty_glob_names_the_pattern_and_where_it_looked(tmp_path):
    with pytest.raises(CorpusError) as err:
        read(tmp_path, "jsonl", "['shards/*.jsonl.gz']")
    assert "data.train_files: the glob 'shards/*.jsonl.gz' matches no file. Tried:" in str(err.value)
    assert str(tmp_path / "shards" / "*.jsonl.gz") in str(err.value) and "\n" not in str(err.value)  # one line
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"folder .*empty holds no \*.parquet files"):
        read(tmp_path, "parquet", "[empty]")


def test_every_source_kind_prepares_the_same_store(tmp_path, corpus):
    """Tokenizer and store from parquet, jsonl.gz and an HF folder equal the ones from plain JSONL."""
    common = [f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300",
              "tokenizer.min_frequency=1"]
    stores = []
    for kind, file in (("jsonl", "plain.jsonl"), ("jsonl", "gz.jsonl.gz"), ("parquet", "docs.parquet"),
                       ("hf", "docs.parquet")):
        config = load_config(None, [f"data.corpus={kind}", f"data.train_files=[{file}]", *common])
        prepared = prepare(config, splits=("train",))
        stores.append((prepared.tokenizer.hash, prepared.stores["train"]))
    assert len({h for h, _ in stores}) == 1
    for _, store in stores[1:]:
        np.testing.assert_array_equal(store.tokens, stores[0][1].tokens)
        np.testing.assert_array_equal(store.line_offsets, stores[0][1].line_offsets)
        assert store.manifest["stats"] == stores[0][1].manifest["stats"]
