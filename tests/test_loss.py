"""lm_loss: contract 3 (weighted CE in float32), its sums, z-loss, empty batches and bad targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.model.loss import lm_loss


def numpy_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_weighted_mean_of_per_token_nll(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (2, 6, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 6)).astype(np.int32)
    weights = (rng.choice([0.0, 0.5, 1.0], (2, 6)) * rng.integers(0, 2)).astype(np.float32)  # sometimes all zero
    loss, aux = jax.jit(lm_loss)(logits, targets, weights)
    nll = numpy_nll(logits, targets)
    expected_sum = (weights * nll).sum()
    np.testing.assert_allclose(float(aux["nll_sum"]), expected_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux["weight_sum"]), weights.sum())
    expected = expected_sum / weights.sum() if weights.sum() else 0.0
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-5)
    assert loss.dtype == aux["nll_sum"].dtype == jnp.float32


def test_bfloat16_logits_are_scored_in_float32():
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 4, (2, 3, 50)), jnp.bfloat16)
    targets = jnp.zeros((2, 3), jnp.int32)
    loss, _ = lm_loss(logits, targets, jnp.ones((2, 3)))
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(
        float(loss), numpy_nll(np.asarray(logits.astype(jnp.float32)), np.zeros((2, 3), int)).mean(), rtol=1e-6
    )


def test_zero_weights_give_zero_loss_and_finite_zero_gradients():
    logits = jnp.ones((1, 4, 5))
    value_and_grad = jax.value_and_grad(lambda x: lm_loss(x, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4)))[0])
    loss, grad = value_and_grad(logits)
    assert float(loss) == 0.0
    assert (np.asarray(grad) == 0).all()


def test_z_loss_adds_the_weighted_mean_of_log_z_squared():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (2, 5, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, (2, 5)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (2, 5)), jnp.float32)
    plain, _ = lm_loss(logits, targets, weights)
    with_z, aux = lm_loss(logits, targets, weights, z_loss=1e-2)
    log_z = jax.nn.logsumexp(logits, -1)
    expected_z = float(jnp.sum(weights * log_z**2))
    np.testing.assert_allclose(float(aux["z_loss_sum"]), expected_z, rtol=1e-5)
    np.testing.assert_allclose(float(with_z) - float(plain), 1e-2 * expected_z / float(weights.sum()), rtol=1e-4)


def test_unweighted_targets_are_never_read_and_weighted_bad_targets_are_nan():
    logits = jnp.zeros((1, 3, 4))
    loss, _ = lm_loss(logits, jnp.asarray([[1, -1, 99]]), jnp.asarray([[1.0, 0.0, 0.0]]))
    np.testing.assert_allclose(float(loss), np.log(4), rtol=1e-6)
    loss, _ = lm_loss(logits, jnp.asarray([[1, 4, 0]]), jnp.ones((1, 3)))
    assert np.isnan(float(loss))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"expected \[B, T, V\], \[B, T\], \[B, T\]"):
        lm_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4)))
