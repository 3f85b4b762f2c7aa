"""model.lora: adapters on a frozen base. At B = 0 the base's function; gradients by the chain rule through
W + (alpha / r) A B and nowhere else; checkpoints of the adapters alone that resume exactly and refuse another
base; eval, generate and export (a PEFT folder, or --merge) on the run directly."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from model_support import compiled_logits
from seqjax.config.load import load_config
from seqjax.hf import peft
from seqjax.model import BASE_PARAMS, build_model, split_params
from seqjax.model.assembly import fold, layer_targets
from seqjax.model.loss import lm_loss
from seqjax.model.sharding import param_spec
from seqjax.train.optimizer import build_optimizer
from seqjax.train.step import make_train_step
from seqjax.weights.saved import read_saved
from test_train_support import assert_ok, run_cli, tiny_overrides, train_losses

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
        "model.vocab_size=64", "model.max_seq_len=16", "data.seq_len=16", "model.attention=xla"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def batch(seed: int = 0, b: int = 2, t: int = 16):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, 64, (b, t + 1)), jnp.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "positions": jnp.tile(jnp.arange(t), (b, 1)),
            "segment_ids": jnp.ones((b, t), jnp.int32), "weights": jnp.ones((b, t), jnp.float32)}


def logits(model, data):
    """The model's logits on ``data``, in one compiled program (as a step computes them; not op by op)."""
    return compiled_logits(model, data["inputs"], data["positions"], data["segment_ids"])


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_at_initialization_a_lora_model_computes_its_base_exactly(scan):
    lora = build_model(load_config(None, TINY + LORA + [f"model.scan_layers={scan}"]), rngs=nnx.Rngs(0))
    base = build_model(load_config(None, TINY + [f"model.scan_layers={scan}"]), rngs=nnx.Rngs(1))
    nnx.update(base, nnx.state(lora, BASE_PARAMS))
    data = batch()
    np.testing.assert_array_equal(np.asarray(logits(lora, data)), np.asarray(logits(base, data)))
    adapters = nnx.to_pure_dict(nnx.state(lora, nnx.LoRAParam))
    assert all(not np.any(np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(adapters)
               if "lora_b" in jax.tree_util.keystr(k))


@pytest.mark.parametrize("scan", [False, True])
def test_each_adapter_shards_as_its_projection_does(scan):
    """A and B carry their projection's logical axes beside lora_rank, so a (fsdp, tensor) mesh splits A's input
    and B's output over tensor exactly where it splits the projection's, and never the rank between them: the
    adapter's output adds to the projection's where it lies."""
    model = build_model(load_config(None, TINY + LORA + [f"model.scan_layers={scan}"]), rngs=nnx.Rngs(0))
    mesh = SimpleNamespace(shape={"data": 1, "fsdp": 2, "tensor": 2})
    weights = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}
    nodes = dict(nnx.iter_graph(model))
    lead = 1 if scan else 0  # a scanned parameter's leading layers axis, never split
    checked = set()
    for path, variable in nodes.items():
        if not isinstance(variable, nnx.LoRAParam):
            continue
        *owner, _, name, part = path  # .../attn/lora/q/lora_a
        weight = getattr(nodes[tuple(owner)], weights[name])
        w_spec = tuple(param_spec(weight.shape, weight.axes, mesh))[lead:]
        spec = tuple(param_spec(variable.shape, variable.axes, mesh))[lead:]
        inputs = 2 if name == "o" else 1  # wo reads [heads, head_dim]; A and B see them flattened
        ends = w_spec[:inputs] if part == "lora_a" else w_spec[inputs:]  # A reads the input, B writes the output
        side = 0 if part == "lora_a" else -1
        assert (spec[side] == "tensor") == ("tensor" in ends), (path, spec, w_spec)
        assert spec[1 + side] is None  # the rank dimension stays whole
        checked.add((name, part))
    assert len(checked) == 14
    assert any("tensor" in tuple(param_spec(v.shape, v.axes, mesh)) for v in nodes.values()
               if isinstance(v, nnx.LoRAParam))


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_adapter_gradients_are_the_chain_rule_through_the_merged_weight():
    """dL/dA = s G B^T and dL/dB = s A^T G, with G = dL/dW' of the model whose weights are W' = W + s A B."""
    config = load_config(None, TINY + LORA)
    model = build_model(config, rngs=nnx.Rngs(0))
    graphdef, adapters, frozen, rest = split_params(model)
    adapters = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(7), a.shape),
                            nnx.to_pure_dict(adapters))  # B != 0, so both gradients are non-trivial
    data, s = batch(3), config.model.lora.scale

    def loss_of_adapters(a):
        m = nnx.merge(graphdef, a, frozen, rest)
        return lm_loss(logits(m, data), data["targets"], data["weights"])[0]

    grads = jax.grad(loss_of_adapters)(adapters)
    merged = fold(nnx.to_pure_dict(frozen), adapters, config.model)
    plain = build_model(load_config(None, TINY), rngs=nnx.Rngs(0))
    pgraph, pparams, prest = nnx.split(plain, nnx.Param, ...)

    def loss_of_weights(w):
        return lm_loss(logits(nnx.merge(pgraph, w, prest), data), data["targets"], data["weights"])[0]

    g_w = jax.grad(loss_of_weights)(merged)
    assert len(layer_targets(config.model, 0)) == 7  # (a dense model's seven projections, each checked)
    for i in range(config.model.n_layers):
        for target in layer_targets(config.model, i):
            _, module, weight = peft.MODULES[target]
            a = np.asarray(adapters["blocks"][i][module]["lora"][target]["lora_a"], np.float64)
            b = np.asarray(adapters["blocks"][i][module]["lora"][target]["lora_b"], np.float64)
            g = np.asarray(g_w["blocks"][i][module][weight], np.float64).reshape(a.shape[0], b.shape[1])
            got = grads["blocks"][i][module]["lora"][target]
            np.testing.assert_allclose(np.asarray(got["lora_a"]), s * g @ b.T, rtol=2e-4, atol=1e-7)
            np.testing.assert_allclose(np.asarray(got["lora_b"]), s * a.T @ g, rtol=2e-4, atol=1e-7)


def two_adapter_steps(overrides: list[str]):
    """Two steps (2 micro-batches each, lr 1e-2) of TINY + LORA + ``overrides``: (what trains before, after,
    the optimizer state, the first step's metrics, the frozen base, a copy of the base from before)."""
    config = load_config(None, TINY + LORA + overrides + ["train.lr=1e-2", "train.warmup_steps=0"])
    graphdef, trained, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    trained, frozen = nnx.to_pure_dict(trained), nnx.to_pure_dict(frozen)
    before = jax.tree.map(np.asarray, frozen)
    tx, _ = build_optimizer(config.train)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=2, z_loss=0.0))
    opt_state = tx.init(trained)
    new, opt_state, metrics = step(trained, opt_state, batch(1, b=4), None, 1, frozen)
    new, _, _ = step(new, opt_state, batch(2, b=4), None, 2, frozen)
    return trained, new, opt_state, metrics, frozen, before


def test_a_train_step_moves_the_adapters_only_and_leaves_the_base_bit_identical():
    adapters, new, opt_state, metrics, frozen, before = two_adapter_steps([])
    assert np.isfinite(float(metrics["loss"]))
    moved = [np.any(np.asarray(x) != np.asarray(y)) for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(adapters))]
    assert all(moved)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, frozen))
    optimizer_arrays = sum(x.size for x in jax.tree.leaves(opt_state) if hasattr(x, "size") and x.ndim)
    assert optimizer_arrays == 2 * sum(x.size for x in jax.tree.leaves(adapters))  # AdamW's moments, adapters only


VARIANTS = ["model.lora.dora=true", "model.lora.rslora=true", "model.lora.modules_to_save=[embed]"]


@pytest.mark.parametrize("layout", [["model.scan_layers=false"],
                                    ["model.scan_layers=true", "model.remat=full", "model.loss_chunk_tokens=8"]])
@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_dora_rslora_and_modules_to_save_train_what_they_should_and_nothing_else(layout):
    """Under scan, remat and the chunked loss, with accumulation: the adapters, DoRA's magnitudes and the saved
    embeddings all move; the frozen base stays bit-identical; the optimizer holds state for what trains only."""
    trained, new, _, metrics, frozen, before = two_adapter_steps(VARIANTS + layout)
    assert "embed" in trained and "embed" not in frozen
    assert np.isfinite(float(metrics["loss"]))
    flat_new, flat_old = (dict(jax.tree_util.tree_leaves_with_path(t)) for t in (new, trained))
    moved = {jax.tree_util.keystr(k) for k in flat_new if np.any(np.asarray(flat_new[k]) != np.asarray(flat_old[k]))}
    assert moved == {jax.tree_util.keystr(k) for k in flat_new}  # every A, B, magnitude and the embeddings
    assert any("magnitude" in k for k in moved)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, frozen))


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_dora_starts_at_the_function_of_the_base_it_is_put_on(quantize):
    """A new DoRA adapter on weights read later (train.init_from): its magnitudes are set to the norms of that
    base (QLoRA's as read back), so before any step it computes the base exactly (to rounding)."""
    from seqjax.model import quant
    from seqjax.model.assembly import dora_magnitudes, stored_base

    config = load_config(None, TINY + LORA + ["model.lora.dora=true", f"model.lora.quantize={quantize}",
                                             "model.lora.quant_block=8"])
    graphdef, trained, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    plain = build_model(load_config(None, TINY), rngs=nnx.Rngs(5))  # the base to put it on: other weights
    stored = stored_base(nnx.to_pure_dict(nnx.state(plain, BASE_PARAMS)), config.model)
    nnx.update(plain, quant.dequantize_base(stored, "float32"))  # (what the quantized base computes)
    data = batch(4)
    stale = nnx.merge(graphdef, nnx.to_pure_dict(trained), stored, rest)
    assert np.abs(np.asarray(logits(stale, data)) - np.asarray(logits(plain, data))).max() > 1e-2
    fresh = nnx.merge(graphdef, dora_magnitudes(nnx.to_pure_dict(trained), stored, config.model), stored, rest)
    np.testing.assert_allclose(np.asarray(logits(fresh, data)), np.asarray(logits(plain, data)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("variant", [[], VARIANTS])
def test_peft_round_trip_and_the_merged_weights_compute_the_lora_model(variant):
    config = load_config(None, TINY + LORA + variant)
    model = build_model(config, rngs=nnx.Rngs(0))
    graphdef, adapters, frozen, rest = split_params(model)
    adapters = jax.tree.map(lambda a: np.asarray(a + 0.05 * jax.random.normal(jax.random.key(3), a.shape)),
                            nnx.to_pure_dict(adapters))
    back = peft.from_peft(peft.to_peft(adapters, config.model), config.model, "here")
    jax.tree.map(np.testing.assert_array_equal, back, adapters)
    lora_model = nnx.merge(graphdef, adapters, frozen, rest)
    plain = build_model(load_config(None, TINY), rngs=nnx.Rngs(0))
    nnx.update(plain, fold(nnx.to_pure_dict(frozen), adapters, config.model))
    data = batch(5)
    np.testing.assert_allclose(np.asarray(logits(plain, data)), np.asarray(logits(lora_model, data)), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.slow  # LoRA runs on a trained tiny base, through the CLIs
def test_a_lora_run_resumes_exactly_saves_small_refuses_another_base_and_exports(reference, tiny_root, tmp_path,
                                                                                  capsys):
    from seqjax.main import export

    base = tiny_root / "reference"
    lora = {"train.init_from": base, "model.lora.rank": 4, "model.lora.alpha": 8, "train.lr": 1e-2,
            "train.checkpoint_every": 5, "train.steps": 10}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert_ok(run_cli(tiny_overrides(tiny_root, whole, **lora)))
    assert_ok(run_cli(tiny_overrides(tiny_root, resumed, **{**lora, "train.steps": 5})))
    assert_ok(run_cli(tiny_overrides(tiny_root, resumed, **lora)))
    assert train_losses(resumed) == train_losses(whole)
    assert train_losses(whole)[10] < train_losses(whole)[1]

    def saved_numbers(step_dir):  # what a checkpoint holds: parameters and optimizer state, counted
        saved = read_saved(step_dir, items=("params", "opt_state"))
        return sum(int(np.prod(shape)) for item in saved.arrays.values() for shape, _ in item.values())

    # the adapters and their two AdamW moments, not the base (at this tiny shape orbax's own files weigh more)
    ratio = saved_numbers(whole / "checkpoints" / "10") / saved_numbers(base / "checkpoints" / "60")
    assert ratio < 0.2

    other = tmp_path / "other_base"  # the same shapes, other weights: refused in one line, nothing touched
    shutil.copytree(base, other)
    shutil.rmtree(other / "checkpoints" / "60")
    proc = run_cli(tiny_overrides(tiny_root, resumed, **{**lora, "train.init_from": other, "train.steps": 12}))
    assert proc.returncode == 2 and "adapters only mean something on their own base" in proc.stderr
    assert "Traceback" not in proc.stderr and sorted(train_losses(resumed)) == list(range(1, 11))

    export.main(["--run", str(whole), "--out", str(tmp_path / "adapter")])
    config = json.loads((tmp_path / "adapter" / peft.ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    # the base is a seqjax run imported from no HF folder: no path peft could read is written, and it says so
    assert config["base_model_name_or_path"] is None
    assert "is no Hugging Face model folder" in capsys.readouterr().err
    tensors = load_file(str(tmp_path / "adapter" / peft.ADAPTER_WEIGHTS))
    assert len(tensors) == 2 * 7 * 2 and all(name.startswith("base_model.model.model.layers.") for name in tensors)
    export.main(["--run", str(whole), "--out", str(tmp_path / "merged"), "--merge"])
    assert (tmp_path / "merged" / "model.safetensors").is_file() and not (tmp_path / "merged" / "adapter_config.json"
                                                                          ).exists()
    capsys.readouterr()

    # the base moved away: eval, generate and export name it, not "expected a run directory"
    moved = tmp_path / "moved_base"
    shutil.copytree(base, moved)
    assert_ok(run_cli(tiny_overrides(tiny_root, tmp_path / "on_moved", **{**lora, "train.init_from": moved,
                                                                          "train.steps": 2})))
    moved.rename(tmp_path / "elsewhere")
    with pytest.raises(SystemExit):
        export.main(["--run", str(tmp_path / "on_moved"), "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert f"train.init_from: {moved}, the base the LoRA run" in err and "is missing (moved or deleted)" in err
    assert "expected a run directory" not in err and not (tmp_path / "never").exists()
    export.main(["--run", str(tmp_path / "on_moved"), "--out", str(tmp_path / "found"),
                 f"train.init_from={tmp_path / 'elsewhere'}"])
    assert (tmp_path / "found" / peft.ADAPTER_WEIGHTS).is_file()
    jax.clear_caches()
