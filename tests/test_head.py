"""The LM head's custom backward: float32 logits forward, backward products in the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.model.head import head_logits


def _inputs(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 16)), dtype)
    head = jnp.asarray(rng.standard_normal((16, 40)) * 0.1, dtype)
    g = jnp.asarray(rng.standard_normal((2, 5, 40)), jnp.float32)
    return x, head, g


def plain(x, head):
    return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)


def test_float32_gradients_equal_plain_autodiff():
    x, head, g = _inputs(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ours = jax.vjp(head_logits, x, head)
        ref = jax.vjp(plain, x, head)
        np.testing.assert_array_equal(ours[0], ref[0])
        for a, b in zip(ours[1](g), ref[1](g)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_forward_is_float32_and_backward_products_are_bf16():
    x, head, g = _inputs(jnp.bfloat16)
    logits, vjp = jax.vjp(head_logits, x, head)
    assert logits.dtype == jnp.float32
    dx, dhead = vjp(g)
    assert dx.dtype == jnp.bfloat16 and dhead.dtype == jnp.bfloat16
    _, ref_vjp = jax.vjp(plain, x, head)
    for a, b in zip((dx, dhead), ref_vjp(g)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=3e-2, atol=3e-2)
    # Every matmul of the backward takes bf16 operands: none of them is a float32 x float32 product.
    jaxpr = jax.make_jaxpr(lambda x, h, g: jax.vjp(head_logits, x, h)[1](g))(x, head, g)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    # Plain autodiff would multiply the float32 cotangent into the head: what the custom rule avoids.
    plain_jaxpr = jax.make_jaxpr(lambda x, h, g: jax.vjp(plain, x, h)[1](g))(x, head, g)
    plain_dots = [e for e in plain_jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert any(v.aval.dtype == jnp.float32 for e in plain_dots for v in e.invars)
