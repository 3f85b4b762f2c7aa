"""The LM head: features [B, T, D] -> float32 logits [B, T, V], with a backward pass in the compute
dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """x [B, T, D] @ head [D, V] -> float32 logits [B, T, V], accumulated in float32 whatever x's
    dtype.

    The logits stay float32 for the softmax, but their cotangent is cast back to
    x's dtype before the two backward products, so in bf16 those run as bf16
    matmuls with float32 accumulation, like every other layer's. Plain autodiff
    would hand them the float32 cotangent. On an H100 the 50,304-wide head of
    gpt2_small then ran its backward as TF32 GEMMs, 16.3 of 79 ms per step
    (BENCHMARKS.md, "Where a step goes"). In float32 nothing changes.
    """
    return jnp.einsum("btd,dv->btv", x, head, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, head):
    return head_logits(x, head), (x, head)


def _head_logits_bwd(residuals, g):
    x, head = residuals
    g = g.astype(x.dtype)
    dx = jnp.einsum("btv,dv->btd", g, head, preferred_element_type=jnp.float32).astype(x.dtype)
    dhead = jnp.einsum("btd,btv->dv", x, g, preferred_element_type=jnp.float32).astype(head.dtype)
    return dx, dhead


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)
