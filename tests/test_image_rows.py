"""The two-budget packer: every example placed once, no row over its tokens, no batch over its patches, and no
more batches than needed when one budget alone binds."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import assume, given, settings

from seqjax.data.image_rows import pack_two_budgets

examples = st.lists(st.tuples(st.integers(1, 64), st.sampled_from([0, 0, 4, 8, 16, 36])), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(examples, st.integers(1, 4), st.integers(64, 128), st.integers(36, 96), st.integers(1, 6))
def test_both_budgets_hold_and_every_example_lands_once(items, rows, seq_len, patch_budget, open_batches):
    tokens, patches = np.array(items).T
    batch, row = pack_two_budgets(tokens, patches, rows, seq_len, patch_budget, open_batches)
    assert len(batch) == len(items) and (0 <= row).all() and (row < rows).all()
    assert sorted(set(batch.tolist())) == list(range(batch.max() + 1))  # numbered 0.. without gaps
    used_tokens = np.zeros((batch.max() + 1, rows), np.int64)
    np.add.at(used_tokens, (batch, row), tokens)
    used_patches = np.bincount(batch, weights=patches)
    assert used_tokens.max() <= seq_len and used_patches.max() <= patch_budget


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=60), st.integers(1, 4))
def test_when_patches_bind_no_two_batches_could_have_been_one(groups, rows):
    """Short texts, many patches: a batch opens only when its first example fits no open batch, so any two
    batches hold more patches together than one may (hence at most twice the fewest possible)."""
    patches = np.array(groups) * 4
    assume(patches.sum() > 32)
    batch, _ = pack_two_budgets(np.ones_like(patches), patches, rows, 1000, 32)
    used = np.bincount(batch, weights=patches)
    assert len(used) >= -(-patches.sum() // 32)
    assert all(used[a] + used[b] > 32 for a in range(len(used)) for b in range(a + 1, len(used)))


def test_an_example_over_either_budget_is_one_line_naming_it():
    with pytest.raises(ValueError, match="example 1: 10 tokens and 0 patches, more than a row's 8 tokens"):
        pack_two_budgets(np.array([3, 10]), np.array([0, 0]), 2, 8, 16)
    with pytest.raises(ValueError, match="example 0: 3 tokens and 20 patches, .* a batch's 16 patches"):
        pack_two_budgets(np.array([3]), np.array([20]), 2, 8, 16)
