"""Schedules at their key steps, the weight-decay mask, and accumulation == one big batch (contract 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.train.optimizer import build_optimizer, decay_mask, learning_rate_schedule


def schedule_for(*overrides):
    return learning_rate_schedule(load_config(None, ["train.lr=1.0", *overrides]).train)


def test_cosine_warms_up_to_the_peak_then_decays_to_the_floor():
    lr = schedule_for("train.steps=110", "train.warmup_steps=10", "train.min_lr_ratio=0.1")
    assert float(lr(1)) == pytest.approx(0.1)  # the first update already moves
    assert float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55)  # halfway through the cosine: (peak + floor) / 2
    assert float(lr(110)) == pytest.approx(0.1)
    values = [float(lr(s)) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant():
    linear = schedule_for("train.schedule=linear", "train.steps=20", "train.warmup_steps=0", "train.min_lr_ratio=0.0")
    assert [float(linear(s)) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    constant = schedule_for("train.schedule=constant", "train.steps=50", "train.warmup_steps=4")
    assert [float(constant(s)) for s in (2, 4, 30, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_the_optimizer_applies_the_schedule_to_update_s():
    """optax counts from 0; update number s (1-based) must use learning_rate(s)."""
    config = load_config(None, ["train.lr=1.0", "train.steps=10", "train.warmup_steps=4", "train.grad_clip=null",
                                "train.weight_decay=0.0", "train.b1=0.0", "train.b2=0.0", "train.eps=0.0"])
    tx, schedule = build_optimizer(config.train)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    for step in (1, 2, 3):  # b1 = b2 = eps = 0: Adam's step is exactly -lr * sign(g)
        updates, state = tx.update({"w": jnp.ones(())}, state, params)
        assert float(updates["w"]) == pytest.approx(-float(schedule(step)))


def tiny_model(**overrides):
    from seqjax.model import build_model

    settings = {"model.vocab_size": 50, "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2,
                "model.d_ff": 32, "model.max_seq_len": 16, "data.seq_len": 16, "model.attention": "xla", **overrides}
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    return config, build_model(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_decay_mask_skips_norms_biases_and_embeddings_unless_asked(decay_embeddings):
    _, model = tiny_model(**{"model.tie_embeddings": False})
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat = {
        "/".join(map(str, path)): m
        for path, m in (
            (tuple(getattr(k, "key", k) for k in p), m)
            for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(params, decay_embeddings))
        )
    }
    assert flat["blocks/0/attn/wq"] and flat["blocks/0/mlp/w_down"] and flat["lm_head"]
    assert not flat["blocks/0/attn_norm/scale"] and not flat["final_norm/scale"]
    assert flat["embed/embedding"] is decay_embeddings
    biases = {"bias": jnp.zeros((4,)), "kernel": jnp.zeros((4, 4))}
    assert decay_mask(biases) == {"bias": False, "kernel": True}


def test_weight_decay_leaves_masked_parameters_alone():
    config = load_config(
        None, ["train.lr=0.1", "train.weight_decay=0.5", "train.warmup_steps=0", "train.schedule=constant"]
    )
    tx, _ = build_optimizer(config.train)
    params = {"embed": {"embedding": jnp.ones((3, 2))}, "norm": {"scale": jnp.ones((2,))}, "w": jnp.ones((2, 2))}
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero_grads, tx.init(params), params)
    assert float(jnp.abs(updates["embed"]["embedding"]).max()) == 0.0
    assert float(jnp.abs(updates["norm"]["scale"]).max()) == 0.0
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)


def uneven_batch(rng: np.random.Generator, rows: int, length: int, vocab: int) -> dict[str, jnp.ndarray]:
    """Rows with very different numbers of scored tokens, so a mean of micro-batch means would be wrong."""
    tokens = rng.integers(1, vocab, size=(rows, length + 1))
    scored = np.zeros((rows, length), np.float32)
    for r in range(rows):
        scored[r, : 1 + (r * 7) % length] = 1.0  # 1 .. length scored targets per row
    return {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "segment_ids": jnp.asarray((scored > 0).astype(np.int32)),
        "positions": jnp.asarray(np.broadcast_to(np.arange(length), (rows, length)), jnp.int32),
        "weights": jnp.asarray(scored),
    }


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_k_micro_batches_give_the_update_of_one_big_batch():
    from seqjax.model.loss import lm_loss
    from seqjax.train.step import make_train_step

    config, model = tiny_model()
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(state)
    tx, _ = build_optimizer(load_config(None, ["train.warmup_steps=0", "train.steps=10", "train.lr=1e-2"]).train)
    batch = uneven_batch(np.random.default_rng(0), rows=8, length=16, vocab=50)

    results = {}
    for k in (1, 4):
        step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=k, z_loss=1e-3))
        results[k] = step(params, tx.init(params), batch)
    for a, b in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[4][0])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    assert float(results[4][2]["loss"]) == pytest.approx(float(results[1][2]["loss"]), rel=1e-6)
    assert float(results[4][2]["grad_norm"]) == pytest.approx(float(results[1][2]["grad_norm"]), rel=1e-5)

    @jax.jit
    def mean_loss(b):
        logits = nnx.merge(graphdef, params, rest)(b["inputs"], positions=b["positions"], segment_ids=b["segment_ids"])
        return lm_loss(logits, b["targets"], b["weights"])[0]

    # The reported loss is contract 3 over the whole batch, which a mean of the micro-batches' means is not.
    assert float(results[4][2]["loss"]) == pytest.approx(float(mean_loss(batch)), rel=1e-6)
    quarters = [mean_loss({k: v[i::4] for k, v in batch.items()}) for i in range(4)]
    assert abs(float(sum(quarters) / 4) - float(results[4][2]["loss"])) > 1e-3


def test_grad_clip_0_means_no_clipping_as_in_hf_not_a_zero_update():
    """A clipping threshold of 0 scaled every gradient to 0: the run silently stopped learning."""
    params = {"w": jnp.ones((3,))}
    grads = {"w": jnp.asarray([30.0, -40.0, 0.5])}
    updates = {}
    for clip in ("0", "null"):
        tx, _ = build_optimizer(load_config(None, ["train.warmup_steps=0", f"train.grad_clip={clip}"]).train)
        updates[clip], _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_array_equal(updates["0"]["w"], updates["null"]["w"])
    assert float(jnp.abs(updates["0"]["w"]).min()) > 0  # clipped to norm 0, AdamW's update was 0 everywhere


@pytest.mark.parametrize("nonfinite", ["skip", "stop"])
def test_a_bfloat16_models_step_keeps_its_state_types_and_traces_once(nonfinite):
    """bfloat16 parameters (the LoRA and fine-tuning recipes): AdamW's moments are float32 from the
    start, as the step leaves them, so the second step runs the first one's program (before, the
    moments came out float32 from bfloat16, and every such run compiled its step twice, the second
    time inside a benchmark's timed steps); the parameters stay bfloat16."""
    from seqjax.train.setup import sharded_optimizer_state
    from seqjax.train.step import make_train_step

    config, model = tiny_model(**{"model.param_dtype": "bfloat16"})
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(state)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    tx, _ = build_optimizer(load_config(None, ["train.warmup_steps=0", f"train.nonfinite={nonfinite}"]).train)
    opt_state, _ = sharded_optimizer_state(tx, params, jax.tree.map(lambda _: None, params), None)
    moments = [leaf for leaf in jax.tree.leaves(opt_state) if leaf.ndim > 0]
    assert moments and {leaf.dtype for leaf in moments} == {jnp.dtype(jnp.float32)}
    traces = []

    def counted(*args):
        traces.append(1)  # (Python runs only when jax traces)
        return make_train_step(graphdef, rest, tx, grad_accum=2)(*args)

    step = jax.jit(counted)
    batch = uneven_batch(np.random.default_rng(0), rows=4, length=16, vocab=50)
    kinds = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    for _ in range(3):
        new_params, new_state, metrics = step(params, opt_state, batch)
        assert kinds(new_params) == kinds(params) and kinds(new_state) == kinds(opt_state)
        assert any(not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                   for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)))  # (it trains)
        params, opt_state = new_params, new_state
    assert len(traces) == 1 and bool(metrics["finite"])
