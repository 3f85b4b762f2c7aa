"""Mixtures: batches draw from each source by weight, deterministically from (seed, step), and resume exactly."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.data.mixture import BLOCK_BATCHES, Schedule, shares
from seqjax.data.pipeline import build_pipeline
from seqjax.data.stats import mixture_stats
from seqjax.data.strategies import check_config
from seqjax.store.build import prepare
from seqjax.store.reader import TokenStore
from test_pipeline import CASES, IDS
from test_pipeline_helpers import EOT, VOCAB, assert_contract, assert_resumes_exactly, config


def positional_mixture(weights, lengths=(7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11)):
    """Sources whose tokens name their position in the mixture's stream (as positional_store does for one)."""
    stores, p = [], 1
    for _ in weights:
        docs = []
        for n in lengths:
            docs.append(np.arange(p, p + n))
            p += n + 1
        stores.append(TokenStore.from_documents(docs, EOT, VOCAB))
    # each source's stream restarts at EOT; give its documents the positions they take in the joined stream
    return TokenStore.concat(stores, [f"s{i}" for i in range(len(weights))], list(weights))


def source_of(store: TokenStore, segments) -> list[int]:
    """Which source each segment (row, start, m) of a batch was read from, by its first target's stream position."""
    bounds = np.asarray(store.doc_offsets)[[end for *_, end in store.sources]]
    return [int(np.searchsorted(bounds, start + 1, "right")) for _, start, _ in segments]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=5).filter(lambda w: sum(w) > 0), st.integers(1, 64))
def test_shares_are_exact_largest_remainders(weights, total):
    counts = shares(weights, total)
    assert counts.sum() == total and np.all(counts >= 0)
    exact = np.asarray(weights) / sum(weights) * total
    assert np.all(np.abs(counts - exact) < 1)


def test_every_block_of_batches_holds_each_source_in_proportion():
    schedule = Schedule([3.0, 1.0, 0.5], batch_size=8, seed=0)
    per_block = np.zeros(3, np.int64)
    for step in range(BLOCK_BATCHES):
        per_block += np.bincount(schedule.sources(step), minlength=3)
    np.testing.assert_array_equal(per_block, shares([3.0, 1.0, 0.5], 8 * BLOCK_BATCHES))
    again = Schedule([3.0, 1.0, 0.5], batch_size=8, seed=0)
    assert all(np.array_equal(schedule.sources(k), again.sources(k)) for k in range(40))
    other = Schedule([3.0, 1.0, 0.5], batch_size=8, seed=1)
    assert any(not np.array_equal(schedule.sources(k), other.sources(k)) for k in range(40))


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES if s != "sequential"],
                         ids=[i for i, (s, *_) in zip(IDS, CASES) if s != "sequential"])
def test_every_strategy_applies_within_each_source_and_proportions_hold(strategy, overrides):
    store = positional_mixture([3.0, 1.0])
    cfg = config(strategy, 6, 4, *overrides)
    rows = np.zeros(2, np.int64)
    schedule = Schedule([3.0, 1.0], 4, 0)
    for step, batch in enumerate(islice(iter(build_pipeline(cfg, store)), 4 * BLOCK_BATCHES)):
        found = assert_contract(batch, store, cross_documents=True)
        owners = source_of(store, found)
        for (row, start, m), owner in zip(found, owners):
            assert owner == schedule.sources(step)[row]  # each row is read from the source the schedule names
            end_of_source = np.asarray(store.doc_offsets)[store.sources[owner][3]]
            assert start + m <= end_of_source  # a row never crosses into another source
        rows += np.bincount(schedule.sources(step), minlength=2)
    np.testing.assert_allclose(rows / rows.sum(), [0.75, 0.25], atol=1e-9)


def test_a_mixture_resumes_exactly_and_shards_by_process():
    store = positional_mixture([2.0, 1.0, 1.0])
    cfg = config("pack", 8, 4, "data.packer=best_fit", "data.plan_window_tokens=40", seed=5)
    reference = list(islice(iter(build_pipeline(cfg, store)), 50))
    assert_resumes_exactly(cfg, store, reference, steps=(0, 9, 31), check=6)
    shards = [list(islice(iter(build_pipeline(cfg, store, process_index=p, process_count=2)), 50)) for p in (0, 1)]
    for k, batch in enumerate(reference):
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([shards[0][k][key], shards[1][k][key]]), batch[key])


def test_the_data_report_prints_the_realized_proportions(tmp_path):
    for name, text in (("a", "alpha beta gamma delta\n"), ("b", "one two three\nfour five\n")):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{text} {i}"}) + "\n" for i in range(30)))
    sources = ("[{name: a, corpus: jsonl, train_files: [a.jsonl], weight: 3}, "
               "{name: b, corpus: jsonl, train_files: [b.jsonl], weight: 1}]")
    cfg = load_config(None, [f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", f"data.sources={sources}",
                             "tokenizer.vocab_size=300", "data.strategy=pack", "data.seq_len=16", "data.batch_size=4"])
    prepared = prepare(cfg, splits=("train",))
    assert set(prepared.summary["train"]["sources"]) == {"a", "b"}
    store = prepared.stores["train"]
    assert [s[0] for s in store.sources] == ["a", "b"] and store.num_docs == 60
    report = mixture_stats(cfg, store, steps=2 * BLOCK_BATCHES)
    assert report["sources"]["a"]["weight"] == 0.75 and report["sources"]["a"]["row_fraction"] == 0.75
    assert report["sources"]["b"]["rows"] == 2 * BLOCK_BATCHES
    assert sum(s["tokens"] for s in report["sources"].values()) == report["real_tokens"]


@pytest.mark.parametrize("overrides, message", [
    (["data.sources=[{corpus: jsonl}]"], "data.sources[0].train_files: got [], expected at least one file"),
    (["data.sources=[{name: x, train_files: [a]}, {name: x, train_files: [b]}]", "data.corpus=jsonl"],
     "data.sources[1].name: got 'x', expected a name no other source has"),
    (["data.sources=[{weight: 0}]"], "data.sources: every weight is 0"),
    (["data.sources=[{}]", "data.train_files=[a.jsonl]"], "data.train_files: got ['a.jsonl'], expected [] when"),
    (["data.sources=[{}]", "data.strategy=sequential"], "data.strategy: got 'sequential', expected another"),
    (["data.sources=[{}]", "data.packer=grain_best_fit"], "data.packer: got 'grain_best_fit', expected a seqjax"),
    (["data.sources=[{wieght: 2}]"], "unknown config key 'data.sources[0].wieght'; did you mean data.sources[].weight"),
])
def test_bad_mixture_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(load_config(None, overrides))  # (the strategies table's rules: every command runs them)
    assert message in str(err.value)
