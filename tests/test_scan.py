"""model.scan_layers: stacked blocks under jax.lax.scan give the unrolled model's numbers, and every reader converts.

The unrolled model is the reference: the same parameters (converted with
seqjax.model.stacking.blocks_layout) must give the same logits, loss and
gradients (with every remat policy and with dropout), the same KV-cache
decoding, and a run saved one way must load, evaluate and export the other way.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.engine import generate
from seqjax.model import build_model
from seqjax.model.loss import lm_loss
from seqjax.model.stacking import blocks_layout, is_stacked
from test_scale import TINY, assert_trees_close, batch

THREE = TINY + ["model.n_layers=3"]


def pair(extra=()):
    """(unrolled model, scanned model holding the same parameters)."""
    unrolled = build_model(load_config(None, THREE + list(extra)), rngs=nnx.Rngs(0))
    scanned = build_model(load_config(None, THREE + list(extra) + ["model.scan_layers=true"]), rngs=nnx.Rngs(1))
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(state, blocks_layout(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)), stacked=True))
    nnx.update(scanned, state)
    return unrolled, scanned


def loss_and_grads(model, data, key=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m(data["inputs"], positions=data["positions"], segment_ids=data["segment_ids"], dropout_key=key)
        return lm_loss(logits, data["targets"], data["weights"])[0]

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("extra", [[], ["model.lora.rank=2", "model.qkv_bias=true", "model.qk_norm=true"]],
                         ids=["plain", "lora"])
def test_the_same_seed_gives_the_same_starting_weights_whatever_the_layout_remat_or_chunking(extra):
    """Issue: scan_layers started from other weights than unrolled layers (step-1 loss 8.2966 against 8.3039 on
    wikitext2_cpu): a compile option must never change a run's curve."""
    base = None
    for options in ([], ["model.scan_layers=true"], ["model.remat=full", "model.loss_chunk_tokens=64"],
                    ["model.scan_layers=true", "model.remat=dots"]):
        model = build_model(load_config(None, THREE + extra + options), rngs=nnx.Rngs(0))
        params = blocks_layout(nnx.to_pure_dict(nnx.state(model, nnx.Param)), stacked=False)
        if base is None:
            base = params
            continue
        assert jax.tree.structure(params) == jax.tree.structure(base)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_the_stacked_layout_has_a_leading_layer_axis_and_converts_both_ways():
    unrolled, scanned = pair()
    p_unrolled = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    p_scanned = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    assert not is_stacked(p_unrolled) and is_stacked(p_scanned)
    assert p_scanned["blocks"]["attn"]["wq"].shape == (3, *p_unrolled["blocks"][0]["attn"]["wq"].shape)
    back = blocks_layout(p_scanned, stacked=False)
    for i in range(3):
        np.testing.assert_array_equal(back["blocks"][i]["mlp"]["w_up"], p_unrolled["blocks"][i]["mlp"]["w_up"])
    axes = {str(path): v.axes for path, v in nnx.to_flat_state(nnx.state(scanned, nnx.Param))}
    assert axes["('blocks', 'attn', 'wq')"] == ("layers", "embed", "heads", "head_dim")


@pytest.mark.slow  # every policy: the full suite (the fast loop scans in test_families)
@pytest.mark.parametrize("remat", ["none", "full", "dots", "names"])
def test_scanned_layers_give_the_unrolled_loss_and_gradients_under_every_remat_policy(remat):
    data = batch()
    unrolled, scanned = pair([f"model.remat={remat}"])
    loss_u, grads_u = loss_and_grads(unrolled, data)
    loss_s, grads_s = loss_and_grads(scanned, data)
    assert float(loss_s) == pytest.approx(float(loss_u), rel=1e-6)
    assert_trees_close(blocks_layout(grads_s, stacked=False), grads_u, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_scanned_layers_draw_the_unrolled_dropout_masks():
    data = batch(seed=1)
    unrolled, scanned = pair(["model.dropout=0.3", "model.attention_dropout=0.2"])
    key = jax.random.key(7)
    loss_u, grads_u = loss_and_grads(unrolled, data, key)
    loss_s, grads_s = loss_and_grads(scanned, data, key)
    assert float(loss_s) == pytest.approx(float(loss_u), rel=1e-6)
    assert_trees_close(blocks_layout(grads_s, stacked=False), grads_u, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_scanned_layers_decode_with_the_kv_cache_as_the_unrolled_model_does():
    unrolled, scanned = pair()
    prompts = [[3, 4, 5, 6], [7, 8]]
    out_u = generate(unrolled, prompts, max_new_tokens=6, eot_id=None)
    out_s = generate(scanned, prompts, max_new_tokens=6, eot_id=None)
    assert [r.tokens for r in out_u] == [r.tokens for r in out_s] and len(out_u[0].tokens) == 6


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_a_step_of_the_scanned_model_equals_the_unrolled_one_in_a_train_run(tmp_path):
    """Saved scanned, read unrolled (and back): eval and export see the same weights either way."""
    from seqjax.train.checkpoint import save_params
    from seqjax.weights.inference import load_for_inference

    _, scanned = pair()
    config = load_config(None, THREE + ["model.scan_layers=true", f"run.dir={tmp_path}"])
    config.save(tmp_path / "config.yaml")
    save_params(tmp_path, 0, nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), {"tokens_seen": 0})
    data = batch()
    want = scanned(data["inputs"], positions=data["positions"], segment_ids=data["segment_ids"])
    for flag in ("false", "true"):
        config_read, model = load_for_inference(tmp_path, [f"model.scan_layers={flag}"])
        assert config_read.model.scan_layers == (flag == "true")
        got = model(data["inputs"], positions=data["positions"], segment_ids=data["segment_ids"])
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_hf_export_of_a_scanned_model_is_per_layer_and_imports_back_either_way(tmp_path):
    from seqjax.hf.tensors import from_hf, to_hf

    unrolled, scanned = pair()
    tensors = to_hf(nnx.to_pure_dict(nnx.state(scanned, nnx.Param)), scanned.cfg)
    reference = to_hf(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)), unrolled.cfg)
    assert set(tensors) == set(reference) and "model.layers.2.mlp.up_proj.weight" in tensors
    for name in reference:
        np.testing.assert_array_equal(tensors[name], reference[name])
    params = from_hf(tensors.__getitem__, tensors, unrolled.cfg, "here")
    np.testing.assert_array_equal(blocks_layout(params, stacked=True)["blocks"]["attn"]["wk"],
                                  nnx.to_pure_dict(nnx.state(scanned, nnx.Param))["blocks"]["attn"]["wk"])


def test_a_resume_that_switches_scan_layers_is_refused_as_a_model_change():
    from seqjax.config.diff import resume_changes

    before = load_config(None, THREE)
    after = load_config(None, THREE + ["model.scan_layers=true"])
    changes = [c for c in resume_changes(before.to_dict(), after) if c.key == "model.scan_layers"]
    assert changes and changes[0].kind == "model"


def test_the_layer_axis_is_never_sharded_even_when_it_is_the_largest_dimension_fsdp_divides():
    from types import SimpleNamespace

    from seqjax.model.sharding import param_spec

    mesh = SimpleNamespace(shape={"tensor": 2, "fsdp": 4})
    # 64 layers of a [32, 16] matrix: fsdp would take the 64 if the name did not stop it
    assert tuple(param_spec((64, 32, 16), ("layers", "embed", "ff"), mesh)) == (None, "fsdp", "tensor")
    assert tuple(param_spec((32, 16), ("embed", "ff"), mesh)) == ("fsdp", "tensor")  # one layer: the same


@pytest.mark.slow
def test_scanned_training_resumes_exactly_and_fine_tunes_from_an_unrolled_hf_folder(tiny_root, tmp_path):
    """CLI runs: a scanned run killed at step 10 and resumed gives the straight run's losses; a scanned
    fine-tune of an (unrolled, per-layer) HF folder starts from its weights: step 1's loss is the unrolled one's."""
    from hf_support import write_llama_folder
    from test_train_support import assert_ok, run_cli, tiny_overrides, train_losses

    scan = {"model.scan_layers": "true", "train.steps": 20}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert_ok(run_cli(tiny_overrides(tiny_root, straight, **scan)))
    assert_ok(run_cli(tiny_overrides(tiny_root, resumed, **{**scan, "train.steps": 10})))
    assert_ok(run_cli(tiny_overrides(tiny_root, resumed, **scan)))
    assert train_losses(resumed) == train_losses(straight)

    llama = write_llama_folder(tmp_path / "llama")
    shape = {"model.norm_eps": 1e-5, "model.max_seq_len": 128, "model.tie_embeddings": "false",
             "train.init_from": llama, "train.steps": 1, "train.warmup_steps": 0}
    first = {}
    for flag in ("false", "true"):
        run_dir = tmp_path / f"ft_{flag}"
        assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **shape, **{"model.scan_layers": flag})))
        first[flag] = train_losses(run_dir)[1]
    assert first["true"] == pytest.approx(first["false"], rel=1e-5)
