"""Epochs planned a window at a time: the same promises per epoch, a two-level shuffle, exact O(1) resume."""

from __future__ import annotations

import dataclasses
from itertools import islice

import numpy as np
import pytest

from seqjax.data import strategies
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from test_pipeline import CASES, IDS
from test_pipeline_helpers import (
    assert_contract,
    assert_resumes_exactly,
    config,
    epoch_batches,
    positional_store,
    predicted_counts,
)

LENGTHS = [7, 1, 12, 30, 3, 9, 4, 15, 2, 22, 6, 11] * 4
WINDOW = "data.plan_window_tokens=60"  # about a dozen windows over this store


def coverage_of_epoch(cfg, store, epoch=0) -> np.ndarray:
    found = [s for b in epoch_batches(cfg, store, epoch) for s in assert_contract(b, store)]
    return predicted_counts(found, store.num_tokens)


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES], ids=IDS)
def test_a_windowed_epoch_predicts_what_a_whole_epoch_predicts(strategy, overrides):
    """Per epoch, every strategy covers the stream exactly as its one-window plan does (or, for the strategies that
    restart inside a window, block and the document strategies, every token they promise, once)."""
    store = positional_store(LENGTHS)
    whole = config(strategy, 6, 2, *overrides)
    windowed = config(strategy, 6, 2, *overrides, WINDOW)
    assert len(EpochPlanner(windowed, store).windows(0)) > 3
    a, b = coverage_of_epoch(whole, store), coverage_of_epoch(windowed, store)
    if strategy in ("window", "random_offset", "sequential", "concat_chunk") or "truncate" in " ".join(overrides) \
            or "drop" in " ".join(overrides):
        if strategy in ("random_offset", "sequential"):  # a per-epoch offset: compare tokens after both offsets
            start = max(np.argmax(a > 0), np.argmax(b > 0))
            a, b = a[start:], b[start:]
        if strategy not in ("pack", "length_grouped"):
            np.testing.assert_array_equal(a, b)
    if strategy == "random_offset":
        assert set(np.unique(b[np.argmax(b > 0):])) == {1}  # every token after the offset exactly once
    if strategy in ("block", "pack", "length_grouped") and not any(o in " ".join(overrides)
                                                                   for o in ("truncate", "drop")):
        np.testing.assert_array_equal(b[1:], np.ones(store.num_tokens - 1, np.int64))  # each token once


@pytest.mark.parametrize("strategy,overrides", [(s, o) for s, o, *_ in CASES], ids=IDS)
def test_windowed_plans_resume_exactly_and_shard_by_process(strategy, overrides):
    store = positional_store(LENGTHS)
    cfg = config(strategy, 5, 4, *overrides, WINDOW, seed=2)
    reference = list(islice(iter(build_pipeline(cfg, store)), 60))
    without_window = lambda state: [state, {"epoch": state["epoch"], "batch": state["batch"]}]  # noqa: E731
    assert_resumes_exactly(cfg, store, reference, steps=(0, 7, 23, 41), states=without_window, check=5)
    shards = [list(islice(iter(build_pipeline(cfg, store, process_index=p, process_count=2)), 60)) for p in (0, 1)]
    for k, batch in enumerate(reference):
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([shards[0][k][key], shards[1][k][key]]), batch[key])


def test_resume_plans_one_window_and_replays_nothing(monkeypatch):
    store = positional_store(LENGTHS * 4)
    cfg = config("pack", 8, 2, "data.packer=best_fit", WINDOW)
    it = iter(build_pipeline(cfg, store))
    for _ in range(30):
        next(it)
    state, expect = it.get_state(), next(it)
    planned = []
    window_plan = EpochPlanner._window_plan
    monkeypatch.setattr(EpochPlanner, "_window_plan", lambda self, e, w: planned.append((e, w)) or window_plan(
        self, e, w))
    built = []
    packing = strategies.PACKERS["best_fit"]
    monkeypatch.setitem(strategies.PACKERS, "best_fit",
                        dataclasses.replace(packing, rows=lambda *a: built.append(1) or packing.rows(*a)))
    resumed = iter(build_pipeline(cfg, store))
    planned.clear()  # build_pipeline's own check planned the first window served
    resumed.set_state(state)
    got = next(resumed)
    assert planned == [(state["epoch"], state["window"])]  # one window planned, no batch before it rebuilt
    for key in expect:
        np.testing.assert_array_equal(got[key], expect[key])


def test_the_shuffle_has_two_levels_and_rows_stay_inside_their_window():
    store = positional_store(LENGTHS * 2)
    cfg = config("window", 6, 2, WINDOW)
    planner = EpochPlanner(cfg, store)
    orders = [planner.windows(e).tolist() for e in range(3)]
    assert sorted(orders[0]) == list(range(len(orders[0]))) and len({tuple(o) for o in orders}) > 1
    for position in range(len(orders[0]) - 1):  # every row of a window reads its own stretch of the stream
        window = planner.window_plan(0, position)
        w = int(planner.windows(0)[position])
        assert window.num_rows <= planner.window_rows
        lo, hi = w * planner.window_rows * 6, (w + 1) * planner.window_rows * 6 + 1
        assert window.starts.min() >= lo and (window.starts + window.lengths).max() <= hi
    doc_cfg = config("pack", 6, 2, WINDOW)
    doc_planner = EpochPlanner(doc_cfg, store)
    bounds = doc_planner.doc_bounds
    sizes = np.diff(np.asarray(store.doc_offsets)[bounds])
    assert len(bounds) > 3 and sizes.max() <= 60 + max(LENGTHS) + 1  # a window holds about plan_window_tokens
