"""Packers and length-grouped batches: what each promises about documents, rows and padding."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from seqjax.config.data import PACKERS
from seqjax.core.errors import DataError
from seqjax.data import strategies
from seqjax.data.document_rows import bucket_lengths, length_grouped_order
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from test_pipeline_helpers import assert_contract, config, epoch_batches, positional_store, predicted_counts, stores

FAST = settings(max_examples=20, deadline=None)
OURS = ["greedy", "first_fit", "best_fit", "best_fit_decreasing", "fill"]


def epoch_segments(cfg, store, epoch=0):
    try:
        batches = epoch_batches(cfg, store, epoch)
    except DataError as err:
        assert "larger than one epoch" in str(err) or "dropped every document" in str(err)
        assume(False)  # a store this config cannot cut: not an example
    rows = [
        assert_contract({k: v[r : r + 1] for k, v in b.items()}, store)
        for b in batches
        for r in range(b["inputs"].shape[0])
    ]
    return batches, [[(s, m) for _, s, m in row] for row in rows]


def expected_counts(store, seq_len: int, overlong: str) -> np.ndarray:
    """Targets per stream position when each document predicts its tokens once, after the overlong policy."""
    counts = np.zeros(store.num_tokens, np.int64)
    for first, end in zip(store.doc_offsets[:-1], store.doc_offsets[1:]):
        if end - first > seq_len and overlong == "drop":
            continue
        counts[first : first + seq_len if overlong == "truncate" else end] = 1
    return counts


@pytest.mark.parametrize("packer", OURS)
@FAST
@given(
    store=stores(max_docs=15),
    seq_len=st.integers(2, 12),
    batch_size=st.integers(1, 3),
    overlong=st.sampled_from(["drop", "truncate", "split"]),
    data=st.data(),
    epoch=st.integers(0, 1),
)
def test_packers_place_every_document_once_within_capacity(packer, store, seq_len, batch_size, overlong, data, epoch):
    # fill with a segment cap is refused by config checks (tested in test_pipeline): drawn, not filtered, so the
    # health check never sees two inputs in three thrown away
    cap = data.draw(st.just(None) if packer == "fill" else st.sampled_from([None, 1, 2]), label="cap")
    overrides = [f"data.packer={packer}", f"data.overlong={overlong}", "data.pack_buffer=4"]
    if cap is not None:
        overrides.append(f"data.max_segments_per_row={cap}")
    batches, rows = epoch_segments(config("pack", seq_len, batch_size, *overrides), store, epoch)
    found = [(0, s, m) for row in rows for s, m in row]
    np.testing.assert_array_equal(predicted_counts(found, store.num_tokens), expected_counts(store, seq_len, overlong))
    for row in rows:
        assert sum(m - 1 for _, m in row) <= seq_len
        if cap is not None:
            assert len(row) <= cap
    if packer == "fill":  # every row full except the epoch's last real one
        used = sorted(sum(m - 1 for _, m in row) for row in rows if row)
        assert all(u == seq_len for u in used[1:])


def reference_fit(weights: list[int], capacity: int, open_rows: int, best: bool, decreasing: bool) -> list[list[int]]:
    """Online first/best fit with a bounded set of open rows, written the plain way: rows of item indices."""
    order = list(range(len(weights)))
    if decreasing:
        order = [
            i
            for w in range(0, len(order), open_rows)
            for i in sorted(order[w : w + open_rows], key=lambda i: -weights[i])
        ]
    rows: list[list[int]] = []
    slots: list[list[int]] = []  # [row, free]
    for i in order:
        if weights[i] == capacity:
            rows.append([i])
            continue
        fits = [s for s in slots if s[1] >= weights[i]]
        if fits:
            slot = min(fits, key=lambda s: s[1]) if best else fits[0]
        else:
            if len(slots) < open_rows:
                slots.append([0, 0])
                slot = slots[-1]
            else:
                slot = min(slots, key=lambda s: s[1])  # close the fullest open row
            rows.append([])
            slot[:] = [len(rows) - 1, capacity]
        rows[slot[0]].append(i)
        slot[1] -= weights[i]
    return rows


def reference_greedy(weights: list[int], capacity: int) -> list[list[int]]:
    rows, used = [[]], 0
    for i, w in enumerate(weights):
        if used + w > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += w
    return rows


@pytest.mark.parametrize("packer", ["greedy", "first_fit", "best_fit", "best_fit_decreasing"])
@FAST
@given(store=stores(max_docs=15), seq_len=st.integers(2, 12), buffer=st.integers(1, 6))
def test_packers_match_their_definitions(packer, store, seq_len, buffer):
    cfg = config(
        "pack",
        seq_len,
        1,
        f"data.packer={packer}",
        "data.shuffle=false",
        "data.overlong=split",
        f"data.pack_buffer={buffer}",
    )
    _, rows = epoch_segments(cfg, store)
    items = sorted(item for row in rows for item in row)  # with shuffle off, the documents' pieces in stream order
    index = {item: i for i, item in enumerate(items)}
    weights = [m - 1 for _, m in items]
    got = [[index[item] for item in row] for row in rows if row]
    if packer == "greedy":
        expect = reference_greedy(weights, seq_len)
    else:
        expect = reference_fit(
            weights, seq_len, buffer, best=packer != "first_fit", decreasing=packer == "best_fit_decreasing"
        )
    assert got == expect


@FAST
@given(store=stores(max_docs=25), seq_len=st.integers(2, 16), batch_size=st.integers(1, 3), mult=st.integers(1, 3))
def test_length_grouped_sorts_mega_batches_and_pads_to_buckets(store, seq_len, batch_size, mult):
    cfg = config("length_grouped", seq_len, batch_size, f"data.mega_batch_mult={mult}", "data.overlong=split")
    batches, rows = epoch_segments(cfg, store)
    buckets = bucket_lengths(cfg).tolist()
    found = [(0, s, m) for row in rows for s, m in row]
    np.testing.assert_array_equal(predicted_counts(found, store.num_tokens), expected_counts(store, seq_len, "split"))
    assert all(len(row) <= 1 for row in rows)  # one document (piece) per row
    longest = [max((m - 1 for row in rows[k * batch_size : (k + 1) * batch_size] for _, m in row), default=0)
               for k in range(len(batches))]
    for batch, top in zip(batches, longest):
        width = batch["inputs"].shape[1]
        assert width == min(b for b in buckets if b >= top)  # the smallest bucket that holds the batch
    assert longest[0] == max(longest)  # the longest batch first: an out-of-memory shows at step 0
    assert len({b["inputs"].shape[1] for b in batches}) <= len(buckets)


@FAST
@given(
    weights=st.lists(st.integers(1, 40), min_size=1, max_size=60), batch_size=st.integers(1, 4), mult=st.integers(1, 3)
)
def test_length_grouped_order_sorts_each_mega_batch(weights, batch_size, mult):
    weights = np.asarray(weights)
    buckets = np.asarray([4, 16, 40])
    rows, widths = length_grouped_order(weights, batch_size, mult, buckets)
    assert sorted(rows[rows >= 0].tolist()) == list(range(len(weights)))  # a permutation, each row once
    batches = rows.reshape(-1, batch_size)
    # undo "longest batch first": some position j restores mega-batches sorted longest first
    restored = [np.concatenate([*batches[1 : j + 1], batches[0], *batches[j + 1 :]]) for j in range(len(batches))]
    mega = batch_size * mult

    def sorted_mega_batches(order):
        real = order[order >= 0]
        return all(np.all(np.diff(weights[real[i : i + mega]]) <= 0) for i in range(0, len(real), mega))

    assert any(sorted_mega_batches(order) for order in restored)
    tops = [weights[b[b >= 0]].max() for b in batches]
    assert tops[0] == max(tops)
    np.testing.assert_array_equal(widths, [buckets[np.searchsorted(buckets, t)] for t in tops])


WHOLE_CASES = [("pack", [f"data.packer={p}"]) for p in PACKERS] + [
    ("length_grouped", []), ("block", ["data.break_mode=complete_doc"]), ("block", ["data.break_mode=none"])]


@pytest.mark.parametrize("strategy, overrides", WHOLE_CASES, ids=lambda c: str(c))
@FAST
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=12), seq_len=st.integers(12, 16))
def test_the_strategies_said_to_keep_documents_whole_never_cut_one(strategy, overrides, lengths, seq_len):
    """keeps_documents_whole (the strategies table) is what admits instruction data: a strategy it names puts each
    document, EOT to closing token, in one segment; one it does not name is seen cutting some document."""
    store = positional_store(lengths)
    cfg = config(strategy, seq_len, 2, *overrides, "data.pack_buffer=4")
    _, rows = epoch_segments(cfg, store)
    documents = {(int(a) - 1, int(b - a) + 1) for a, b in zip(store.doc_offsets[:-1], store.doc_offsets[1:])}
    cut = [segment for row in rows for segment in row if segment not in documents]
    d = cfg.data
    if strategies.keeps_documents_whole(d):
        assert cut == []


@pytest.mark.parametrize("strategy, overrides", [("pack", ["data.packer=fill"]), ("block", ["data.break_mode=none"])])
def test_the_strategies_not_said_to_keep_documents_whole_cut_them(strategy, overrides):
    store = positional_store([7, 7, 7, 7])
    cfg = config(strategy, 12, 2, *overrides)
    assert not strategies.keeps_documents_whole(cfg.data)
    _, rows = epoch_segments(cfg, store)
    documents = {(int(a) - 1, int(b - a) + 1) for a, b in zip(store.doc_offsets[:-1], store.doc_offsets[1:])}
    assert any(segment not in documents for row in rows for segment in row)


@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_packers_epoch_holds_each_document_exactly_once_on_a_set_smaller_than_its_buffer(packer, epoch):
    """15 documents, data.pack_buffer at its default (1024 bins): Grain's packers once drew the next epoch's
    documents into the bins still open at an epoch's end. The training pipeline's batches of an epoch are the
    ones the report counts, and they hold every document once (overlong ones split, as data.overlong=split says)."""
    lengths = [3, 9, 4, 1, 7, 12, 2, 5, 8, 6, 3, 11, 2, 4, 10]
    store = positional_store(lengths)
    cfg = config("pack", 12, 2, f"data.packer={packer}", "data.overlong=split")
    if strategies.uses_grain_packer(cfg.data):
        one = list(strategies.grain_packed(cfg, store, num_epochs=1))
        before = sum(1 for _ in strategies.grain_packed(cfg, store, num_epochs=epoch)) if epoch else 0
        per_epoch = list(strategies.grain_packed(cfg, store, num_epochs=epoch + 1))[before:]
        assert len(per_epoch) == len(one)
        trained = list(islice(iter(build_pipeline(cfg, store)), before, before + len(per_epoch)))
        for got, expect in zip(trained, per_epoch):
            for key in expect:
                np.testing.assert_array_equal(got[key], expect[key])
    else:
        per_epoch = epoch_batches(cfg, store, epoch)
    found = [seg for b in per_epoch for seg in assert_contract(b, store)]
    np.testing.assert_array_equal(predicted_counts(found, store.num_tokens), expected_counts(store, 12, "split"))


@pytest.mark.parametrize("strategy, overrides", [("pack", ["data.packer=best_fit"]), ("window", []),
                                                 ("length_grouped", [])])
def test_the_dump_names_each_slots_document_and_each_batchs_epoch(strategy, overrides):
    """``python -m seqjax.data --dump`` adds ``documents`` (the store index of the document each slot's target
    belongs to) and ``epochs``: on a store whose token at position p is p, the target itself says its document."""
    from seqjax.main.data import sources_of

    store = positional_store([3, 9, 4, 1, 7, 12, 2, 5])
    cfg = config(strategy, 8, 2, *overrides)
    n = 2 * EpochPlanner(cfg, store).plan(0).num_batches + 1  # into the third epoch
    batches = list(islice(iter(build_pipeline(cfg, store)), n))
    width = max(b["inputs"].shape[1] for b in batches)
    documents, epochs = sources_of(cfg, store, n, width)
    offsets = np.asarray(store.doc_offsets)
    for k, b in enumerate(batches):
        real = b["segment_ids"] > 0
        np.testing.assert_array_equal(documents[k][:, : b["inputs"].shape[1]][~real], -1)
        named = real & (b["targets"] != 0)  # (an EOT target closes the document before it: no position)
        want = np.searchsorted(offsets, b["targets"][named], "right") - 1
        np.testing.assert_array_equal(documents[k][:, : b["inputs"].shape[1]][named], want)
    assert epochs[0] == 0 and epochs[-1] == 2 and np.all(np.diff(epochs) >= 0)


def test_every_strategy_and_packer_name_the_config_takes_has_a_row_in_the_tables():
    from seqjax.config.data import STRATEGIES as STRATEGY_NAMES

    assert list(strategies.STRATEGIES) == list(STRATEGY_NAMES)
    assert list(strategies.PACKERS) == list(PACKERS)
