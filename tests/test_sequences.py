"""What each stream-cutting strategy promises about which tokens appear, where, and how often."""

from __future__ import annotations

from itertools import chain, islice

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from seqjax.core.errors import DataError
from seqjax.data.pipeline import build_pipeline
from test_pipeline_helpers import (
    EOT,
    assert_contract,
    config,
    epoch_batches,
    positional_store,
    predicted_counts,
    stores,
)

FAST = settings(max_examples=25, deadline=None)


def cuttable_epoch(cfg, store, epoch=0):
    """The epoch's batches; a store too small for this config is no example of the property (assume)."""
    try:
        return epoch_batches(cfg, store, epoch)
    except DataError:
        assume(False)


def all_segments(batches, store, **kw):
    return [(k, r, start, m) for k, b in enumerate(batches) for (r, start, m) in assert_contract(b, store, **kw)]


@FAST
@given(store=stores(), seq_len=st.integers(2, 9), batch_size=st.integers(1, 3), seed=st.integers(0, 5),
       cross=st.booleans(), epoch=st.integers(0, 2))
def test_random_offset_predicts_every_token_after_the_offset_exactly_once(
    store, seq_len, batch_size, seed, cross, epoch
):
    cfg = config("random_offset", seq_len, batch_size, f"data.cross_document_attention={str(cross).lower()}", seed=seed)
    batches = cuttable_epoch(cfg, store, epoch)
    counts = predicted_counts([(r, s, m) for _, r, s, m in all_segments(batches, store)], store.num_tokens)
    offset = int(np.argmax(counts > 0)) - 1
    assert 0 <= offset < seq_len
    assert not counts[: offset + 1].any()
    assert np.all(counts[offset + 1 :] == 1)


@FAST
@given(store=stores(), seq_len=st.integers(2, 9), stride=st.integers(1, 10))
def test_window_reads_every_full_window_at_the_stride(store, seq_len, stride):
    cfg = config(
        "window", seq_len, 1, f"data.stride={stride}", "data.cross_document_attention=true", "data.shuffle=false"
    )
    batches = cuttable_epoch(cfg, store)
    found = [(s, m) for _, _, s, m in all_segments(batches, store, padding=False)]
    expect = [(s, seq_len + 1) for s in range(0, store.num_tokens - seq_len, stride)]
    assert found == expect


@FAST
@given(store=stores(max_docs=20), seq_len=st.integers(2, 6), batch_size=st.integers(1, 3), seed=st.integers(0, 3))
def test_sequential_rows_continue_across_batches(store, seq_len, batch_size, seed):
    cfg = config("sequential", seq_len, batch_size, "data.cross_document_attention=true", seed=seed)
    batches = cuttable_epoch(cfg, store)
    starts = np.array([[s for _, r, s, _ in all_segments([b], store, padding=False)] for b in batches])
    assert starts.shape == (len(batches), batch_size)  # one full segment per row
    np.testing.assert_array_equal(
        np.diff(starts, axis=0), seq_len
    )  # row b of batch k+1 starts where row b of batch k ended
    if batch_size > 1:
        stream = np.diff(starts[0])
        assert np.all(stream == stream[0]) and stream[0] >= len(batches) * seq_len  # equal, disjoint streams
    assert 0 <= starts[0, 0] < seq_len  # the random offset


def test_random_window_is_a_function_of_seed_and_step():
    store = positional_store([30, 12, 40, 7])
    cfg = config("random_window", 8, 3, "data.cross_document_attention=true", seed=4)
    first = list(islice(iter(build_pipeline(cfg, store)), 12))
    starts = np.array([[s for _, _, s, _ in all_segments([b], store, padding=False)] for b in first])
    assert starts.min() >= 0 and starts.max() <= store.num_tokens - 9
    assert len(np.unique(starts)) > 12  # sampled, not a fixed cycle
    rng = np.random.default_rng([4, 7])  # the CS336 loader's draw for step 7
    np.testing.assert_array_equal(starts[7], rng.integers(0, store.num_tokens - 8, size=3))
    other = list(islice(iter(build_pipeline(config("random_window", 8, 3, seed=5), store)), 1))
    assert not np.array_equal(other[0]["inputs"], first[0]["inputs"])


def group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """HF run_clm's group_texts, written the plain way."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
    result["labels"] = [list(x) for x in result["input_ids"]]
    return result


def hf_rows(store, block_size: int) -> list[list[int]]:
    """group_texts applied the way datasets.map(batched=True) applies it: 1000 examples per call."""
    tokens = np.asarray(store.tokens).tolist()
    cuts = (np.asarray(store.doc_offsets[:-1]) - 1).tolist() + [len(tokens)]
    examples = [tokens[a:b] for a, b in zip(cuts[:-1], cuts[1:])]  # the stream cut before each document's opening EOT
    rows = []
    for i in range(0, len(examples), 1000):
        rows += group_texts({"input_ids": examples[i : i + 1000]}, block_size)["input_ids"]
    return rows


def concat_rows(store, seq_len: int, cross: bool) -> list[list[int]]:
    cfg = config(
        "concat_chunk", seq_len, 1, "data.shuffle=false", f"data.cross_document_attention={str(cross).lower()}"
    )
    batches = epoch_batches(cfg, store)
    for b in batches:
        assert_contract(b, store, padding=False, cross_documents=cross)
        # a new segment (positions restart) at each document's opening EOT, or never with cross-document attention
        restarts = b["positions"][0] == 0
        expect = np.arange(seq_len) == 0 if cross else (np.arange(seq_len) == 0) | (b["inputs"][0] == EOT)
        np.testing.assert_array_equal(restarts, expect)
    return [b["inputs"][0].tolist() + [int(b["targets"][0, -1])] for b in batches]


@FAST
@given(store=stores(max_docs=15), seq_len=st.integers(2, 12), cross=st.booleans())
def test_concat_chunk_equals_group_texts_row_for_row(store, seq_len, cross):
    try:
        assert concat_rows(store, seq_len, cross) == hf_rows(store, seq_len + 1)
    except DataError:
        assert not hf_rows(store, seq_len + 1)


def test_concat_chunk_drops_each_map_batch_remainder_like_datasets_map():
    rng = np.random.default_rng(0)
    store = positional_store(rng.integers(1, 12, size=2500).tolist())  # three map batches of documents
    rows = concat_rows(store, 15, cross=True)
    assert rows == hf_rows(store, 16)
    whole_stream = (store.num_tokens // 16)
    assert len(rows) < whole_stream  # remainders were dropped per batch, not once


def reference_blocks(store, seq_len: int, mode: str) -> list[tuple[int, int]]:
    """fairseq TokenBlockDataset, read off its definition: blocks as (first, last + 1) of the tokens they predict."""
    n = store.num_tokens
    if mode == "none":
        return [(a, min(a + seq_len, n)) for a in range(1, n, seq_len)]
    units = []  # lines, long lines cut into seq_len pieces, with their document
    for a, b in zip(store.line_offsets[:-1].tolist(), store.line_offsets[1:].tolist()):
        doc = int(np.searchsorted(store.doc_offsets, a, "right")) - 1
        units += [(x, min(x + seq_len, b), doc) for x in range(a, b, seq_len)]
    blocks, current = [], None
    for a, b, doc in units:
        fits = current is not None and b - current[0] <= seq_len and (mode == "complete" or doc == current[2])
        if mode != "eos" and fits:
            current = (current[0], b, doc)
        else:
            if current is not None:
                blocks.append(current[:2])
            current = (a, b, doc)
    return blocks + [current[:2]]


@FAST
@given(
    store=stores(with_lines=True),
    seq_len=st.integers(2, 12),
    mode=st.sampled_from(["none", "complete", "complete_doc", "eos"]),
)
def test_block_modes_equal_their_definitions(store, seq_len, mode):
    cfg = config(
        "block", seq_len, 1, f"data.break_mode={mode}", "data.shuffle=false", "data.cross_document_attention=true"
    )
    batches = epoch_batches(cfg, store)
    found = [(s + 1, s + m) for _, _, s, m in all_segments(batches, store)]
    assert found == reference_blocks(store, seq_len, mode)


# Reference implementations: each strategy's whole epoch of spans in the plainest form (the planner computes the
# same rows a window at a time, in seqjax.data.strategies; the test below holds the two equal).

def reference_window_spans(n_tokens, seq_len, stride):
    starts = list(range(0, n_tokens - seq_len, stride))
    return starts, [seq_len + 1] * len(starts)


def reference_sequential_spans(n_tokens, seq_len, batch_size, offset):
    stream = (n_tokens - offset - 1) // batch_size
    starts = [offset + b * stream + k * seq_len for k in range(stream // seq_len) for b in range(batch_size)]
    return starts, [seq_len + 1] * len(starts)


def reference_concat_chunk_spans(doc_offsets, n_tokens, block, group_docs):
    examples = [int(o) - 1 for o in doc_offsets[:-1]]
    starts = []
    for g in range(0, len(examples), group_docs):
        begin = examples[g]
        end = examples[g + group_docs] if g + group_docs < len(examples) else n_tokens
        starts += [begin + j * block for j in range((end - begin) // block)]
    return starts, [block] * len(starts)


@FAST
@given(store=stores(max_docs=30), seq_len=st.integers(2, 9), batch_size=st.integers(1, 3), stride=st.integers(1, 7),
       seed=st.integers(0, 3), cut=st.lists(st.floats(0, 1), min_size=2, max_size=2),
       strategy=st.sampled_from(["window", "sequential", "concat_chunk"]))
def test_windowed_rows_of_each_stream_strategy_equal_its_whole_epoch_reference(store, seq_len, batch_size, stride,
                                                                               seed, cut, strategy):
    from seqjax.data import sequences
    from seqjax.data.strategies import STRATEGIES

    cfg = config(strategy, seq_len, batch_size, f"data.stride={stride}", seed=seed)
    assume(store.num_tokens > seq_len + batch_size * (seq_len + 1))
    rows = STRATEGIES[strategy].rows(store, cfg.data, seed, 0, np.random.default_rng(seed))
    if strategy == "window":
        expect = reference_window_spans(store.num_tokens, seq_len, stride)
    elif strategy == "sequential":
        offset = int(np.random.default_rng(seed).integers(seq_len))  # the strategy's first draw
        expect = reference_sequential_spans(store.num_tokens, seq_len, batch_size, offset)
    else:
        expect = reference_concat_chunk_spans(store.doc_offsets, store.num_tokens, seq_len + 1, sequences.HF_MAP_BATCH)
    assert rows.count == len(expect[0])
    lo, hi = sorted(int(c * rows.count) for c in cut)  # any window of rows, as the planner asks for them
    starts, lengths = rows.spans(lo, hi)
    assert starts.tolist() == expect[0][lo:hi] and lengths.tolist() == expect[1][lo:hi]
