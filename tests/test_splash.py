"""The TPU splash wrapper against contract 2's reference, in splash's interpret mode (runs on a CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from seqjax.model.attention import reference_attention
from seqjax.model.kernels.splash import splash_attention
from test_flash import check_against_reference, output_and_grads, random_qkv

SPLASH = output_and_grads(lambda q, k, v, s: splash_attention(q, k, v, s, interpret=True))


def test_matches_reference_with_packing_padding_and_gqa():
    """T=40 (padded to one 128 tile inside), 4 query heads on 2 kv heads, padding rows zero with zero grads."""
    rows = np.zeros((2, 40), np.int32)
    rows[0, :35] = np.repeat([1, 2, 3], [10, 1, 24])  # ragged docs, a single-token doc, a padding tail
    rows[1, :] = 1  # one document filling the row
    q, k, v, cotangent = random_qkv((2, 40, 4, 32), kv_heads=2, dtype=jnp.float32)
    check_against_reference(SPLASH, q, k, v, jnp.asarray(rows), cotangent, tol=2e-5)


@pytest.mark.parametrize("window", [1, 7, 30])
def test_sliding_windows_match_the_dense_mask(window):
    """A window as splash's LocalMask: output and gradients equal the XLA path on segment_mask(window=...)."""
    rows = np.zeros((1, 40), np.int32)
    rows[0, :38] = np.repeat([1, 2], [12, 26])
    q, k, v, cotangent = random_qkv((1, 40, 2, 32), kv_heads=1, dtype=jnp.float32)
    splash = output_and_grads(lambda q, k, v, s: splash_attention(q, k, v, s, interpret=True, window=window))
    reference = output_and_grads(lambda q, k, v, s: reference_attention(q, k, v, s, window=window))
    out, grads = splash(q, k, v, jnp.asarray(rows), cotangent)
    ref_out, ref_grads = reference(q, k, v, jnp.asarray(rows), cotangent)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5, err_msg=name)
    with pytest.raises(ValueError, match="window must be a Python int"):
        splash_attention(q, k, v, jnp.asarray(rows), window=jnp.int32(window))


def test_block_size_must_fit_tpu_lanes():
    q = jnp.zeros((1, 8, 1, 32))
    with pytest.raises(ValueError, match="multiples of 128"):
        splash_attention(q, q, q, jnp.ones((1, 8), jnp.int32), block_size=64)
