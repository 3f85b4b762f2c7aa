"""Evaluation windows: every predicted token scored once, in every mode, with the context each protocol promises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.eval.windows import MODES, eval_windows
from seqjax.store.reader import TokenStore

EOT = 0


def make_store(doc_lengths: list[int], seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    return TokenStore.from_documents([rng.integers(1, 50, n) for n in doc_lengths], eot_id=EOT, vocab_size=50)


def all_rows(windows) -> dict[str, np.ndarray]:
    return windows.rows(np.arange(len(windows)))


def target_positions(windows) -> np.ndarray:
    """Stream index of every target cell, [windows, context]."""
    return windows.starts[:, None] + 1 + np.arange(windows.context)[None, :]


def doc_of(store: TokenStore, position: np.ndarray) -> np.ndarray:
    return np.searchsorted(store.doc_offsets, position, side="right") - 1


layouts = st.tuples(
    st.lists(st.integers(0, 12), min_size=1, max_size=6),  # document text lengths (0: an empty article)
    st.integers(1, 10),  # context
    st.data(),
)


@settings(max_examples=60, deadline=None)
@given(layouts, st.sampled_from(MODES), st.booleans())
def test_every_predicted_token_is_scored_exactly_once(layout, mode, cross):
    doc_lengths, context, data = layout
    stride = data.draw(st.integers(1, context))
    store = make_store(doc_lengths)
    windows = eval_windows(store, mode, context, stride, cross_document_attention=cross)
    rows = all_rows(windows)
    position = target_positions(windows)
    scored = rows["weights"] == 1

    counts = np.bincount(position[scored], minlength=len(store.tokens))
    assert counts[0] == 0  # the stream's opening EOT is context only
    np.testing.assert_array_equal(counts[1:], 1)
    assert windows.scored_tokens == store.predicted_tokens == int(rows["weights"].sum())

    # Every scored cell reads the true next token, and the token before it as input.
    np.testing.assert_array_equal(rows["targets"][scored], store.tokens[position[scored]])
    np.testing.assert_array_equal(rows["inputs"][scored], store.tokens[position[scored] - 1])
    assert set(np.unique(rows["weights"])) <= {0.0, 1.0}


@settings(max_examples=40, deadline=None)
@given(layouts, st.sampled_from(MODES))
def test_segments_isolate_articles_and_positions_restart(layout, mode):
    doc_lengths, context, data = layout
    store = make_store(doc_lengths)
    windows = eval_windows(store, mode, context, data.draw(st.integers(1, context)))
    rows = all_rows(windows)
    position = target_positions(windows)
    real = rows["segment_ids"] > 0
    doc = np.where(real, doc_of(store, position), -1)
    columns = np.arange(context)
    for r in range(len(windows)):
        seg, pos = rows["segment_ids"][r], rows["positions"][r]
        # Padding only at the end of a row; segment ids count 1, 2, ... in order.
        n_real = int(real[r].sum())
        assert real[r, :n_real].all() and not real[r, n_real:].any()
        assert seg[0] == 1 and np.all(np.diff(seg[:n_real]) >= 0) and np.all(np.diff(seg[:n_real]) <= 1)
        for s in np.unique(seg[:n_real]):
            cells = seg == s
            assert len(np.unique(doc[r][cells])) == 1  # one article per segment
            np.testing.assert_array_equal(pos[cells], columns[cells] - columns[cells][0])
        assert len(np.unique(doc[r][real[r]])) == len(np.unique(seg[:n_real]))  # a new article opens a new segment


@settings(max_examples=40, deadline=None)
@given(layouts)
def test_sliding_scores_with_at_least_context_minus_stride_tokens(layout):
    doc_lengths, context, data = layout
    stride = data.draw(st.integers(1, context))
    store = make_store(doc_lengths)
    windows = eval_windows(store, "sliding", context, stride, cross_document_attention=True)
    weights = all_rows(windows)["weights"]
    later = weights[1:] == 1
    columns = np.broadcast_to(np.arange(context), later.shape)
    # Column c is predicted from c + 1 inputs; after the first window only the last `stride` columns are scored.
    assert np.all(columns[later] + 1 >= context - stride + 1)


@settings(max_examples=30, deadline=None)
@given(layouts, st.booleans())
def test_sliding_with_stride_equal_to_context_is_blocks(layout, cross):
    doc_lengths, context, _ = layout
    store = make_store(doc_lengths)
    blocks = all_rows(eval_windows(store, "blocks", context, cross_document_attention=cross))
    sliding = all_rows(eval_windows(store, "sliding", context, context, cross_document_attention=cross))
    assert blocks.keys() == sliding.keys()
    for key in blocks:
        np.testing.assert_array_equal(blocks[key], sliding[key])


@settings(max_examples=30, deadline=None)
@given(layouts)
def test_documents_windows_stay_in_one_article_and_are_full_when_it_is_long_enough(layout):
    doc_lengths, context, _ = layout
    store = make_store(doc_lengths)
    windows = eval_windows(store, "documents", context)
    rows = all_rows(windows)
    assert rows["segment_ids"].max() == 1
    doc = doc_of(store, target_positions(windows)[:, 0])
    predicted = store.doc_lengths[doc]  # text tokens + closing EOT
    full = predicted >= context
    assert np.all(rows["segment_ids"][full] == 1)  # the last window moved back: a full window of context
    # The article's opening EOT is the first input of its first window.
    first = np.r_[True, doc[1:] != doc[:-1]]
    np.testing.assert_array_equal(windows.starts[first], store.doc_offsets[:-1] - 1)


def test_batches_have_a_fixed_shape_and_pad_with_empty_rows():
    store = make_store([5, 9, 3])
    windows = eval_windows(store, "sliding", 4, 3)
    batches = list(windows.batches(3))
    assert len(batches) == windows.num_batches(3) == -(-len(windows) // 3)
    for batch in batches:
        assert {k: v.shape for k, v in batch.items()} == {k: (3, 4) for k in batch}
        assert batch["inputs"].dtype == np.int32 and batch["weights"].dtype == np.float32
    padding = len(batches) * 3 - len(windows)
    assert padding > 0
    last = batches[-1]
    assert not last["weights"][-padding:].any() and not last["segment_ids"][-padding:].any()
    assert sum(b["weights"].sum() for b in batches) == store.predicted_tokens


def test_bad_settings_are_refused_with_the_key():
    store = make_store([3])
    with pytest.raises(ValueError, match="eval.mode"):
        eval_windows(store, "chunks", 4)
    with pytest.raises(ValueError, match="eval.stride"):
        eval_windows(store, "sliding", 4, 5)
