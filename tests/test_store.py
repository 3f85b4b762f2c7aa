"""The token store: layout, atomic writes, refusal of foreign tokenizers, and prepare's reuse and rebuild rules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus_factory import make_text_corpus
from seqjax.config.load import load_config
from seqjax.core.errors import StoreError
from seqjax.store import build
from seqjax.store import tokenizer as tokenizer_module
from seqjax.store.build import prepare
from seqjax.store.layout import MANIFEST, token_dtype
from seqjax.store.reader import TokenStore
from seqjax.store.writer import ShardWriter, StoreWriter, write_store


def shard_file(store: TokenStore, name: str, shard: int = 0):
    """A file of one of the store's shards."""
    return store.path / store.manifest["shards"][shard]["name"] / name


_line = st.lists(st.integers(1, 9), min_size=1, max_size=4)
_doc = st.lists(_line, min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.lists(_doc, min_size=1, max_size=6))
def test_streamed_store_equals_the_in_memory_layout(tmp_path_factory, docs):
    path = tmp_path_factory.mktemp("s") / "split"
    with StoreWriter(path, eot_id=0, vocab_size=10) as writer:
        for lines in docs:
            writer.add_document(lines)
        on_disk = writer.commit({"note": "x"})
    in_memory = TokenStore.from_documents(
        [sum(lines, []) for lines in docs],
        eot_id=0,
        vocab_size=10,
        lines=[[len(line) for line in lines] for lines in docs],
    )
    for name in ("tokens", "doc_offsets", "line_offsets"):
        np.testing.assert_array_equal(getattr(on_disk, name), getattr(in_memory, name))
    assert on_disk.manifest["note"] == "x" and on_disk.manifest["num_docs"] == len(docs)
    for i, lines in enumerate(docs):
        assert list(on_disk.doc(i)) == sum(lines, []) + [0]


def test_dtype_follows_the_vocabulary(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    big = write_store(tmp_path / "big", TokenStore.from_documents([[70_000, 5]], eot_id=1, vocab_size=70_001), {})
    assert big.tokens.dtype == np.uint32 and list(big.doc(0)) == [70_000, 5, 1]
    assert shard_file(big, "tokens.bin").stat().st_size == 4 * 4
    small = write_store(tmp_path / "small", TokenStore.from_documents([[7, 5]], eot_id=1, vocab_size=10), {})
    assert small.tokens.dtype == np.uint16 and shard_file(small, "tokens.bin").stat().st_size == 4 * 2


@pytest.mark.parametrize(
    "tokens, docs, lines, message",
    [
        ([0, 5, 0], [0, 3], [0, 3], "doc_offsets must rise from 1"),
        ([0, 5, 0], [1, 3], [1, 2, 2, 3], "line_offsets must rise"),
        ([0, 5, 6, 0], [1, 3, 4], [1, 4], "every document boundary must be a line boundary"),
        ([0, 5, 6, 0], [1, 3, 4], [1, 3, 4], "separated by eot_id=0"),
        ([0], [1], [1], "holds no documents"),
    ],
)
def test_validate_refuses_a_broken_layout(tokens, docs, lines, message):
    with pytest.raises(StoreError, match=message):
        TokenStore(np.asarray(tokens, np.uint16), np.asarray(docs), np.asarray(lines), eot_id=0, vocab_size=10)


def test_open_refuses_an_incomplete_store_a_foreign_tokenizer_and_an_old_format(tmp_path):
    with pytest.raises(StoreError, match="missing manifest.json"):
        TokenStore.open(tmp_path / "nothing")
    store = write_store(
        tmp_path / "s", TokenStore.from_documents([[3, 4]], eot_id=0, vocab_size=10), {"tokenizer_hash": "a" * 64}
    )
    before = {p: p.read_bytes() for p in store.path.rglob("*") if p.is_file()}
    assert TokenStore.open(store.path, tokenizer_hash="a" * 64).num_docs == 1
    with pytest.raises(
        StoreError, match="built with tokenizer aaaaaaaaaaaa, but the tokenizer in use is bbbbbbbbbbbb; refusing"
    ):
        TokenStore.open(store.path, tokenizer_hash="b" * 64)
    assert {p: p.read_bytes() for p in store.path.rglob("*") if p.is_file()} == before  # refusing changed nothing
    manifest = json.loads((store.path / MANIFEST).read_text())
    (store.path / MANIFEST).write_text(json.dumps({**manifest, "format_version": 0}))
    with pytest.raises(StoreError, match="format_version 0, expected 2"):
        TokenStore.open(store.path)


def test_an_exception_mid_build_leaves_no_store_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "split"
    with pytest.raises(RuntimeError):
        with StoreWriter(path, eot_id=0, vocab_size=10) as writer:
            writer.add_document([[1, 2]])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither a store nor a staging folder
    old = write_store(path, TokenStore.from_documents([[7, 7]], eot_id=0, vocab_size=10), {"v": "old"})
    with pytest.raises(RuntimeError):
        with StoreWriter(path, eot_id=0, vocab_size=10) as writer:
            writer.add_document([[1, 2]])
            raise RuntimeError("interrupted")
    again = TokenStore.open(path)
    assert again.manifest["v"] == "old" and list(again.doc(0)) == list(old.doc(0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]


KILL_MID_BUILD = textwrap.dedent(
    """
    import os, signal, sys
    from seqjax.store.writer import StoreWriter
    writer = StoreWriter(sys.argv[1], eot_id=0, vocab_size=10)
    for _ in range(1000):
        writer.add_document([[1, 2, 3], [4]])
    os.kill(os.getpid(), signal.SIGKILL)  # as if the machine died before commit()
    """
)


def test_a_killed_build_never_looks_complete(tmp_path):
    path = tmp_path / "split"
    old = write_store(path, TokenStore.from_documents([[7, 7]], eot_id=0, vocab_size=10), {"v": "old"})
    for target in (path, tmp_path / "fresh"):
        proc = subprocess.run([sys.executable, "-c", KILL_MID_BUILD, str(target)], capture_output=True, text=True)
        assert proc.returncode == -9, proc.stderr
    assert TokenStore.open(path).manifest["v"] == "old" and list(TokenStore.open(path).doc(0)) == list(old.doc(0))
    with pytest.raises(StoreError, match="no complete token store"):
        TokenStore.open(tmp_path / "fresh")
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
    assert len(leftovers) == 2 and all(".split." in n or ".fresh." in n for n in leftovers)
    # the next build removes the dead builds' staging folders
    with StoreWriter(tmp_path / "fresh", eot_id=0, vocab_size=10) as writer:
        writer.add_document([[5]])
        writer.commit({})
    StoreWriter(path, eot_id=0, vocab_size=10).abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "split"]


# ---------------------------------------------------------------------------
# prepare(): reuse, rebuild, tokenizer identity


@pytest.fixture
def corpus(tmp_path):
    overrides = make_text_corpus(tmp_path / "corpus", tmp_path / "cache")
    return tmp_path / "corpus", overrides


def _no_builds(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a store was rebuilt although nothing changed")

    monkeypatch.setattr(build, "build_shard", refuse)
    monkeypatch.setattr(tokenizer_module, "train_tokenizer", refuse)


def test_second_prepare_reuses_everything(corpus, monkeypatch):
    _, overrides = corpus
    config = load_config(None, overrides)
    first = prepare(config)
    assert not any(s["reused"] for s in first.summary.values())
    assert first.summary["train"]["documents"] == 3 and first.summary["train"]["skipped_empty"] == 1
    _no_builds(monkeypatch)
    second = prepare(config)
    assert all(s["reused"] for s in second.summary.values())
    assert second.tokenizer.hash == first.tokenizer.hash
    for split in first.stores:
        np.testing.assert_array_equal(second.stores[split].tokens, first.stores[split].tokens)
    # the same tokenizer file given explicitly is the same tokenizer: the stores are shared
    explicit = prepare(load_config(None, overrides + [f"tokenizer.path={first.tokenizer.path}"]))
    assert explicit.root == first.root and all(s["reused"] for s in explicit.summary.values())


def test_a_changed_source_rebuilds_only_its_split(corpus):
    root, overrides = corpus
    config = load_config(None, overrides)
    first = prepare(config)
    (root / "valid" / "001.txt").write_text("a different last line")
    second = prepare(config)
    assert {s: v["reused"] for s, v in second.summary.items()} == {"train": True, "valid": False, "test": True}
    text = second.tokenizer.decode(second.stores["valid"].doc(1)[:-1])
    assert text == "a different last line" and second.summary["valid"]["bytes"] != first.summary["valid"]["bytes"]


def test_adding_a_validation_file_neither_moves_nor_rebuilds_the_train_store(corpus):
    root, overrides = corpus
    config = load_config(None, overrides)
    first = prepare(config)
    (root / "valid" / "002.txt").write_text("one more validation document\n")
    listed = [o for o in overrides if not o.startswith("data.valid_files=")]
    more = load_config(None, listed + [f"data.valid_files=[{root / 'valid'}/000.txt,{root / 'valid'}/001.txt,"
                                         f"{root / 'valid'}/002.txt]"])
    second = prepare(more)
    assert second.summary["train"]["reused"] and second.stores["train"].path == first.stores["train"].path
    assert not second.summary["valid"]["reused"] and second.stores["valid"].num_docs == 3


def test_a_changed_tokenizer_builds_new_stores_beside_the_old(corpus):
    root, overrides = corpus
    first = prepare(load_config(None, overrides))
    bigger = prepare(load_config(None, overrides + ["tokenizer.vocab_size=320"]))
    assert bigger.tokenizer.hash != first.tokenizer.hash and bigger.root != first.root
    assert not any(s["reused"] for s in bigger.summary.values())
    (root / "train" / "000.txt").write_text("new training text changes the tokenizer\n")
    retrained = prepare(load_config(None, overrides))
    assert retrained.tokenizer.hash != first.tokenizer.hash
    # every earlier store is still complete and still refuses the other tokenizers
    assert TokenStore.open(first.stores["valid"].path, tokenizer_hash=first.tokenizer.hash).num_docs == 2
    with pytest.raises(StoreError, match="refusing"):
        TokenStore.open(first.stores["valid"].path, tokenizer_hash=retrained.tokenizer.hash)


def test_prepare_rebuilds_a_cached_store_whose_manifest_names_another_tokenizer(corpus):
    _, overrides = corpus
    config = load_config(None, overrides)
    first = prepare(config)
    manifest_path = first.stores["test"].path / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["build_key"]["tokenizer_hash"] = manifest["tokenizer_hash"] = "f" * 64
    manifest_path.write_text(json.dumps(manifest))
    again = prepare(config)
    assert again.summary["test"]["reused"] is False
    assert again.stores["test"].manifest["tokenizer_hash"] == first.tokenizer.hash


def test_a_failed_rebuild_keeps_the_previous_store(corpus, monkeypatch):
    root, overrides = corpus
    config = load_config(None, overrides)
    first = prepare(config)
    old_tokens = np.array(first.stores["valid"].tokens)
    (root / "valid" / "000.txt").write_text("changed\n")

    def fail(self, *chunk):
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "add_chunk", fail)
    with pytest.raises(KeyboardInterrupt):
        prepare(config)
    monkeypatch.undo()
    kept = TokenStore.open(first.stores["valid"].path, tokenizer_hash=first.tokenizer.hash)
    np.testing.assert_array_equal(kept.tokens, old_tokens)
    assert not [p for p in first.stores["valid"].path.parent.iterdir() if p.name.endswith(".tmp")]
    assert prepare(config).summary["valid"]["reused"] is False


def test_prepare_checks_inputs_before_any_work(corpus):
    root, overrides = corpus
    cache = root.parent / "cache"
    with pytest.raises(ValueError, match="tokenizer.vocab_size: got 258, expected at least 259"):
        prepare(load_config(None, overrides + ["tokenizer.vocab_size=258", "tokenizer.special_tokens=[a, b, c]"]))
    with pytest.raises(ValueError, match="data.test_files: 'gone' not found"):
        prepare(load_config(None, overrides + ["data.test_files=[gone]"]))
    with pytest.raises(ValueError, match="splits: got \\['dev'\\]"):
        prepare(load_config(None, overrides), splits=["dev"])
    assert not cache.exists()
