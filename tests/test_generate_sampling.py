"""Sampling: greedy at temperature 0, top_p -> 0 and top_k = 1 are greedy, the filters keep what they promise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.model.sampling import SamplingConfig, filter_logits, sample

VOCAB = 37
BATCH = 64  # one shape everywhere: each jitted function compiles once for the whole file
jit_sample = jax.jit(sample)
jit_filter = jax.jit(filter_logits)


def random_logits(seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (BATCH, VOCAB)) * 3.0


def draw(logits, seed, **settings):
    s = SamplingConfig(**settings).arrays()
    return np.asarray(jit_sample(logits, jax.random.key(seed), s["temperature"], s["top_k"], s["top_p"]))


@pytest.mark.parametrize(
    "settings_", [dict(temperature=0.0), dict(temperature=1.0, top_p=1e-6), dict(temperature=2.0, top_k=1)]
)
def test_greedy_limits_equal_argmax(settings_):
    for seed in range(5):
        logits = random_logits(seed)
        np.testing.assert_array_equal(draw(logits, seed, **settings_), np.argmax(logits, axis=-1))


def test_unfiltered_sampling_is_not_greedy_and_is_seeded():
    logits = random_logits(0) / 6.0  # flat enough that greedy would be a coincidence
    a, b, c = draw(logits, 1), draw(logits, 1), draw(logits, 2)
    np.testing.assert_array_equal(a, b)
    assert (a != np.argmax(logits, -1)).any() and (a != c).any()


def test_top_k_samples_only_from_the_k_most_likely():
    logits = jnp.tile(random_logits(3)[:1] / 10.0, (BATCH, 1))
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    drawn = set()
    for seed in range(4):
        drawn |= set(draw(logits, seed, temperature=1.0, top_k=3).tolist())
    assert drawn == top3


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.01, 0.99), st.integers(0, VOCAB))
def test_filter_keeps_the_smallest_nucleus_within_the_top_k(seed, top_p, top_k):
    logits = random_logits(seed)
    kept = np.isfinite(np.asarray(jit_filter(logits, jnp.int32(top_k), jnp.float32(top_p))))[0]
    order = np.argsort(-np.asarray(logits[0]))
    probs = np.asarray(jax.nn.softmax(logits[0]))[order]
    n = int(kept.sum())
    assert kept[order[:n]].all()  # the kept tokens are the n most likely
    k = top_k or VOCAB
    mass = np.cumsum(probs.astype(np.float64))
    # The smallest prefix with mass >= top_p, up to float32 rounding of the running sum at the boundary.
    smallest = [min(k, int(np.searchsorted(mass, top_p + eps)) + 1) for eps in (-1e-5, 1e-5)]
    assert smallest[0] <= n <= smallest[1]


def test_changing_settings_does_not_recompile():
    logits = random_logits(0)[:5]  # a shape no other test uses: exactly one new compilation
    before = jit_sample._cache_size()
    for i, s in enumerate([SamplingConfig(0.0), SamplingConfig(0.7, 5, 0.9), SamplingConfig(1.3, 0, 0.5)]):
        draw(logits, i, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    assert jit_sample._cache_size() == before + 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="--top-p"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="--top-k"):
        SamplingConfig(top_k=-2)
