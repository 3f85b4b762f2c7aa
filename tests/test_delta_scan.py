"""The Pallas scan over the gated delta rule's chunks (seqjax/model/kernels/delta_scan.py), in Pallas's
interpreter on the CPU: its outputs, the states it keeps and every input's gradient are the XLA scan's; through
the chunked rule it gives the XLA form's outputs and gradients on packed rows; and it lowers through Triton for an
H100 without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.model.delta_rule import chunked_rule
from seqjax.model.kernels.delta_scan import delta_scan


def xla_scan(values, k_read, q_read, inner, k_write, keep, s0):
    """The same recurrence as one lax.scan over chunks (the definition the kernel is held to)."""
    b, h, t, _ = values.shape
    chunk = inner.shape[-1]
    n = t // chunk

    def split(a):  # [B, H, N * C, X] -> [N, B, H, C, X]
        return jnp.moveaxis(a.reshape(b, h, n, chunk, a.shape[-1]), 2, 0)

    def step(s, xs):
        values_i, k_read_i, q_read_i, inner_i, k_write_i, keep_i = xs
        new = values_i - k_read_i @ s
        out = q_read_i @ s + inner_i @ new
        return s * keep_i[..., None, None] + jnp.swapaxes(k_write_i, -1, -2) @ new, (out, s, new)

    with jax.default_matmul_precision("highest"):
        final, (out, states, new) = jax.lax.scan(step, s0, (*map(split, (values, k_read, q_read, inner, k_write)),
                                                            jnp.moveaxis(keep, 2, 0)))

    def join(a):  # [N, B, H, R, X] -> [B, H, N * R, X]
        return jnp.moveaxis(a, 0, 2).reshape(b, h, -1, a.shape[-1])

    return join(out), join(states), join(new), final


def terms(seed: int, b: int, h: int, n: int, chunk: int, dk: int, dv: int):
    keys = jax.random.split(jax.random.key(seed), 8)
    t = n * chunk
    def normal(key, *shape):
        return jax.random.normal(key, shape, jnp.float32) * 0.5

    return (normal(keys[0], b, h, t, dv), normal(keys[1], b, h, t, dk), normal(keys[2], b, h, t, dk),
            jnp.tril(normal(keys[3], b, h, t, chunk)), normal(keys[4], b, h, t, dk),
            jax.random.uniform(keys[5], (b, h, n), jnp.float32), normal(keys[6], b, h, dk, dv))


def weighted(fn, cotangent_seed: int):
    """A scalar of all four outputs, each weighted at random: every output's cotangent reaches every input."""
    def loss(*args):
        outs = fn(*args)
        keys = jax.random.split(jax.random.key(cotangent_seed), len(outs))
        return sum(jnp.sum(o * jax.random.normal(k, o.shape)) for o, k in zip(outs, keys))
    return loss


@pytest.mark.slow  # (the full suite: the fast loop runs the kernel through the chunked rule and a model)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4), chunk=st.sampled_from([4, 8]), dk=st.sampled_from([4, 8]),
       blocks=st.sampled_from([(8, 8), (8, 4), (4, 2)]))
def test_the_kernel_is_the_xla_scan_in_outputs_states_and_gradients(seed, n, chunk, dk, blocks):
    dv, block_v = blocks
    args = terms(seed, 2, 2, n, chunk, dk, dv)
    kernel = jax.jit(lambda *a: delta_scan(*a, block_v=block_v, interpret=True))
    for ours, theirs in zip(kernel(*args), jax.jit(xla_scan)(*args)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    argnums = tuple(range(7))
    ours = jax.jit(jax.grad(weighted(lambda *a: delta_scan(*a, block_v=block_v, interpret=True), seed), argnums))(
        *args)
    theirs = jax.jit(jax.grad(weighted(xla_scan, seed), argnums))(*args)
    for name, a, b in zip(("values", "k_read", "q_read", "inner", "k_write", "keep", "s0"), ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def packed_row(seed: int, t: int = 40, hk: int = 2, h: int = 4, dk: int = 8, dv: int = 8):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (1, t, hk, dk))
    k = jax.random.normal(keys[1], (1, t, hk, dk))
    v = jax.random.normal(keys[2], (1, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (1, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, h)))
    # documents of 5, 11 (across a chunk boundary), 3, 16 tokens, then padding; a start on a boundary of 8
    ids = np.repeat([1, 2, 3, 4, 0], [5, 11, 8, 13, 3])[None]
    return q, k, v, g, beta, jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("ends", [None, [[0, 4], [0, 15], [0, 23], [0, 36]]], ids=["row", "each_documents_end"])
def test_through_the_chunked_rule_the_kernel_gives_the_xla_forms_outputs_and_gradients(ends):
    """The row's last state, or (a packed prefill's) the state after each document, and their gradients."""
    q, k, v, g, beta, ids = packed_row(0)
    ends = None if ends is None else jnp.asarray(ends, jnp.int32)

    def rule(kernel):
        def loss(q, k, v, g, beta):
            out, state = chunked_rule(q, k, v, g, beta, ids, chunk=8, kernel=kernel, ends=ends)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(state)), (out, state)
        return jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))

    (_, (out_x, state_x)), grads_x = rule("xla")(q, k, v, g, beta)
    (_, (out_p, state_p)), grads_p = rule("pallas")(q, k, v, g, beta)
    np.testing.assert_allclose(out_p, out_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state_p, state_x, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("q k v g beta".split(), grads_p, grads_x):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_kernel_lowers_through_triton_for_an_h100():
    """Forward and backward at Qwen3.5-9B's linear-layer head (Dk = Dv = 128), chunks of 64, without a GPU."""
    from test_flash import h100_lowering

    b, h, n, chunk, dk, dv = 1, 2, 3, 64, 128, 128
    t = n * chunk
    f32 = jnp.float32
    shapes = [jax.ShapeDtypeStruct(s, f32) for s in ((b, h, t, dv), (b, h, t, dk), (b, h, t, dk), (b, h, t, chunk),
                                                     (b, h, t, dk), (b, h, n), (b, h, dk, dv))]

    def loss(*args):
        out, states, new, final = delta_scan(*args, interpret=False)
        return out.sum() + states.sum() + new.sum() + final.sum()

    text = h100_lowering(jax.grad(loss, argnums=tuple(range(7))), *shapes)
    assert "seqjax_delta_scan_forward" in text and "seqjax_delta_scan_backward" in text


def test_a_shape_triton_cannot_tile_is_refused_in_one_line():
    from seqjax.core.errors import ConfigError

    args = terms(0, 1, 1, 2, 8, 8, 8)
    with pytest.raises(ConfigError, match=r"model.deltanet.kernel=pallas: key width 8, value block 8 and "
                                          r"model.deltanet.chunk=8, expected each at least 16"):
        delta_scan(*args, interpret=False)


@pytest.mark.slow  # (the full suite: the fast loop holds the kernel to the scan through the chunked rule)
def test_model_deltanet_kernel_pallas_runs_the_kernel_in_the_models_linear_layers():
    """A model with Gated DeltaNet layers (tests/test_deltanet.py's) under model.deltanet.kernel=pallas: its
    program holds the kernel, and its outputs and input gradients on a packed row are the xla scan's."""
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.model import build_model
    from test_deltanet import LINEAR_MODEL

    ids = jnp.asarray(np.repeat([1, 2, 3, 0], [13, 2, 21, 4])[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in (13, 2, 21, 4)])[None], jnp.int32)

    def run(kernel):
        model = build_model(load_config(None, [*LINEAR_MODEL, f"model.deltanet.kernel={kernel}"]), rngs=nnx.Rngs(0))
        embeddings = model.embed_tokens(jnp.arange(40, dtype=jnp.int32)[None] % 60 + 1)

        def total(embeddings):
            out = model.from_embeddings(embeddings, positions=positions, segment_ids=ids)
            return jnp.sum(jnp.where(ids[..., None] > 0, out, 0.0) ** 2), out

        fn = jax.jit(jax.value_and_grad(total, has_aux=True))
        return fn(embeddings), str(jax.make_jaxpr(fn)(embeddings))

    ((_, out_x), grad_x), program_x = run("xla")
    ((_, out_p), grad_p), program_p = run("pallas")
    assert "seqjax_delta_scan_forward" in program_p and "seqjax_delta_scan_backward" in program_p
    assert "seqjax_delta_scan" not in program_x
    np.testing.assert_allclose(out_p, out_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_p, grad_x, rtol=1e-4, atol=1e-5)
