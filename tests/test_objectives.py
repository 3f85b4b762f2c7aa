"""The objective seam: train.objective picks the loss the step computes, from a table a test can add a row to;
per-segment sums and per-token log-probabilities (plain and chunked) are the one reduction sequence-level
objectives share; sums over micro-batches divide once, whatever the objective."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax import objectives
from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.model import build_model, split_params
from seqjax.model.loss import chunked_token_logprobs, segment_sums, token_logprobs
from seqjax.objectives import Inputs, Objective, Terms
from seqjax.objectives.base import target_logprobs
from seqjax.train.metrics import read_metrics
from seqjax.train.step import make_train_step
from test_train_support import tiny_overrides

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
        "model.vocab_size=64", "model.max_seq_len=16", "data.seq_len=16", "model.attention=xla"]


def packed_batch(seed: int, rows: int = 4, t: int = 16, vocab: int = 64) -> dict:
    """Rows of 1-3 segments of random lengths (padding at the end), every target scored."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((rows, t), np.int32), np.zeros((rows, t), np.int32)
    for r in range(rows):
        at = 0
        for s in range(1, rng.integers(1, 4) + 1):
            n = int(rng.integers(2, 7))
            if at + n > t:
                break
            seg[r, at:at + n], pos[r, at:at + n], at = s, np.arange(n), at + n
    ids = rng.integers(0, vocab, (rows, t + 1))
    return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos),
            "weights": jnp.asarray(seg > 0, jnp.float32)}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=24), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_segment_sums_add_each_segment_alone(ids, num_segments, seed):
    values = np.random.default_rng(seed).normal(size=(1, len(ids))).astype(np.float32)
    got = np.asarray(segment_sums(jnp.asarray(values), jnp.asarray([ids]), num_segments))
    want = [values[0][np.asarray(ids) == s].sum() for s in range(1, num_segments + 1)]
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)


def test_chunked_token_logprobs_and_their_gradients_equal_the_plain_path():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 7, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 11)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, (2, 7)), jnp.int32)
    scored = jnp.asarray(rng.random((2, 7)) > 0.3)
    cot = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)

    def plain(h, w):
        return jnp.sum(cot * token_logprobs(jnp.einsum("btd,dv->btv", h, w), targets, scored))

    for spans in (1, 7):  # (7: each token its own span, as a row over mesh.context keeps chunks in one)
        def logprobs(h, w, spans=spans):
            return chunked_token_logprobs(h, w, targets, scored, chunk_tokens=3, spans=spans)

        def chunked(h, w, logprobs=logprobs):
            return jnp.sum(cot * logprobs(h, w))

        np.testing.assert_allclose(jax.jit(logprobs)(hidden, head),
                                   token_logprobs(jnp.einsum("btd,dv->btv", hidden, head), targets, scored),
                                   atol=1e-5)
        for got, want in zip(jax.jit(jax.grad(chunked, (0, 1)))(hidden, head),
                             jax.jit(jax.grad(plain, (0, 1)))(hidden, head)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def per_segment_terms(inputs: Inputs, micro) -> Terms:
    """A toy objective: each segment's mean nll, averaged over segments (per-example normalization, written as an
    objective); it reports how many segments it saw."""
    scored = micro["weights"] > 0
    logp = target_logprobs(inputs.model, micro, inputs.key, scored)
    n = micro["segment_ids"].shape[1]
    nll = segment_sums(-logp, micro["segment_ids"], n)
    count = segment_sums(scored.astype(jnp.float32), micro["segment_ids"], n)
    per_segment = jnp.where(count > 0, nll / jnp.where(count > 0, count, 1.0), 0.0)
    segments = jnp.sum(count > 0).astype(jnp.float32)
    return Terms(jnp.sum(per_segment), segments, jnp.sum(per_segment), {"toy/segments": (segments, 1.0)})


TOY = Objective("toy_per_segment", per_segment_terms,
                denominator=lambda b: jnp.sum(segment_sums(b["weights"], b["segment_ids"],
                                                           b["segment_ids"].shape[1]) > 0).astype(jnp.float32),
                reports=("toy/segments",))


@pytest.fixture
def toy():
    objectives.register(TOY)
    yield TOY
    del objectives.OBJECTIVES[TOY.name]


def tiny_step(objective, settings=None, grad_accum=1):
    config = load_config(None, TINY + ["train.warmup_steps=0", "train.lr=1e-2"])
    model = build_model(config, rngs=nnx.Rngs(0))
    graphdef, params, _, rest = split_params(model)
    step = jax.jit(make_train_step(graphdef, rest, optax.sgd(1.0), grad_accum=grad_accum, objective=objective,
                                   settings=settings))
    return step, nnx.to_pure_dict(params), model


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_a_weighted_sum_of_objectives_is_each_loss_weighted_and_accumulates_as_one_batch(toy):
    """[lm, toy] with weights [1, 0.5]: the logged objective is lm's mean + 0.5 * toy's mean over the global batch,
    and 2 micro-batches give the update of one (each part divided by its own global denominator)."""
    batch = packed_batch(1)
    both = objectives.resolve(["lm", TOY.name], [1.0, 0.5])
    step, params, model = tiny_step(both)
    one = step(params, optax.sgd(1.0).init(params), batch)
    alone = {row.name: row.loss(Inputs(model, None, {"z_loss": 0.0}, {}), batch) for row in both.parts}
    means = {name: float(t.value / t.denominator) for name, t in alone.items()}
    np.testing.assert_allclose(one[2]["objective"], means["lm"] + 0.5 * means[TOY.name], rtol=1e-5)
    np.testing.assert_allclose(one[2]["reported"][f"{TOY.name}/loss"], means[TOY.name], rtol=1e-5)
    step2, params, _ = tiny_step(both, grad_accum=2)
    two = step2(params, optax.sgd(1.0).init(params), batch)
    for got, want in zip(jax.tree.leaves(two[0]), jax.tree.leaves(one[0])):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_train_objective_names_are_checked_and_one_name_is_a_list_of_one():
    assert load_config(None, ["train.objective=lm"]).train.objective == ["lm"]
    with pytest.raises(ConfigError, match=r"train.objective\[1\]: got 'nope', expected one of lm"):
        objectives.resolve(["lm", "nope"])
    with pytest.raises(ConfigError, match=r"train.objective_weights: got \[1.0, 2.0\], expected one weight per"):
        objectives.resolve(["lm"], [1.0, 2.0])
    assert objectives.resolve(["lm"]) is objectives.DEFAULT


@pytest.mark.slow  # (a training run; the fast loop checks the step and the table above)
def test_a_toy_objective_registered_in_a_test_trains_and_reports_through_the_unchanged_loop(toy, tiny_root,
                                                                                           tmp_path):
    """The loop, the step and the logger know no objective by name: a row added here trains, its loss is the
    one logged, and what it reports reaches metrics.jsonl."""
    from seqjax.data.pipeline import build_pipeline  # (the training stage: only this test runs a loop)
    from seqjax.store.build import prepare
    from seqjax.train.loop import train

    run_dir = tmp_path / "toy"
    config = load_config(None, tiny_overrides(tiny_root, run_dir, **{
        "train.steps": 3, "train.objective": TOY.name, "train.log_every": 1, "data.strategy": "pack"}))
    train(config)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["toy/segments"] > 0 for r in rows)
    # step 1's logged loss is the toy objective of the initial weights on the first batch, computed here alone
    resolved = load_config(run_dir / "config.yaml")
    store = prepare(resolved, splits=("train",)).stores["train"]
    first = {k: jnp.asarray(v) for k, v in next(iter(build_pipeline(resolved, store))).items()}
    model = build_model(resolved, rngs=nnx.Rngs(resolved.run.seed))
    terms = per_segment_terms(Inputs(model, None, {}, {}), first)
    assert rows[0]["toy/segments"] == float(terms.denominator)
    np.testing.assert_allclose(rows[0]["loss"], float(terms.value / terms.denominator), rtol=1e-5)
