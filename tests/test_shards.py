"""Sharded stores: one logical stream, built in parallel and by several processes, resumed after a kill, and checked.

The damage tests are issue 13's list: a token file truncated to an odd and to
an even size, tokens overwritten with other valid ids, ids pushed out of the
vocabulary. Inside the cache each is reported, set aside and rebuilt; opened
by path each is refused with a message naming the file, what was expected,
what was found and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from itertools import islice

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.core.errors import StoreError
from seqjax.data.pipeline import build_pipeline
from seqjax.store import build, shard
from seqjax.store.build import prepare
from seqjax.store.layout import MANIFEST
from seqjax.store.reader import TokenStore
from seqjax.store.stream import TokenStream
from test_multiprocess import free_port
from test_pipeline import CASES, IDS
from test_train_support import REPO, cli_env

FILES = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five JSONL files of short documents, and overrides that read them."""
    root = tmp_path_factory.mktemp("sharded")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while dogs ran far away and birds sang".split()
    for f in range(FILES):
        with open(root / f"part{f}.jsonl", "w") as out:
            for _ in range(12):
                lines = [" ".join(rng.choice(words, rng.integers(1, 12))) + "\n" for _ in range(rng.integers(1, 4))]
                out.write(json.dumps({"text": "".join(lines)}) + "\n")
    return root, ["data.corpus=jsonl", f"data.dir={root}", "data.train_files=['part*.jsonl']",
                  "tokenizer.vocab_size=300", "tokenizer.min_frequency=1"]


def prepared(corpus, cache, *extra):
    root, overrides = corpus
    return prepare(load_config(None, [*overrides, f"data.cache_dir={cache}", *extra]), splits=("train",))


@pytest.fixture(scope="module")
def one_and_many(corpus, tmp_path_factory):
    one = prepared(corpus, tmp_path_factory.mktemp("cache"))
    many = prepared(corpus, tmp_path_factory.mktemp("cache"), "data.shard_bytes=1")  # a shard per file
    return one.stores["train"], many.stores["train"]


def test_a_store_of_many_shards_reads_as_the_store_of_one(one_and_many):
    one, many = one_and_many
    assert len(one.manifest["shards"]) == 1 and len(many.manifest["shards"]) == FILES
    assert isinstance(many.tokens, TokenStream) and len(many.tokens) == len(one.tokens)
    for name in ("doc_offsets", "line_offsets"):
        np.testing.assert_array_equal(getattr(many, name), getattr(one, name))
    np.testing.assert_array_equal(np.asarray(many.tokens), one.tokens)
    rng = np.random.default_rng(1)
    index = rng.integers(0, len(one.tokens), size=(7, 50))
    np.testing.assert_array_equal(many.tokens[index], one.tokens[index])
    for a, b in ((0, 5), (37, 400), (len(one.tokens) - 9, len(one.tokens))):
        np.testing.assert_array_equal(many.tokens[a:b], one.tokens[a:b])
    assert many.manifest["stats"] == one.manifest["stats"] and many.max_id == one.max_id


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES], ids=IDS)
def test_sharded_and_unsharded_stores_give_identical_batches(one_and_many, strategy, overrides):
    one, many = one_and_many
    cfg = load_config(None, [f"data.strategy={strategy}", "data.seq_len=16", "data.batch_size=4", *overrides])
    for a, b in zip(islice(iter(build_pipeline(cfg, one)), 12), islice(iter(build_pipeline(cfg, many)), 12)):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_the_tokenizer_pool_builds_the_store_one_process_builds(corpus, tmp_path, monkeypatch, one_and_many):
    one, _ = one_and_many
    monkeypatch.setattr(shard, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(shard, "CHUNK_CHARS", 500)  # many chunks, handed back out of order by two workers
    pooled = prepared(corpus, tmp_path / "cache", "data.workers=2").stores["train"]
    np.testing.assert_array_equal(pooled.tokens, one.tokens)
    np.testing.assert_array_equal(pooled.line_offsets, one.line_offsets)


def test_reuse_reads_no_source_file_and_verify_rehashes_them(corpus, tmp_path, monkeypatch, caplog):
    root, _ = corpus
    first = prepared(corpus, tmp_path / "cache", "data.shard_bytes=1")

    def no_hashing(path):
        raise AssertionError(f"reuse hashed the source {path}")

    with monkeypatch.context() as patch:
        patch.setattr(build, "content_hash", no_hashing)
        patch.setattr(shard, "content_hash", no_hashing)
        assert prepared(corpus, tmp_path / "cache", "data.shard_bytes=1").summary["train"]["reused"]
    # same size and time, other content: only --verify sees it, and rebuilds that one shard
    path = root / "part2.jsonl"
    stat, data = path.stat(), path.read_bytes()
    path.write_bytes(data.replace(b"cat", b"cow"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    try:
        assert prepared(corpus, tmp_path / "cache", "data.shard_bytes=1").summary["train"]["reused"]
        with caplog.at_level(logging.WARNING, logger="seqjax"):
            config = load_config(None, [*corpus[1], f"data.cache_dir={tmp_path / 'cache'}", "data.shard_bytes=1"])
            again = prepare(config, splits=("train",), verify=True)
        assert "part2.jsonl changed since the build" in caplog.text
        assert not again.summary["train"]["reused"]
        shards = first.stores["train"].manifest["shards"]
        assert [s["xxh3"] for s in again.stores["train"].manifest["shards"][2]["sources"]] != [
            s["xxh3"] for s in shards[2]["sources"]]
    finally:
        path.write_bytes(data)


def test_a_large_store_is_verified_once_and_again_when_a_file_changes(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "VERIFY_EVERY_REUSE_BYTES", 0)  # every store counts as large
    store = prepared(corpus, tmp_path / "cache").stores["train"]
    assert "verified" not in store.manifest
    assert prepared(corpus, tmp_path / "cache").summary["train"]["reused"]  # first reuse: verified and recorded
    assert "verified" in json.loads((store.path / MANIFEST).read_text())
    calls = []
    monkeypatch.setattr(build, "shard_problems", lambda *a, **k: calls.append(k["checksums"]) or [])
    prepared(corpus, tmp_path / "cache")
    assert calls == [False]  # recorded and unchanged: sizes only
    tokens = store.path / store.manifest["shards"][0]["name"] / "tokens.bin"
    os.utime(tokens, ns=(tokens.stat().st_atime_ns, tokens.stat().st_mtime_ns + 10**9))
    prepared(corpus, tmp_path / "cache")
    assert calls == [False, True]  # a file's time moved: checksums again


KILL_AFTER_TWO_SHARDS = textwrap.dedent(
    """
    import os, signal, sys
    from seqjax.config.load import load_config
    from seqjax.store import build, writer as store_writer
    from seqjax.store.build import prepare

    commit, done = store_writer.ShardWriter.commit, []
    def commit_then_die(self, record=None):
        entry = commit(self, record)
        done.append(entry["name"])
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # as if the machine died between two shards
        return entry
    store_writer.ShardWriter.commit = commit_then_die
    prepare(load_config(None, sys.argv[1:]), splits=("train",))
    """
)


def test_a_killed_build_rebuilds_only_the_missing_shards(corpus, tmp_path, monkeypatch, one_and_many):
    one, _ = one_and_many
    overrides = [*corpus[1], f"data.cache_dir={tmp_path / 'cache'}", "data.shard_bytes=1"]
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_TWO_SHARDS, *overrides], capture_output=True, text=True,
                          cwd=REPO, env=cli_env())
    assert proc.returncode == -9, proc.stderr[-2000:]
    store_dirs = list((tmp_path / "cache").rglob("train"))
    assert len(store_dirs) == 1 and not (store_dirs[0] / MANIFEST).exists()  # nothing looks complete
    finished = sorted(p.name for p in store_dirs[0].iterdir() if p.name.startswith("shard-"))
    assert len(finished) == 2
    with pytest.raises(StoreError, match="no complete token store"):
        TokenStore.open(store_dirs[0])
    built = []
    build_shard = build.build_shard
    monkeypatch.setattr(build, "build_shard", lambda path, name, *a: built.append(name) or build_shard(path, name, *a))
    store = prepare(load_config(None, overrides), splits=("train",)).stores["train"]
    assert sorted(built) == sorted(s["name"] for s in store.manifest["shards"] if s["name"] not in finished)
    assert len(built) == FILES - 2
    np.testing.assert_array_equal(np.asarray(store.tokens), one.tokens)
    np.testing.assert_array_equal(store.line_offsets, one.line_offsets)
    assert not [p for p in store_dirs[0].parent.iterdir() if p.name.endswith(".tmp")]  # the dead staging is gone


def test_two_processes_under_jax_distributed_build_the_store_one_process_builds(corpus, tmp_path):
    overrides = [*corpus[1], f"data.cache_dir={tmp_path / 'cache'}", "data.shard_bytes=1", "--splits", "train"]
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "seqjax.prepare", *overrides], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=cli_env(SEQJAX_COORDINATOR=coordinator, SEQJAX_NUM_PROCESSES="2",
                                          SEQJAX_PROCESS_ID=str(i)))
             for i in range(2)]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
    # process 0 built shards 0, 2, 4 and process 1 shards 1, 3
    assert "3 of its 5 shards" in outputs[0][1] and "2 of its 5 shards" in outputs[1][1]
    summary = json.loads(outputs[0][0].strip().splitlines()[-1])
    two = TokenStore.open(summary["train"]["store"])
    alone = prepared(corpus, tmp_path / "alone", "data.shard_bytes=1").stores["train"]
    assert [s["name"] for s in two.manifest["shards"]] == [s["name"] for s in alone.manifest["shards"]]
    assert [s["files"] for s in two.manifest["shards"]] == [s["files"] for s in alone.manifest["shards"]]
    np.testing.assert_array_equal(np.asarray(two.tokens), np.asarray(alone.tokens))


# ---------------------------------------------------------------------------
# Damage (issue 13): detected on open by path and on reuse in the cache


def _cut_to_odd(tokens):
    tokens.write_bytes(tokens.read_bytes()[:-3])


def _cut_to_even(tokens):
    tokens.write_bytes(tokens.read_bytes()[:-4])


def _other_valid_ids(tokens):
    data = np.fromfile(tokens, np.uint16)
    data[5:9] = (data[5:9] + 1) % 250 + 1  # still inside the 300-token vocabulary
    data.tofile(tokens)


def _out_of_vocabulary(tokens):
    data = np.fromfile(tokens, np.uint16)
    data[7] = 60_000
    data.tofile(tokens)


DAMAGE = {
    "truncated_odd": (_cut_to_odd, r"tokens.bin is [\d,]+ bytes, the manifest records [\d,]+ \(truncated"),
    "truncated_even": (_cut_to_even, r"tokens.bin is [\d,]+ bytes, the manifest records [\d,]+ \(truncated"),
    "other_valid_ids": (_other_valid_ids, r"tokens.bin has checksum xxh3:\w+, the manifest records xxh3:\w+"),
    "out_of_vocabulary": (_out_of_vocabulary, r"holds token id 60000 at position 7, outside the vocabulary of 300"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_store_opened_by_path_is_refused_naming_file_expected_found_and_what_to_do(
        corpus, tmp_path, damage):
    store = prepared(corpus, tmp_path / "cache", "data.shard_bytes=1").stores["train"]
    tokens = store.path / store.manifest["shards"][1]["name"] / "tokens.bin"
    harm, message = DAMAGE[damage]
    harm(tokens)
    verify = damage in ("other_valid_ids", "out_of_vocabulary")  # same size: only the checksum tells
    if verify:
        TokenStore.open(store.path)  # sizes agree: opening alone cannot know
    with pytest.raises(StoreError) as err:
        TokenStore.open(store.path, verify=verify)
    text = str(err.value)
    assert f"token store {store.path} is damaged: {tokens}" in text
    assert re.search(message, text) and "delete it and run python -m seqjax.prepare to rebuild it" in text


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_store_in_the_cache_is_reported_set_aside_and_rebuilt(corpus, tmp_path, damage, caplog,
                                                                        one_and_many):
    one, _ = one_and_many
    store = prepared(corpus, tmp_path / "cache", "data.shard_bytes=1").stores["train"]
    damaged_shard = store.manifest["shards"][1]["name"]
    kept = store.path / store.manifest["shards"][3]["name"] / "tokens.bin"
    kept_inode = kept.stat().st_ino
    harm, message = DAMAGE[damage]
    harm(store.path / damaged_shard / "tokens.bin")
    with caplog.at_level(logging.WARNING, logger="seqjax"):
        again = prepared(corpus, tmp_path / "cache", "data.shard_bytes=1")
    assert re.search(message, caplog.text) and "set aside in" in caplog.text
    aside = list((store.path.parent / "damaged").iterdir())
    assert len(aside) == 1 and damaged_shard in aside[0].name  # kept for a person to look at
    assert again.summary["train"]["reused"] is False
    rebuilt = again.stores["train"]
    np.testing.assert_array_equal(np.asarray(rebuilt.tokens), one.tokens)
    assert kept.stat().st_ino == kept_inode  # the undamaged shards were kept, not rebuilt
    TokenStore.open(rebuilt.path, verify=True)


def test_a_store_whose_ids_exceed_the_model_vocabulary_is_refused_before_training(corpus, tmp_path):
    store = prepared(corpus, tmp_path / "cache").stores["train"]
    small = load_config(None, ["data.strategy=window", "data.seq_len=8", f"model.vocab_size={store.max_id}"])
    with pytest.raises(StoreError, match=rf"holds token id {store.max_id}, outside the vocabulary of "
                                         rf"{store.max_id} \(model.vocab_size\)"):
        build_pipeline(small, store)
    build_pipeline(load_config(None, ["data.strategy=window", "data.seq_len=8",
                                      f"model.vocab_size={store.max_id + 1}"]), store)


def test_a_weights_stream_reads_a_shared_closing_eot_from_the_shard_that_ends_with_it():
    """Shard k + 1 opens with the EOT shard k closes with; its weight (a scored closing EOT: 1) is shard k's entry.
    Gathers, scalars, slices and the whole array all read the stream the same way."""
    logical = np.asarray([0, 1, 0, 1, 1, 0, 1, 1, 0, 1], np.float32)  # positions 3 and 6 are shared EOTs, scored
    stream = TokenStream([logical[:4], np.r_[0, logical[4:7]].astype(np.float32), np.r_[0, logical[7:]]
                          .astype(np.float32)])
    assert len(stream) == len(logical)
    np.testing.assert_array_equal(stream[np.arange(len(logical))], logical)
    np.testing.assert_array_equal(np.asarray(stream), logical)
    assert [float(stream[i]) for i in range(len(logical))] == logical.tolist()
    for a, b in ((2, 5), (3, 8), (6, 7), (0, 10)):
        np.testing.assert_array_equal(stream[a:b], logical[a:b])
    # a mixture of a 0/1 (byte) source and a float32 one reads as float32: no weight is cut to a byte
    mixed = TokenStream([logical[:4].astype(np.uint8), np.r_[0, logical[4:7]].astype(np.uint8),
                         np.float32([0, 0.25, 0.5])])
    assert mixed.dtype == np.float32
    np.testing.assert_array_equal(mixed[np.arange(9)], np.r_[logical[:7], 0.25, 0.5])
