"""Helpers for the data-pipeline tests: synthetic stores whose tokens name their stream position; the contract check.

In these stores the token at stream position ``p`` is ``p`` itself (EOT is
0), so any segment of a batch can be mapped back to the exact stream slice it
came from and every claim (coverage, continuity, equality with a reference) is
checked against positions, not just values.
"""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.data import strategies
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from seqjax.store.reader import TokenStore

EOT = 0
VOCAB = 1 << 16


def positional_store(doc_lengths: list[int], line_lengths: list[list[int]] | None = None) -> TokenStore:
    """A store whose token at stream position p is p (documents of the given lengths, EOT = 0)."""
    docs, p = [], 1
    for n in doc_lengths:
        docs.append(np.arange(p, p + n))
        p += n + 1
    assert p < VOCAB
    return TokenStore.from_documents(docs, EOT, VOCAB, lines=line_lengths)


@st.composite
def stores(draw, max_docs: int = 12, max_len: int = 30, with_lines: bool = False) -> TokenStore:
    lengths = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_docs))
    lines = None
    if with_lines:
        lines = []
        for n in lengths:
            cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
            lines.append(list(np.diff([0, *cuts, n])))
    return positional_store(lengths, lines)


def config(strategy: str, seq_len: int, batch_size: int, *overrides: str, seed: int = 0):
    return load_config(
        None,
        [
            f"data.strategy={strategy}",
            f"data.seq_len={seq_len}",
            f"data.batch_size={batch_size}",
            f"run.seed={seed}",
            *overrides,
        ],
    )


def epoch_batches(cfg, store, epoch: int = 0, **shard) -> list[dict[str, np.ndarray]]:
    """The batches of one epoch, read through the public pipeline (epochs before it are skipped)."""
    pipeline = build_pipeline(cfg, store, **shard)  # validates first
    if strategies.uses_grain_packer(cfg.data):  # Grain's iterator: no row plan, so its epochs are counted
        skip = sum(1 for _ in strategies.grain_packed(cfg, store, num_epochs=epoch, **shard)) if epoch else 0
        n = sum(1 for _ in strategies.grain_packed(cfg, store, num_epochs=epoch + 1, **shard)) - skip
    else:
        planner = EpochPlanner(cfg, store)
        skip = sum(planner.plan(e).num_batches for e in range(epoch))
        n = planner.plan(epoch).num_batches
    return list(islice(iter(pipeline), skip, skip + n))


def assert_resumes_exactly(cfg, store, reference, steps, states=lambda state: [state], check=4) -> None:
    """Stopped after each of ``steps`` and resumed from its JSON state (or the states ``states`` derives from it),
    a fresh pipeline gives the next ``check`` batches of ``reference``, the uninterrupted run."""
    for step in steps:
        it = iter(build_pipeline(cfg, store))
        for _ in range(step):
            next(it)
        state = json.loads(json.dumps(it.get_state()))  # must survive a JSON checkpoint
        for given in states(state):
            resumed = iter(build_pipeline(cfg, store))
            resumed.set_state(given)
            for expect in reference[step : step + check]:
                got = next(resumed)
                for key in expect:
                    np.testing.assert_array_equal(got[key], expect[key], err_msg=f"{key} resuming at step {step}")


def segments(batch: dict[str, np.ndarray], store: TokenStore) -> list[tuple[int, int, int]]:
    """Every segment as ``(row, stream start, tokens)``: the stream slice it was read from, checked to exist."""
    out = []
    tokens = np.asarray(store.tokens)
    for r, row in enumerate(batch["segment_ids"]):
        for s in np.unique(row[row > 0]):
            (cols,) = np.nonzero(row == s)
            seq = np.append(batch["inputs"][r, cols], batch["targets"][r, cols[-1]])
            named = np.nonzero(seq != EOT)[0]
            if len(named):
                start = int(seq[named[0]]) - int(named[0])
            else:  # a segment of EOTs only: two adjacent EOTs, i.e. an empty document
                start = int(np.nonzero((tokens[:-1] == EOT) & (tokens[1:] == EOT))[0][0])
            assert np.array_equal(tokens[start : start + len(seq)], seq), "segment is not a slice of the stream"
            out.append((r, start, len(seq)))
    return out


def assert_contract(
    batch: dict[str, np.ndarray],
    store: TokenStore,
    *,
    width: int | None = None,
    cross_documents: bool = True,
    padding: bool = True,
) -> list[tuple[int, int, int]]:
    """docs/design.md, contract 1 on one batch; returns its segments."""
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    shape = batch["inputs"].shape
    if width is not None:
        assert shape[1] == width
    for key in ("inputs", "targets", "segment_ids", "positions"):
        assert batch[key].dtype == np.int32 and batch[key].shape == shape
    assert batch["weights"].dtype == np.float32
    seg, pos = batch["segment_ids"], batch["positions"]
    np.testing.assert_array_equal(batch["weights"], (seg > 0).astype(np.float32))
    for r in range(shape[0]):
        real = seg[r] > 0
        n = int(real.sum())
        assert real[:n].all(), "padding only at the end of a row"
        if not padding:
            assert n == shape[1] or n == 0, "this strategy promises full rows"
        ids = seg[r, :n]
        assert n == 0 or ids[0] == 1
        steps = np.diff(ids)
        assert np.all((steps == 0) | (steps == 1)), "segment ids contiguous and increasing from 1"
        starts = np.r_[True, steps == 1]
        expect = np.arange(n) - np.maximum.accumulate(np.where(starts, np.arange(n), 0))
        np.testing.assert_array_equal(pos[r, :n], expect)
        assert not pos[r, n:].any() and not batch["inputs"][r, n:].any() and not batch["targets"][r, n:].any()
        # inside a segment, each target is the next input: no target crosses a segment boundary
        same = ~starts[1:]
        np.testing.assert_array_equal(batch["inputs"][r, 1:n][same], batch["targets"][r, : n - 1][same])
    found = segments(batch, store)
    if not cross_documents:
        tokens = np.asarray(store.tokens)
        for _, start, m in found:
            assert not np.any(tokens[start + 1 : start + m - 1] == EOT), "a segment crosses a document boundary"
    return found


def predicted_counts(found: list[tuple[int, int, int]], n_tokens: int) -> np.ndarray:
    """How often each stream position is a target, from segments ``(row, start, tokens)``."""
    counts = np.zeros(n_tokens, np.int64)
    for _, start, m in found:
        counts[start + 1 : start + m] += 1
    return counts
