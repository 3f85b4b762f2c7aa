"""Fitting bigger models changes no number: every remat policy and the chunked cross-entropy equal the plain path.

Memory is what they change, and memory is measured (scripts/bench_loss.py, BENCHMARKS.md), not asserted; what a
test can hold is that the backward pass keeps what each policy says, and no more.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.ad_checkpoint import print_saved_residuals

from seqjax.config.load import load_config
from seqjax.config.model import REMAT_NAMES
from seqjax.core.errors import ConfigError
from seqjax.model import build_model, split_params
from seqjax.model.loss import chunked_lm_loss, lm_loss
from seqjax.train.step import make_train_step

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "model.attention=xla", "data.seq_len=16", "model.vocab_size=50"]


def batch(seed=0, b=2, t=16, vocab=50):
    rng = np.random.default_rng(seed)
    segments = np.repeat([[1] * 7 + [2] * 6 + [0] * 3], b, axis=0)  # two packed documents and padding
    positions = np.where(segments > 0, np.concatenate([np.arange(7), np.arange(6), np.zeros(3)]), 0)
    return {"inputs": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
            "positions": jnp.asarray(positions, jnp.int32), "segment_ids": jnp.asarray(segments, jnp.int32),
            "weights": jnp.asarray(segments > 0, jnp.float32)}


def loss_and_grads(overrides, data):
    model = build_model(load_config(None, TINY + overrides), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m(data["inputs"], positions=data["positions"], segment_ids=data["segment_ids"])
        return lm_loss(logits, data["targets"], data["weights"])[0]

    return (loss, params), jax.jit(jax.value_and_grad(loss))(params)


def assert_trees_close(a, b, rtol, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol)


def saved(fn_and_params) -> list[str]:
    fn, params = fn_and_params
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, params)
    return out.getvalue().splitlines()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
@pytest.mark.parametrize("remat", ["full", "dots", "names"])
def test_every_remat_policy_gives_the_loss_and_gradients_of_no_remat(remat):
    data = batch()
    _, (loss, grads) = loss_and_grads([], data)
    _, (loss_r, grads_r) = loss_and_grads([f"model.remat={remat}"], data)
    assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
    assert_trees_close(grads_r, grads, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_remat_keeps_less_and_names_keeps_exactly_the_named_activations():
    data = batch()
    kept = {remat: saved(loss_and_grads([f"model.remat={remat}", "model.remat_names=[attn_out, q]"], data)[0])
            for remat in ("none", "full", "dots", "names")}
    assert len(kept["full"]) < len(kept["dots"]) < len(kept["none"])
    assert len(kept["full"]) < len(kept["names"]) < len(kept["none"])
    named = {name for line in kept["names"] for name in REMAT_NAMES if f"named '{name}'" in line}
    assert named == {"attn_out", "q"}
    assert not any("named" in line for line in kept["full"])


def test_an_unknown_remat_name_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"model.remat_names: got 'attn', expected names from \['q'"):
        load_config(None, TINY + ["model.remat=names", "model.remat_names=[attn]"])


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
@settings(max_examples=8, deadline=None)  # each example compiles: a few, over the edge cases below
@given(b=st.integers(1, 3), t=st.integers(1, 12), vocab=st.integers(2, 40), chunk=st.integers(1, 40),
       z_loss=st.sampled_from([0.0, 1e-3]), seed=st.integers(0, 3), spans=st.sampled_from([1, 2, 3, 4]))
def test_chunked_cross_entropy_equals_the_whole_logits_loss_and_gradients(b, t, vocab, chunk, z_loss, seed, spans):
    """Whatever the chunk, and with rows cut into spans (a row over mesh.context: chunks stay in one)."""
    assume(t % spans == 0)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(b, t, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, vocab)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    weights = jnp.asarray(rng.choice([0.0, 0.5, 1.0], size=(b, t)), jnp.float32)

    def whole(x, head):
        loss, aux = lm_loss(jnp.einsum("btd,dv->btv", x, head), targets, weights, z_loss=z_loss)
        return loss, aux

    def chunked(x, head):
        return chunked_lm_loss(x, head, targets, weights, chunk_tokens=chunk, z_loss=z_loss, spans=spans)

    (loss, aux), grads = jax.value_and_grad(whole, (0, 1), has_aux=True)(x, head)
    (loss_c, aux_c), grads_c = jax.jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(x, head)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-5, atol=1e-7)
    for key in aux:
        np.testing.assert_allclose(aux_c[key], aux[key], rtol=1e-5, atol=1e-6)
    assert_trees_close(grads_c, grads, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_in_bfloat16_is_within_bf16_of_float32_and_refuses_like_lm_loss():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(32, 64)) * 0.2, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32)
    weights = jnp.ones((2, 16), jnp.float32)
    exact = lm_loss(jnp.einsum("btd,dv->btv", x, head), targets, weights)[0]
    half = chunked_lm_loss(x.astype(jnp.bfloat16), head.astype(jnp.bfloat16), targets, weights, chunk_tokens=8)[0]
    assert half.dtype == jnp.float32 and float(half) == pytest.approx(float(exact), rel=2e-2)
    bad = targets.at[0, 3].set(64)  # outside the vocabulary, with weight: NaN, never a silent wrong loss
    assert np.isnan(float(chunked_lm_loss(x, head, bad, weights, chunk_tokens=8)[0]))
    unscored = chunked_lm_loss(x, head, bad, weights.at[0, 3].set(0.0), chunk_tokens=8)[0]
    assert np.isfinite(float(unscored))
    none, _ = chunked_lm_loss(x, head, targets, jnp.zeros_like(weights), chunk_tokens=8)
    assert float(none) == 0.0


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
@pytest.mark.parametrize("extra", [["model.loss_chunk_tokens=5"],
                                   pytest.param(["model.loss_chunk_tokens=7", "model.remat=full"],
                                                marks=pytest.mark.slow),
                                   pytest.param(["model.remat=dots", "model.tie_embeddings=false"],
                                                marks=pytest.mark.slow)])
def test_the_train_step_with_chunked_loss_and_remat_takes_the_plain_steps_update(extra):
    import optax

    data = batch(seed=1, b=4)
    updates = []
    for overrides in ([o for o in extra if "tie_embeddings" in o], extra):
        model = build_model(load_config(None, TINY + overrides), rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        tx = optax.sgd(1.0)
        step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=2, z_loss=1e-4))
        new, _, metrics = step(params, tx.init(params), data)
        updates.append((new, metrics))
    (plain, m0), (other, m1) = updates
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
    assert_trees_close(other, plain, rtol=1e-5, atol=1e-6)


REDUCED = ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
           "model.head_dim=16", "model.d_ff=128", "data.seq_len=64", "data.batch_size=8", "model.max_seq_len=128",
           "model.compute_dtype=float32", "model.attention=xla", "model.loss_chunk_tokens=96"]


# The families' configs keep their layer pattern at the reduced depth: Gemma 3's first layer slides, its second is
# global, so both kinds and both RoPE bases run.
FAMILY_REDUCED = {"gemma3_4b_finetune": ["model.layer_types=[sliding,full]", "model.sliding_window=16",
                                         "model.param_dtype=float32"]}


@pytest.mark.slow  # every config at a reduced size; the fast loop builds the small configs elsewhere
@pytest.mark.parametrize("name", ["llama3_8b_fsdp", "llama3_1b_finetune", "qwen3_8b_fsdp", "gemma3_4b_finetune",
                                  "llama3_8b_lora"])
def test_the_scale_configs_build_and_take_a_train_step_at_a_reduced_size(name):
    """Their remat, scanned layers, chunked loss and optimizer settings run; only the sizes (and the 8-device
    mesh) are reduced."""
    import optax

    from test_train_support import REPO

    config = load_config(REPO / "configs" / f"{name}.yaml", REDUCED + FAMILY_REDUCED.get(name, []) + [
        "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"])
    assert config.model.remat == "full" and config.model.loss_chunk_tokens == 96 and config.model.scan_layers
    model = build_model(config, rngs=nnx.Rngs(0))
    graphdef, params, frozen, rest = split_params(model)  # (the LoRA config trains its adapters alone)
    params = nnx.to_pure_dict(params)
    from seqjax.train.optimizer import build_optimizer

    tx, _ = build_optimizer(config.train)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=config.train.grad_accum, z_loss=config.train.z_loss))
    data = batch(seed=2, b=8, t=64, vocab=512)
    data["positions"], data["segment_ids"] = (jnp.tile(jnp.arange(64), (8, 1)), jnp.ones((8, 64), jnp.int32))
    data["weights"] = jnp.ones((8, 64), jnp.float32)
    extra = [] if frozen is None else [nnx.to_pure_dict(frozen)]
    new, _, metrics = step(params, tx.init(params), data, None, 0, *extra)
    assert (frozen is not None) == (name == "llama3_8b_lora")
    assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) == pytest.approx(np.log(512), rel=0.05)
    assert optax.tree.norm(jax.tree.map(jnp.subtract, new, params)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mesh, fsdp", [(["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"], 4),
                                        (["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 2)])
def test_plan_memory_shards_the_parameters_over_fsdp(mesh, fsdp, tmp_path):
    """scripts/plan_memory.py on 4 host devices: per-device parameter bytes are the total over the fsdp size
    (times the tensor axis's share), within the padding of dimensions fsdp does not divide."""
    import json
    import subprocess
    import sys

    from test_train_support import REPO, cli_env

    proc = subprocess.run([sys.executable, "scripts/plan_memory.py", "--config", "configs/llama3_8b_fsdp.yaml",
                           "--devices", "4", *REDUCED, *mesh], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    total = row["parameters"] * 4  # float32
    tensor = 4 // fsdp
    assert row["mesh"] == {"data": 1, "fsdp": fsdp, "expert": 1, "context": 1, "tensor": tensor}
    assert total / (fsdp * tensor) <= row["param_bytes_per_device"] <= total / fsdp * 1.05
    assert row["optimizer_bytes_per_device"] >= 2 * row["param_bytes_per_device"]  # AdamW's two moments
    assert row["temp_bytes_per_device"] > 0
