"""The mixture-of-experts layer (seqjax.model.experts) as a seam of the block: a packed row routes each document
as it is routed alone, padding never reaches the router's losses, the dispatches agree, the train step adds the
router's losses from the objective's one forward and logs them, the expert axis of the mesh gives one device's
numbers, and bad settings are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.model import build_model, split_params
from seqjax.model.experts import load_balancing_loss
from seqjax.objectives import resolve
from seqjax.train.step import make_train_step
from test_train_support import REPO, with_devices

BASE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
        "model.vocab_size=64", "model.max_seq_len=64", "data.seq_len=64", "model.attention=xla",
        "model.experts.count=4", "model.experts.top_k=2", "model.experts.d_ff=16"]
T = 64


def config(*extra: str):
    return load_config(None, [*BASE, *extra])


MODELS: dict = {}


def compiled(*extra: str):
    """One jitted (logits, router terms) per setting: shapes are fixed, so every draw reuses it."""
    if extra not in MODELS:
        model = build_model(config(*extra), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def run(state, inputs, positions, segment_ids):
            features, head, terms = nnx.merge(graphdef, state).forward(inputs, positions=positions,
                                                                       segment_ids=segment_ids)
            return features @ head, terms

        MODELS[extra] = (state, jax.jit(run))
    return MODELS[extra]


@settings(max_examples=8, deadline=None)
@given(data=st.data(), family=st.sampled_from([(), ("model.experts.router=topk_softmax",
                                                    "model.experts.activation=clamped_swiglu",
                                                    "model.experts.bias=true")]))
def test_a_packed_row_routes_and_computes_each_document_as_it_is_alone(data, family):
    """Any packing of documents into one row (padding after them): each document's logits are its own alone,
    and the router's sums over the row are the sums of the documents' alone (padding never counts)."""
    lengths = data.draw(st.lists(st.integers(1, T // 4), min_size=1, max_size=4))  # (4 of them fill the row)
    docs = [data.draw(st.lists(st.integers(1, 63), min_size=n, max_size=n)) for n in lengths]
    state, run = compiled(*family)
    ids, seg, pos = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    at, alone, counts = 0, [], np.zeros((2, 4))
    for s, doc in enumerate(docs, 1):
        ids[at:at + len(doc)], seg[at:at + len(doc)], pos[at:at + len(doc)] = doc, s, np.arange(len(doc))
        single = np.zeros(T, np.int32)
        single[:len(doc)] = doc
        logits, terms = run(state, single[None], np.arange(T)[None], (np.arange(T) < len(doc)).astype(np.int32)[None])
        alone.append(np.asarray(logits)[0, :len(doc)])
        counts += np.asarray(terms.counts)
        at += len(doc)
    logits, terms = run(state, ids[None], pos[None], seg[None])
    at = 0
    for doc, own in zip(docs, alone):
        np.testing.assert_allclose(np.asarray(logits)[0, at:at + len(doc)], own, rtol=1e-5, atol=1e-5)
        at += len(doc)
    np.testing.assert_array_equal(np.asarray(terms.counts), counts)
    assert float(jnp.sum(terms.tokens)) == 2 * sum(lengths)  # (two layers of real tokens)


@pytest.mark.slow  # (the full suite: the fast loop was 8 min with it)
def test_the_grouped_matmul_equals_every_expert_on_every_token():
    """dispatch=ragged_dot (tokens sorted by expert, one grouped matmul), blocked (sorted, padded to 64-row
    blocks) and dense (the reference) give the same outputs and gradients."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, (2, T)).astype(np.int32)
    pos, seg = np.tile(np.arange(T), (2, 1)), np.ones((2, T), np.int32)
    outs = []
    for dispatch in ("ragged_dot", "blocked", "dense"):
        model = build_model(config(f"model.experts.dispatch={dispatch}"), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state):
            features, head, terms = nnx.merge(graphdef, state).forward(ids, positions=pos, segment_ids=seg)
            return jnp.mean((features @ head) ** 2) + load_balancing_loss(terms, 2)

        outs.append(jax.value_and_grad(loss)(state))
    (a, ga), *others = outs
    for b, gb in others:
        assert float(a) == pytest.approx(float(b), rel=1e-5)
        for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("routing", ["spread", "one expert", "whole blocks", "some idle", "some in no group"])
def test_the_blocked_dispatch_puts_every_pair_back_in_place(routing):
    """The blocked dispatch's block edges: every pair on one expert, groups of exactly whole blocks, experts
    with no tokens; each (token, choice) gets its own expert's output, as the dense reference gives it. Pairs
    of no group (expert E: another device's under mesh.expert) come back 0 from blocked and ragged_dot."""
    from seqjax.model.experts import ACTIVATIONS, BLOCK, DISPATCH

    rng = np.random.default_rng(1)
    e, n, k, d, f = 4, 2 * BLOCK, 2, 8, 16
    chosen = {"spread": rng.integers(0, e, (n, k)), "one expert": np.zeros((n, k)),
              "whole blocks": np.repeat(np.arange(e), n * k // e).reshape(n, k),
              "some idle": rng.integers(2, e, (n, k)),
              "some in no group": rng.integers(0, e + 1, (n, k))}[routing].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
         for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d)))}
    act = ACTIVATIONS["swiglu"]
    grouped = chosen < e
    expected = np.where(grouped[..., None], np.asarray(DISPATCH["dense"](x, jnp.asarray(np.minimum(chosen, e - 1)),
                                                                          w, act)), 0.0)
    for dispatch in ("blocked", "ragged_dot"):
        got = np.asarray(DISPATCH[dispatch](x, jnp.asarray(chosen), w, act))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=dispatch)


def _router_batch():
    rng = np.random.default_rng(1)
    batch = {"inputs": rng.integers(1, 64, (4, T)).astype(np.int32),
             "targets": rng.integers(1, 64, (4, T)).astype(np.int32),
             "positions": np.tile(np.arange(T), (4, 1)).astype(np.int32),
             "segment_ids": np.ones((4, T), np.int32), "weights": np.ones((4, T), np.float32)}
    batch["segment_ids"][:, 50:] = 0
    batch["weights"][:, 50:] = 0
    batch["segment_ids"][1, 20:] = 0  # (micro-batches of unequal real tokens: their means differ from the pool's)
    batch["weights"][1, 20:] = 0
    return batch


def _router_step(extra: tuple, grad_accum: int, lr: float = 0.0, batch=None):
    """(params after one sgd step, metrics) of the lm objective under ``extra`` settings."""
    cfg = config(*extra)
    graphdef, params, _, rest = split_params(build_model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    step = jax.jit(make_train_step(graphdef, rest, optax.sgd(lr), grad_accum=grad_accum, objective=resolve(["lm"]),
                                   model_config=cfg.model))
    new, _, metrics = step(params, optax.sgd(lr).init(params), _router_batch() if batch is None else batch)
    return (graphdef, rest, params), new, metrics


COEFS = ("model.experts.aux_loss_coef=0.5", "model.experts.z_loss_coef=0.25")


@pytest.mark.slow  # (whole train steps: the full suite; the fast loop keeps a packed row's routing)
@pytest.mark.parametrize("scope", ["step", "micro_batch"])
def test_the_step_adds_the_routers_losses_and_logs_them(scope):
    """model.experts.aux_loss_coef and z_loss_coef add the router's pooled losses to the objective: the loss as
    logged is the objective's alone, aux_loss and router_z_loss are logged beside it, and the step's objective
    is the loss plus each coefficient times its term. Under aux_loss_scope=step (two micro-batches) they are
    the losses of the whole batch's routes pooled, as one forward gives them; under micro_batch, the mean of
    each micro-batch's own (docs/model.md)."""
    (graphdef, rest, params), _, with_ = _router_step((*COEFS, f"model.experts.aux_loss_scope={scope}"), 2)
    without = _router_step((), 2)[2]
    assert float(with_["loss"]) == pytest.approx(float(without["loss"]), rel=1e-6)
    aux, z = float(with_["reported"]["aux_loss"]), float(with_["reported"]["router_z_loss"])
    batch = _router_batch()
    if scope == "step":
        expected = [_pooled(graphdef, rest, params, batch)]
    else:
        expected = [_pooled(graphdef, rest, params, {k: v[j::2] for k, v in batch.items()}) for j in range(2)]
    assert aux == pytest.approx(np.mean([e[0] for e in expected]), rel=1e-5)
    assert z == pytest.approx(np.mean([e[1] for e in expected]), rel=1e-5)
    assert float(with_["objective"]) == pytest.approx(float(without["objective"]) + 0.5 * aux + 0.25 * z, rel=1e-5)
    assert {"router/max_share/0", "router/max_share/1"} <= set(with_["reported"])


@pytest.mark.slow  # (the full suite: the fast loop was 8 min with it)
def test_the_routers_losses_pooled_over_the_step_do_not_change_with_the_micro_batch_split():
    """aux_loss_scope=step (the default): one sgd step's new weights under train.grad_accum 2 and 4 are those
    of the batch in one micro-batch, the router's losses included; micro_batch (each its own, averaged) moves
    them, which shows the check can tell."""
    one = _router_step(COEFS, 1, lr=1.0)[1]
    for grad_accum in (2, 4):
        split = _router_step(COEFS, grad_accum, lr=1.0)[1]
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(split)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    apart = _router_step((*COEFS, "model.experts.aux_loss_scope=micro_batch"), 2, lr=1.0)[1]
    gaps = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
            zip(jax.tree.leaves(one), jax.tree.leaves(apart))]
    assert max(gaps) > 1e-4


def _pooled(graphdef, rest, params, micro):
    from seqjax.model.experts import router_z_loss

    *_, terms = nnx.merge(graphdef, params, rest).forward(micro["inputs"], positions=micro["positions"],
                                                          segment_ids=micro["segment_ids"])
    return float(load_balancing_loss(terms, 2)), float(router_z_loss(terms))




@pytest.mark.slow  # (the full suite: the fast loop was 8 min with it)
def test_an_expert_axis_gives_one_devices_loss_router_terms_and_gradients():
    """mesh.expert = 2, 4 and 8 (beside data, fsdp and context, on 8 simulated devices): the experts split over
    the axis, each device's tokens gathered to their experts and given back, and the loss, the router's sums
    and every gradient are one device's (tests/moe_cases.py)."""
    env = {"XLA_FLAGS": with_devices(8), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "moe_cases.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked = json.loads(proc.stdout.strip().splitlines()[-1])["checked"]
    assert {json.dumps(c["mesh"], sort_keys=True) for c in checked} >= {'{"data": 4, "expert": 2}', '{"expert": 8}',
                                                                        '{"expert": 4, "fsdp": 2}'}


def test_bad_expert_settings_are_one_line():
    from seqjax.config.tree import MeshConfig
    from seqjax.model import sharding

    with pytest.raises(ConfigError, match="model.experts.top_k: got 5, expected at most model.experts.count=4"):
        config("model.experts.top_k=5")
    with pytest.raises(ConfigError, match=r"layers of 2 kinds \(model.experts.dense_layers \[1\]"):
        config("model.experts.dense_layers=[1]", "model.scan_layers=true")
    mesh = sharding.build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
    sharding.check_experts(4, mesh)
    fake = type("Mesh", (), {"shape": {"expert": 3}})()
    with pytest.raises(ConfigError, match="mesh.expert: got 3, expected a divisor of model.experts.count=4"):
        sharding.check_experts(4, fake)


@pytest.mark.slow  # (the fast loop keeps LoRA on the experts against peft: tests/test_moe_families.py)
@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_lora_on_the_experts_trains_the_adapters_alone_and_folds_into_the_base(quantize):
    """model.lora on the attention and the experts (experts_gate_up, experts_down), the base stored as QLoRA stores
    it: only the adapters get gradients, the experts' adapters among them; folded into the base (a merged
    export), the plain model computes what the adapted one does."""
    from seqjax.model.assembly import full_weights, stored_base
    from seqjax.model.lora import adapters_off

    cfg = config("model.lora.rank=2", "model.lora.alpha=4", f"model.lora.quantize={quantize}",
                 "model.lora.targets=[q,experts_gate_up,experts_down]", "model.lora.quant_block=16")
    graphdef, trained, frozen, rest = split_params(build_model(cfg, rngs=nnx.Rngs(0)))
    trained = jax.tree.map(lambda a: a + 0.05, nnx.to_pure_dict(trained))  # (B != 0: the adapters matter)
    frozen = stored_base(nnx.to_pure_dict(frozen), cfg.model)
    ids = np.random.default_rng(2).integers(1, 64, (2, T)).astype(np.int32)
    pos, seg = np.tile(np.arange(T), (2, 1)), np.ones((2, T), np.int32)

    def loss(trained):
        features, head, _ = nnx.merge(graphdef, trained, frozen, rest).forward(ids, positions=pos, segment_ids=seg)
        return jnp.mean((features @ head) ** 2)

    grads = jax.grad(loss)(trained)
    experts = grads["blocks"][0]["mlp"]["experts"]["lora"]
    assert set(experts) == {"experts_gate_up_a", "experts_gate_up_b", "experts_down_a", "experts_down_b"}
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(experts))
    adapted = nnx.merge(graphdef, trained, frozen, rest)
    off = nnx.merge(adapters_off(graphdef, trained, frozen, rest), trained, frozen, rest)
    plain_cfg = config()
    plain = build_model(plain_cfg, rngs=nnx.Rngs(0))
    nnx.update(plain, full_weights(adapted))
    logits = {name: m.forward(ids, positions=pos, segment_ids=seg) for name, m in
              (("adapted", adapted), ("off", off), ("folded", plain))}
    as_logits = {k: np.asarray(f @ h) for k, (f, h, _) in logits.items()}
    np.testing.assert_allclose(as_logits["folded"], as_logits["adapted"], rtol=1e-4, atol=1e-4)
    assert float(np.abs(as_logits["adapted"] - as_logits["off"]).max()) > 1e-3
