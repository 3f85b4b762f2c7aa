"""TransformerLM: packed segments are isolated (logits, gradients, loss); shapes, dtypes, init, compiles, bad input."""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.model import TransformerLM, build_model, param_count
from seqjax.model.loss import lm_loss

T = 24
VOCAB = 64
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "model.max_seq_len=32", "model.attention=xla", "data.seq_len=32"]


def tiny_config(*overrides: str):
    return load_config(None, [*TINY, *overrides])


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    return build_model(tiny_config(), VOCAB, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
    """Jitted (inputs, positions, segment_ids) -> logits, one compile per shape."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda s, x, p, g: nnx.merge(graphdef, s)(x, positions=p, segment_ids=g))
    return lambda x, p, g: fn(state, x, p, g)


def pack(docs: list[np.ndarray], t: int):
    """One packed row [1, t]: the documents back to back, segment ids 1.., positions from 0, padding after."""
    inputs = np.zeros((1, t), np.int32)
    segment_ids = np.zeros((1, t), np.int32)
    positions = np.zeros((1, t), np.int32)
    start = 0
    for seg, doc in enumerate(docs, start=1):
        inputs[0, start : start + len(doc)] = doc
        segment_ids[0, start : start + len(doc)] = seg
        positions[0, start : start + len(doc)] = np.arange(len(doc))
        start += len(doc)
    return inputs, positions, segment_ids


def random_docs(lengths, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


packings = st.lists(st.integers(1, 9), min_size=1, max_size=6).map(
    lambda lengths: [n for i, n in enumerate(lengths) if sum(lengths[: i + 1]) <= T] or [T]
)


@settings(max_examples=15, deadline=None)
@given(lengths=packings, seed=st.integers(0, 2**16))
def test_each_packed_segment_equals_the_segment_run_alone(forward, lengths, seed):
    inputs, positions, segment_ids = pack(random_docs(lengths, np.random.default_rng(seed)), T)
    packed = np.asarray(forward(inputs, positions, segment_ids))
    for seg in range(1, len(lengths) + 1):
        sel = segment_ids[0] == seg
        x, p, g = pack([inputs[0, sel]], T)
        solo = np.asarray(forward(x, p, g))[0, : sel.sum()]
        np.testing.assert_allclose(packed[0, sel], solo, rtol=1e-5, atol=1e-5)
    assert np.isfinite(packed).all()  # padding included


@settings(max_examples=10, deadline=None)
@given(lengths=packings, seed=st.integers(0, 2**16), data=st.data())
def test_gradient_of_one_segment_loss_is_exactly_zero_on_other_segments(model, lengths, seed, data):
    inputs, positions, segment_ids = pack(random_docs(lengths, np.random.default_rng(seed)), T)
    seg = data.draw(st.integers(1, len(lengths)), label="segment")
    grads = np.asarray(_embedding_grad(model, inputs, positions, segment_ids, seg))[0]
    other = segment_ids[0] != seg
    assert (grads[other] == 0).all(), "a token of another segment (or padding) moved this segment's loss"
    assert np.abs(grads[~other]).sum() > 0  # the segment's own tokens do matter


def _embedding_grad(model, inputs, positions, segment_ids, seg):
    """d(loss of segment ``seg``) / d(embeddings fed to the first block), [1, T, D]."""
    graphdef, state = nnx.split(model)
    return _embedding_grad_jit(graphdef, state, inputs, positions, segment_ids, seg)


@functools.partial(jax.jit, static_argnums=0)
def _embedding_grad_jit(graphdef, state, inputs, positions, segment_ids, seg):
    m = nnx.merge(graphdef, state)
    targets = jnp.roll(inputs, -1, axis=1)  # which targets does not matter for isolation
    weights = (segment_ids == seg).astype(jnp.float32)

    def loss(x):
        logits = m.from_embeddings(x, positions=positions, segment_ids=segment_ids)
        return lm_loss(logits, targets, weights)[0]

    return jax.grad(loss)(m.embed_tokens(inputs))


@settings(max_examples=10, deadline=None)
@given(lengths=packings, seed=st.integers(0, 2**16))
def test_packed_loss_equals_token_weighted_loss_of_documents_run_separately(forward, lengths, seed):
    rng = np.random.default_rng(seed)
    inputs, positions, segment_ids = pack(random_docs(lengths, rng), T)
    targets = rng.integers(0, VOCAB, inputs.shape).astype(np.int32)
    weights = (segment_ids != 0).astype(np.float32)
    packed_loss, aux = lm_loss(forward(inputs, positions, segment_ids), targets, weights)
    nll, count = 0.0, 0.0
    for seg in range(1, len(lengths) + 1):
        sel = segment_ids[0] == seg
        x, p, g = pack([inputs[0, sel]], T)
        t = np.zeros_like(x)
        t[0, : sel.sum()] = targets[0, sel]
        loss, doc_aux = lm_loss(forward(x, p, g), t, g.astype(np.float32))
        nll += float(doc_aux["nll_sum"])
        count += float(doc_aux["weight_sum"])
        np.testing.assert_allclose(float(loss), float(doc_aux["nll_sum"]) / sel.sum(), rtol=1e-6)
    assert float(aux["weight_sum"]) == count == sum(lengths)
    np.testing.assert_allclose(float(packed_loss), nll / count, rtol=1e-5)


def test_padding_rows_are_finite_and_carry_no_weight(forward):
    inputs, positions, segment_ids = pack(random_docs([5, 3], np.random.default_rng(1)), T)
    inputs[0, 8:] = 7  # garbage in the padding must not matter
    logits = forward(inputs, positions, segment_ids)
    chex.assert_tree_all_finite(logits)
    weights = (segment_ids != 0).astype(np.float32)
    base = lm_loss(logits, inputs, weights)
    inputs[0, 8:] = 3
    again = lm_loss(forward(inputs, positions, segment_ids), inputs, weights)
    chex.assert_trees_all_close(base, again, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[0, :8], np.asarray(forward(inputs, positions, segment_ids))[0, :8],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie", [True, False])
def test_shapes_dtypes_and_finite_logits(compute_dtype, tie):
    cfg = tiny_config(f"model.compute_dtype={compute_dtype}", f"model.tie_embeddings={str(tie).lower()}")
    m = build_model(cfg, VOCAB, rngs=nnx.Rngs(1))
    inputs, positions, segment_ids = pack(random_docs([7, 9], np.random.default_rng(0)), 16)
    logits = m(
        jnp.tile(inputs, (3, 1)), positions=jnp.tile(positions, (3, 1)), segment_ids=jnp.tile(segment_ids, (3, 1))
    )
    chex.assert_shape(logits, (3, 16, VOCAB))
    chex.assert_type(logits, jnp.float32)
    chex.assert_tree_all_finite(logits)
    assert (m.lm_head is None) == tie


def test_param_count_matches_the_architecture():
    cfg = tiny_config("model.tie_embeddings=false").model
    m = build_model(cfg, VOCAB, rngs=nnx.Rngs(0))
    d, f, h, k, dh, layers = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.n_layers
    per_block = d * h * dh * 2 + d * k * dh * 2 + 3 * d * f + 2 * d
    counts = param_count(m)
    assert counts["embedding"] == 2 * VOCAB * d
    assert counts["non_embedding"] == layers * per_block + d
    tied = param_count(build_model(dataclasses.replace(cfg, tie_embeddings=True), VOCAB, rngs=nnx.Rngs(0)))
    assert tied["total"] == counts["total"] - VOCAB * d


def test_init_follows_gpt2_scaling():
    cfg = tiny_config("model.n_layers=8", "model.d_ff=256", "model.init_std=0.05").model
    m = build_model(cfg, VOCAB, rngs=nnx.Rngs(0))
    block = m.blocks[3]
    residual_std = 0.05 / math.sqrt(2 * 8)
    assert np.std(np.asarray(block.mlp.w_up[...])) == pytest.approx(0.05, rel=0.1)
    assert np.std(np.asarray(block.mlp.w_down[...])) == pytest.approx(residual_std, rel=0.1)
    assert np.std(np.asarray(block.attn.wo[...])) == pytest.approx(residual_std, rel=0.1)
    assert np.std(np.asarray(m.embed.embedding[...])) == pytest.approx(0.05, rel=0.1)
    assert (np.asarray(block.attn_norm.scale[...]) == 1).all()
    assert block.attn.wq.get_metadata()["axes"] == ("embed", "heads", "head_dim")


def test_build_model_takes_vocab_from_the_argument_or_the_config():
    assert build_model(tiny_config("model.vocab_size=50"), rngs=nnx.Rngs(0)).cfg.vocab_size == 50
    assert build_model(tiny_config("model.vocab_size=50"), 70, rngs=nnx.Rngs(0)).cfg.vocab_size == 70
    with pytest.raises(ValueError, match="vocab_size is null"):
        build_model(tiny_config(), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        tiny_config("model.n_kv_heads=3")


def test_jit_compiles_once_per_bucket_shape_not_once_per_batch(model):
    graphdef, state = nnx.split(model)
    traces = []

    def loss_fn(s, x, p, g):
        traces.append(x.shape)
        logits = nnx.merge(graphdef, s)(x, positions=p, segment_ids=g)
        return lm_loss(logits, x, (g != 0).astype(jnp.float32))[0]

    step = jax.jit(loss_fn)
    rng = np.random.default_rng(0)
    for t in (8, 8, 16, 8, 16, 16):
        lengths = list(rng.integers(1, 4, 2))
        step(state, *pack(random_docs(lengths, rng), t))
    assert traces == [(1, 8), (1, 16)]


def test_bad_inputs_fail_clearly_at_trace_time(model):
    inputs, positions, segment_ids = (jnp.asarray(a) for a in pack(random_docs([4, 4], np.random.default_rng(0)), 8))
    with pytest.raises(ValueError, match=r"positions has shape \(1, 7\), expected \(1, 8\)"):
        jax.eval_shape(lambda: model(inputs, positions=positions[:, :7], segment_ids=segment_ids))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(8,\)"):
        jax.eval_shape(lambda: model(inputs, positions=positions, segment_ids=segment_ids[0]))
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=32"):
        long = jnp.zeros((1, 33), jnp.int32)
        jax.eval_shape(lambda: model(long, positions=long, segment_ids=long))
    with pytest.raises(ValueError, match="segment_ids has dtype float32"):
        jax.eval_shape(lambda: model(inputs, positions=positions, segment_ids=segment_ids.astype(jnp.float32)))


def test_out_of_vocabulary_ids_raise_eagerly_and_give_nan_under_jit(model, forward):
    inputs, positions, segment_ids = pack(random_docs([4, 4], np.random.default_rng(0)), 8)
    inputs[0, 2] = VOCAB
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside the vocabulary"):
        model(inputs, positions=positions, segment_ids=segment_ids)
    inputs[0, 2] = -1
    logits = np.asarray(forward(inputs, positions, segment_ids))
    assert np.isnan(logits[0, 2]).all()  # loud (NaN spreads through the row's matmuls), never a silent clamp


def test_rope_rotates_by_the_batch_positions_and_scores_depend_on_distance_only():
    from seqjax.model.rope import rope, rope_frequencies

    # head_dim 2: one frequency (theta**0 = 1), so position p rotates (1, 0) to (cos p, sin p)
    x = jnp.tile(jnp.asarray([1.0, 0.0]), (1, 3, 1, 1))
    positions = jnp.asarray([[0, 2, 5]])
    np.testing.assert_allclose(np.asarray(rope(x, positions, rope_frequencies(2, 10000.0)))[0, :, 0],
                               np.stack([np.cos([0, 2, 5]), np.sin([0, 2, 5])], -1), atol=1e-6)
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 2, 1, 16))

    def score(i, j):
        freq = rope_frequencies(16, 1e4)
        return float(jnp.sum(rope(q, jnp.asarray([[i, i]]), freq)[0, 0] * rope(k, jnp.asarray([[j, j]]), freq)[0, 0]))

    assert score(7, 3) == pytest.approx(score(4, 0), rel=1e-4)  # a segment may start anywhere: only i - j matters
    assert score(7, 3) != pytest.approx(score(7, 0), rel=1e-3)


def test_the_model_reads_positions_from_the_batch(forward):
    inputs, positions, segment_ids = pack(random_docs([12], np.random.default_rng(2)), T)
    shuffled = positions.copy()
    shuffled[0, :12] = np.random.default_rng(0).permutation(12)
    assert not np.allclose(np.asarray(forward(inputs, positions, segment_ids)),
                           np.asarray(forward(inputs, shuffled, segment_ids)), atol=1e-4)


@pytest.mark.parametrize("precision, expected", [("default", "DEFAULT"), ("highest", "HIGHEST")])
def test_matmul_precision_reaches_every_matmul_of_the_train_step(precision, expected):
    """model.matmul_precision=highest: the train step's every dot (the blocks', the head's, their gradients')
    asks for full float32 (a GPU otherwise runs float32 matmuls as TF32); default leaves JAX's choice."""
    import optax

    from seqjax.config.load import load_config
    from seqjax.model import build_model, split_params
    from seqjax.train.step import make_train_step

    config = load_config(None, ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
                                "model.vocab_size=64", "model.max_seq_len=16", "data.seq_len=16",
                                "model.attention=xla", "model.loss_chunk_tokens=8",
                                f"model.matmul_precision={precision}"])
    try:
        graphdef, params, _, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
        tx = optax.adamw(1e-3)
        step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=1))
        batch = {k: jnp.ones((2, 16), jnp.float32 if k == "weights" else jnp.int32)
                 for k in ("inputs", "targets", "segment_ids", "positions", "weights")}
        text = step.lower(params, tx.init(params), batch).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert len(dots) > 6
        precisions = {line.split("precision = [")[1].split(",")[0] if "precision = [" in line else None
                      for line in dots}
        assert precisions == {expected}
    finally:
        jax.config.update("jax_default_matmul_precision", None)
