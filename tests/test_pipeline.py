"""build_pipeline: the batch contract on every strategy, determinism, exact resumption, process shards, bad input."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqjax.config.data import PACKERS, STRATEGIES
from seqjax.config.tree import ConfigError
from seqjax.core.errors import DataError
from seqjax.data import strategies
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from seqjax.data.stats import epoch_stats
from seqjax.data.strategies import STRATEGIES as STRATEGY_TABLE
from test_pipeline_helpers import (
    EOT,
    assert_contract,
    assert_resumes_exactly,
    config,
    epoch_batches,
    positional_store,
    predicted_counts,
    stores,
)

# (strategy, overrides, rows may hold padding, segments may cross documents)
CASES = [
    ("window", ["data.stride=3"], False, False),
    ("window", ["data.cross_document_attention=true"], False, True),
    ("random_offset", [], True, False),
    ("sequential", ["data.cross_document_attention=true"], False, True),
    ("sequential", [], False, False),
    ("random_window", [], False, False),
    ("concat_chunk", [], False, False),
    ("concat_chunk", ["data.cross_document_attention=true"], False, True),
    ("block", ["data.break_mode=none"], True, False),
    ("block", ["data.break_mode=complete", "data.cross_document_attention=true"], True, True),
    ("block", ["data.break_mode=complete_doc"], True, False),
    ("block", ["data.break_mode=eos"], True, False),
    ("length_grouped", ["data.mega_batch_mult=2"], True, False),
    ("length_grouped", ["data.overlong=truncate", "data.bucket_lengths=[2]"], True, False),
    *[("pack", [f"data.packer={p}", "data.pack_buffer=5"], True, False) for p in PACKERS if not p.startswith("grain")],
    ("pack", ["data.packer=first_fit", "data.max_segments_per_row=2", "data.overlong=drop"], True, False),
    ("pack", ["data.packer=greedy", "data.max_segments_per_row=1", "data.overlong=truncate"], True, False),
]
# Grain's packers are much slower per batch: fewer examples, same checks.
GRAIN_CASES = [
    ("pack", [f"data.packer={p}", "data.pack_buffer=5"], True, False) for p in PACKERS if p.startswith("grain")
]


def ids(cases):
    return ["-".join([s, *(o.split(".")[-1] for o in over)]) for s, over, *_ in cases]


IDS = ids(CASES)


@pytest.mark.parametrize("strategy,overrides,padding,crosses", CASES, ids=IDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store=stores(with_lines=True), seq_len=st.integers(2, 9), batch_size=st.integers(1, 3))
def test_contract_on_every_strategy(strategy, overrides, padding, crosses, store, seq_len, batch_size):
    check_epoch_contract(strategy, overrides, padding, crosses, store, seq_len, batch_size)


@pytest.mark.parametrize("strategy,overrides,padding,crosses", GRAIN_CASES, ids=ids(GRAIN_CASES))
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(store=stores(max_docs=6, max_len=12), seq_len=st.integers(2, 9))
def test_contract_on_grain_packers(strategy, overrides, padding, crosses, store, seq_len):
    batches = list(islice(iter(build_pipeline(config(strategy, seq_len, 1, *overrides), store)), 6))
    for batch in batches:
        assert_contract(batch, store, width=seq_len, cross_documents=crosses)


def check_epoch_contract(strategy, overrides, padding, crosses, store, seq_len, batch_size):
    cfg = config(strategy, seq_len, batch_size, *overrides)
    try:
        batches = epoch_batches(cfg, store)
    except DataError as err:  # a store too small for this batch must say so, before iterating
        assert any(
            why in str(err) for why in ("larger than one epoch", "fewer than one row needs", "dropped every document")
        )
        return
    buckets = set(EpochPlanner(cfg, store).plan(0).widths.tolist())
    for batch in batches:
        assert batch["inputs"].shape[0] == batch_size
        width = None if strategy == "length_grouped" else seq_len
        found = assert_contract(
            batch, store, width=width, cross_documents=crosses, padding=padding or batch is batches[-1]
        )
        assert batch["inputs"].shape[1] in buckets
        if "max_segments_per_row=2" in overrides:
            assert batch["segment_ids"].max() <= 2
        if not found and strategy not in ("length_grouped", "pack"):
            assert batch is batches[-1]  # only the epoch's last batch may hold empty rows


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES + GRAIN_CASES], ids=IDS + ids(GRAIN_CASES))
def test_deterministic_and_resumes_exactly_from_any_step(strategy, overrides):
    store = positional_store([7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6])
    cfg = config(strategy, 6, 2, *overrides, seed=3)
    reference = list(islice(iter(build_pipeline(cfg, store)), 36))  # several epochs
    again = list(islice(iter(build_pipeline(cfg, store)), 36))
    for a, b in zip(reference, again):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert_resumes_exactly(cfg, store, reference, steps=(0, 5, 17, 31))


def test_epochs_are_reshuffled_and_seed_matters():
    store = positional_store(list(range(1, 25)))
    cfg = config("pack", 8, 2, "data.packer=best_fit")
    first, second = epoch_batches(cfg, store, 0), epoch_batches(cfg, store, 1)
    other_seed = epoch_batches(config("pack", 8, 2, "data.packer=best_fit", seed=1), store, 0)
    key = lambda bs: np.concatenate([b["inputs"] for b in bs]).tobytes()  # noqa: E731
    assert key(first) != key(second) and key(first) != key(other_seed)
    counts = [
        predicted_counts([s for b in bs for s in assert_contract(b, store)], store.num_tokens) for bs in (first, second)
    ]
    np.testing.assert_array_equal(counts[0], counts[1])  # a new order, the same tokens


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES], ids=IDS)
def test_process_shards_are_disjoint_slices_that_cover_each_global_batch(strategy, overrides):
    store = positional_store([7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11] * 2)
    cfg = config(strategy, 5, 4, *overrides)
    whole = list(islice(iter(build_pipeline(cfg, store)), 12))
    shards = [list(islice(iter(build_pipeline(cfg, store, process_index=p, process_count=2)), 12)) for p in (0, 1)]
    for k, batch in enumerate(whole):
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([shards[0][k][key], shards[1][k][key]]), batch[key])


@pytest.mark.parametrize("packer", ["grain_first_fit", "grain_best_fit", "grain_concat_split"])
def test_grain_packers_shard_documents_disjointly(packer):
    store = positional_store([7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11])
    cfg = config("pack", 8, 2, f"data.packer={packer}")
    seen = []
    for p in (0, 1):
        batches = list(strategies.grain_packed(cfg, store, process_index=p, process_count=2, num_epochs=1))
        assert all(b["inputs"].shape == (1, 8) for b in batches)  # this process's half of each batch of 2
        found = [s for b in batches for s in assert_contract(b, store)]
        seen.append(predicted_counts(found, store.num_tokens))
    assert not np.any((seen[0] > 0) & (seen[1] > 0))
    np.testing.assert_array_equal(seen[0] + seen[1], np.r_[0, np.ones(store.num_tokens - 1, np.int64)])


def test_bad_input_is_refused_before_iteration():
    small = positional_store([3, 4])
    with pytest.raises(DataError, match="data.batch_size=8 is larger than one epoch"):
        build_pipeline(config("pack", 4, 8), small)
    with pytest.raises(DataError, match="fewer than one row needs"):
        build_pipeline(config("window", 64, 1), small)
    with pytest.raises(DataError, match=r"document 1 predicts 41 tokens, more than data.seq_len=8"):
        build_pipeline(config("pack", 8, 1, "data.overlong=error"), positional_store([3, 40, 50]))
    with pytest.raises(ConfigError, match="multiple of the process count 3"):
        build_pipeline(config("pack", 4, 2), small, process_count=3)
    with pytest.raises(ConfigError, match="packer fill"):
        build_pipeline(config("pack", 4, 1, "data.packer=fill", "data.max_segments_per_row=2"), small)
    with pytest.raises(ConfigError, match="data.stride"):
        config("window", 4, 1, "data.stride=0")
    with pytest.raises(ConfigError, match="data.strategy"):
        config("shuffle_everything", 4, 1)
    with pytest.raises(ConfigError, match="data.packer"):
        config("pack", 4, 1, "data.packer=worst_fit")
    with pytest.raises(ConfigError, match="data.seq_len"):
        config("pack", 1, 1)


def test_an_empty_store_is_refused():
    from seqjax.core.errors import StoreError
    from seqjax.store.reader import TokenStore

    with pytest.raises(StoreError, match="empty"):  # the store refuses to exist...
        TokenStore.from_documents([], EOT, 10)
    empty = object.__new__(TokenStore)  # ...and the pipeline refuses one built around that check
    empty.tokens, empty.doc_offsets, empty.line_offsets = (
        np.zeros(0, np.uint16),
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
    )
    with pytest.raises(DataError, match="empty"):
        build_pipeline(config("pack", 4, 1), empty)


def test_epoch_stats_match_the_batches():
    lengths = [7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11]
    store = positional_store(lengths)
    cfg = config("pack", 8, 3, "data.packer=first_fit", "data.overlong=truncate")
    stats = epoch_stats(cfg, store)
    batches = epoch_batches(cfg, store)
    weights = np.concatenate([b["weights"] for b in batches])
    real_rows = weights.any(axis=1)
    assert stats["batches_per_epoch"] == len(batches)
    assert stats["rows"] == int(real_rows.sum())
    assert stats["real_tokens"] == int(weights.sum())
    assert stats["padding_fraction"] == pytest.approx(1 - weights.sum() / (real_rows.sum() * 8))
    # a document predicts its text and its closing EOT; truncation keeps the first 8 of those
    assert stats["tokens_dropped"] == sum(max(0, n + 1 - 8) for n in lengths)
    assert stats["documents_truncated"] == sum(n + 1 > 8 for n in lengths) and stats["documents_split"] == 0
    segs = np.concatenate([b["segment_ids"].max(axis=1) for b in batches])
    assert stats["segments_per_row_max"] == segs.max()


@pytest.mark.parametrize(
    "strategy,overrides", [("pack", ["data.packer=greedy"]), ("length_grouped", []), ("random_offset", [])]
)
def test_building_batches_in_groups_changes_nothing(monkeypatch, strategy, overrides):
    import seqjax.data.epochs as epochs

    store = positional_store([7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11] * 2)
    cfg = config(strategy, 6, 4, *overrides)
    whole = list(islice(iter(build_pipeline(cfg, store, process_index=1, process_count=2)), 30))
    for slots in (1, 3 * 2 * 6):  # one batch per group; three batches per group
        monkeypatch.setattr(epochs, "BUILD_SLOTS", slots)
        fresh = iter(build_pipeline(cfg, store, process_index=1, process_count=2))
        resumed = iter(build_pipeline(cfg, store, process_index=1, process_count=2))
        resumed.set_state({"epoch": 0, "batch": 7})  # straight into the middle of a group
        pairs = [*zip(range(30), fresh), *zip(range(7, 30), resumed)]
        for k, batch in pairs:
            for key in batch:
                np.testing.assert_array_equal(batch[key], whole[k][key])


def test_the_strategy_table_lists_every_configured_strategy():
    assert tuple(STRATEGY_TABLE) == STRATEGIES


@pytest.mark.parametrize("strategy", [name for name, strategy in STRATEGY_TABLE.items() if not strategy.pads])
def test_strategies_the_table_says_never_pad_fill_every_row(strategy):
    store = positional_store([7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11] * 3)
    for cross in ("true", "false"):
        stats = epoch_stats(config(strategy, 6, 2, f"data.cross_document_attention={cross}"), store)
        assert stats["rows"] > 0 and stats["padding_fraction"] == 0.0, (strategy, cross)
