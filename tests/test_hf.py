"""Hugging Face Llama in and out: round trips are exact, transformers' own Llama agrees, bad folders are refused.

The reference is transformers 4.x's ``FlaxLlamaForCausalLM``: Hugging Face's
Llama on the JAX already installed (transformers 5 dropped Flax and needs
torch). It reads the same safetensors files through transformers' own
PyTorch-to-Flax loader. It ignores ``head_dim``, ``rope_theta`` and
``rope_scaling`` (it always uses d_model / n_heads and base 10000), so those
fields are checked by the exact round trips and by hand-computed frequencies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from hf_support import llama_tensors, tiny_tokenizer, write_chat_llama_folder, write_llama_folder
from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError, RopeScalingConfig
from seqjax.core.errors import CheckpointError
from seqjax.hf import folders as hf
from seqjax.model import build_model
from seqjax.model.rope import rope_frequencies

T = 12
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64", "model.attention=xla",
        "data.seq_len=16", "model.max_seq_len=64"]


@nnx.jit  # one compile per model instead of one per eager op: the tests build many small models
def _forward(model, inputs, positions, segment_ids):
    return model(inputs, positions=positions, segment_ids=segment_ids)


def logits(model, inputs, positions=None, segment_ids=None):
    inputs = np.asarray(inputs, np.int32)
    positions = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape) if positions is None else positions
    segment_ids = np.ones_like(inputs) if segment_ids is None else segment_ids
    return np.asarray(_forward(model, inputs, np.asarray(positions, np.int32), np.asarray(segment_ids, np.int32)))


def same_model(a, b) -> bool:
    """Equal model configs, with n_kv_heads null read as n_heads (config.json always states it)."""
    return dataclasses.replace(a, n_kv_heads=a.kv_heads) == dataclasses.replace(b, n_kv_heads=b.kv_heads)


def random_ids(shape, vocab=300, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def export_and_import(model, tokenizer, out, **write):
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    hf.write_folder(out, model.cfg, params, tokenizer_json=tokenizer.path, eos_token="<|endoftext|>", bos_token=None,
                    **write)
    config, imported = hf.load(out, ["model.attention=xla"])
    return config, imported


@pytest.mark.parametrize("overrides", [
    ["model.n_kv_heads=2", "model.tie_embeddings=false"],  # grouped-query attention, untied head
    ["model.tie_embeddings=true"],  # tied: no lm_head.weight written, the embedding read back as the head
    ["model.head_dim=16", "model.n_kv_heads=1"],  # head_dim != d_model / n_heads (32 / 4)
    ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=4.0",  # llama3 frequencies matter at T=12
     "model.rope_scaling.original_max_position_embeddings=8", "model.rope_theta=500000.0", "model.norm_eps=1e-5"],
], ids=["gqa-untied", "tied", "head_dim", "llama3-rope"])
def test_seqjax_export_import_round_trip_gives_identical_logits(overrides, tokenizer, tmp_path):
    config = load_config(None, TINY + overrides)
    model = build_model(config, 300, rngs=nnx.Rngs(1))
    _, imported = export_and_import(model, tokenizer, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    with safe_open(tmp_path / "hf" / hf.WEIGHTS, "numpy") as f:
        assert ("lm_head.weight" in f.keys()) == (not config.model.tie_embeddings)
    assert written["tie_word_embeddings"] == config.model.tie_embeddings
    assert same_model(imported.cfg, model.cfg)
    ids = random_ids((2, T))
    np.testing.assert_array_equal(logits(imported, ids), logits(model, ids))


def test_shards_and_bfloat16_round_trip(tokenizer, tmp_path):
    model = build_model(load_config(None, TINY + ["model.tie_embeddings=false"]), 300, rngs=nnx.Rngs(2))
    _, sharded = export_and_import(model, tokenizer, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (tmp_path / "sharded" / hf.WEIGHTS).exists()
    ids = random_ids((1, T))
    np.testing.assert_array_equal(logits(sharded, ids), logits(model, ids))
    _, half = export_and_import(model, tokenizer, tmp_path / "bf16", dtype="bfloat16")
    float32_bytes = index["metadata"]["total_size"]
    assert (tmp_path / "bf16" / hf.WEIGHTS).stat().st_size < 0.51 * float32_bytes + 4096  # 2 bytes a weight, header
    np.testing.assert_allclose(logits(half, ids), logits(model, ids), atol=0.05)  # bf16 weights: ~3 digits
    assert not np.array_equal(logits(half, ids), logits(model, ids))


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_transformers_llama_and_the_import_give_the_same_logits_and_packing_isolates_documents(tmp_path):
    from transformers import FlaxLlamaForCausalLM  # the reference; ~2 s to import

    folder = write_llama_folder(tmp_path / "llama")  # GQA (4 heads on 2), untied, rms_norm_eps 1e-5
    reference = FlaxLlamaForCausalLM.from_pretrained(folder)
    _, model = hf.load(folder, ["model.attention=xla"])
    ids = random_ids((2, T))
    expected = np.asarray(reference(ids).logits)
    np.testing.assert_allclose(logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(expected).max() > 1  # not a trivially small comparison

    # A packed row of two documents against transformers on each document alone.
    a, b = random_ids((1, 5), seed=3), random_ids((1, 7), seed=4)
    packed = logits(model, np.concatenate([a, b], 1), positions=[list(range(5)) + list(range(7))],
                    segment_ids=[[1] * 5 + [2] * 7])
    np.testing.assert_allclose(packed[:, :5], np.asarray(reference(a).logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, 5:], np.asarray(reference(b).logits), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_a_tied_checkpoint_matches_transformers_with_the_embedding_as_its_head(tmp_path):
    from transformers import FlaxLlamaForCausalLM  # the reference; its Flax Llama has no tying, so it gets a copy

    tied = write_llama_folder(tmp_path / "tied", tie_word_embeddings=True, num_key_value_heads=4)
    cfg = json.loads((tied / "config.json").read_text())
    tensors = llama_tensors(cfg)
    assert "lm_head.weight" not in tensors
    copy = write_llama_folder(tmp_path / "copy", {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]},
                              tokenizer_from=tied / "tokenizer.json", num_key_value_heads=4)
    _, model = hf.load(tied, ["model.attention=xla"])
    assert model.lm_head is None
    ids = random_ids((1, T))
    np.testing.assert_allclose(logits(model, ids), np.asarray(FlaxLlamaForCausalLM.from_pretrained(copy)(ids).logits),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_an_export_loads_in_transformers_with_the_same_logits_and_tokens(tokenizer, tmp_path):
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM  # the reference, as a user would load it

    config = load_config(None, TINY + ["model.n_kv_heads=2", "model.tie_embeddings=false", "model.norm_eps=1e-5"])
    model = build_model(config, 300, rngs=nnx.Rngs(5))
    export_and_import(model, tokenizer, tmp_path / "hf")
    reference = FlaxAutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = random_ids((2, T))
    np.testing.assert_allclose(np.asarray(reference(ids).logits), logits(model, ids), rtol=1e-5, atol=1e-5)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "the cat sat on a mat"
    # transformers' default call opens with end-of-text, as every seqjax training sequence does
    assert hf_tokenizer(text).input_ids == [tokenizer.eot_id] + tokenizer.encode(text)
    assert hf_tokenizer.eos_token == "<|endoftext|>" and hf_tokenizer.decode(tokenizer.encode(text)) == text


# ---------------------------------------------------------------------------
# RoPE scaling


def test_llama3_frequencies_match_a_hand_computed_case():
    # head_dim 4, theta 10000: frequencies 1 and 0.01, wavelengths 2 pi and 200 pi. With a pretraining
    # context of 1000, low 1, high 4: 2 pi < 1000 / 4 is kept; 200 pi lies between 250 and 1000, so it mixes
    # f / 8 and f with s = (1000 / (200 pi) - 1) / 3.
    scaling = RopeScalingConfig(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=1000)
    s = (1000 / (200 * math.pi) - 1) / 3
    expected = [1.0, (1 - s) * 0.01 / 8 + s * 0.01]
    np.testing.assert_allclose(np.asarray(rope_frequencies(4, 10000.0, scaling)), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rope_frequencies(4, 10000.0, None)), [1.0, 0.01], rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([8, 16, 64, 128]), st.floats(2.0, 64.0), st.floats(0.5, 2.0), st.floats(2.5, 8.0),
       st.integers(16, 8192))
def test_llama3_keeps_high_frequencies_slows_low_ones_and_mixes_between(head_dim, factor, low, high, context):
    scaling = RopeScalingConfig(type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                                original_max_position_embeddings=context)
    plain = np.asarray(rope_frequencies(head_dim, 500000.0), np.float64)
    scaled = np.asarray(rope_frequencies(head_dim, 500000.0, scaling), np.float64)
    wavelength = 2 * np.pi / plain
    short, long_ = wavelength < context / high, wavelength > context / low
    np.testing.assert_allclose(scaled[short], plain[short], rtol=1e-6)
    np.testing.assert_allclose(scaled[long_], plain[long_] / factor, rtol=1e-5)
    between = ~short & ~long_
    assert np.all(scaled[between] <= plain[between] * (1 + 1e-6))
    assert np.all(scaled[between] >= plain[between] / factor * (1 - 1e-6))


# ---------------------------------------------------------------------------
# Bad folders


def refused(folder, match):
    with pytest.raises(CheckpointError, match=match):
        hf.read_params(hf.read_folder(folder))


@pytest.mark.parametrize("fields, match", [
    ({"architectures": ["Gemma2ForCausalLM"]}, r"config\.json: architectures: got \['Gemma2ForCausalLM'\], expected "
                                               r"one of 'LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM'"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "qwen2"},
     r"config\.json: model_type: got 'qwen2', expected 'llama'"),
    ({"attention_bias": True}, r"config\.json: attention_bias: got True, expected false"),
    ({"mlp_bias": True}, r"config\.json: mlp_bias: got True, expected false"),
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act: got 'gelu', expected 'silu'"),
    ({"sliding_window": 4096}, r"config\.json: sliding_window: got 4096"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     r"config\.json: rope_scaling\.rope_type: got 'longrope'"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, r"config\.json: rope_scaling\.rope_type: got 'longrope'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_parameters\.rope_type: got 'dynamic'"),
    # (a string, which transformers refuses: never read as no scaling, beside transformers 5's rope_parameters too)
    ({"rope_scaling": "linear"}, r"config\.json: rope_scaling: got 'linear', expected a mapping"),
    ({"rope_scaling": "linear", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     r"config\.json: rope_scaling: got 'linear', expected a mapping"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
     r"config\.json: rope_scaling: got .*linear.*, expected null, or the scaling rope_parameters gives"),
    ({"num_key_value_heads": 3}, r"config\.json: model\.n_kv_heads: got 3, expected a divisor"),
])
def test_unsupported_config_fields_are_refused_naming_the_file_field_and_value(fields, match, tmp_path):
    folder = write_llama_folder(tmp_path / "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | fields))
    with pytest.raises(CheckpointError, match=match):
        hf.read_folder(folder)


def test_missing_shard_missing_tensor_extra_tensor_and_bad_shape_are_refused(tmp_path):
    folder = write_llama_folder(tmp_path / "llama")
    cfg = json.loads((folder / "config.json").read_text())
    tensors = llama_tensors(cfg)
    names = sorted(tensors)
    (folder / hf.WEIGHTS).unlink()
    save_file({n: tensors[n] for n in names[:10]}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names[:10]}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in names[10:]}
    (folder / hf.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map puts .* in model-00002-of-00002"
                                              r"\.safetensors, which is missing"):
        hf.read_folder(folder)
    # a shard path that leaves the folder is never read, though the file is there (transformers reads it)
    save_file({n: tensors[n] for n in names[10:]}, str(tmp_path / "outside.safetensors"))
    outside = {n: "model-00001-of-00002.safetensors" for n in names[:10]} | {
        n: "../outside.safetensors" for n in names[10:]}
    (folder / hf.INDEX).write_text(json.dumps({"weight_map": outside}))
    with pytest.raises(CheckpointError, match=r"weight_map puts .* in \.\./outside\.safetensors, outside "):
        hf.read_folder(folder)

    save_file({n: tensors[n] for n in names[10:] if n != "model.norm.weight"},
              str(folder / "model-00002-of-00002.safetensors"))
    (folder / hf.INDEX).write_text(json.dumps({"weight_map": {n: f for n, f in weight_map.items()
                                                              if n != "model.norm.weight"}}))
    refused(folder, r"index\.json: tensor model\.norm\.weight is missing")

    single = write_llama_folder(tmp_path / "extra", {**tensors, "model.layers.0.self_attn.q_proj.bias":
                                                     np.zeros(32, np.float32)})
    refused(single, r"model\.safetensors: holds tensors .* no place for: model\.layers\.0\.self_attn\.q_proj\.bias")

    bad = write_llama_folder(tmp_path / "shape", {**tensors, "model.norm.weight": np.ones(31, np.float32)})
    refused(bad, r"model\.safetensors: tensor model\.norm\.weight has shape \(31,\), expected \(32,\)")


def test_a_folder_without_weights_or_tokenizer_is_refused_by_the_import_cli_in_one_line(tmp_path, capsys):
    from seqjax.main import import_hf

    folder = write_llama_folder(tmp_path / "llama")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as exit_:
        import_hf.main([str(folder), "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder}: no tokenizer.json" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    (folder / hf.WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match=r"expected model\.safetensors or model\.safetensors\.index\.json"):
        hf.read_folder(folder)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_import_writes_a_run_folder_that_eval_generate_and_export_read(tmp_path, capsys):
    from seqjax.core.errors import CheckpointMismatchError
    from seqjax.main import import_hf
    from seqjax.train.checkpoint import Checkpointer
    from seqjax.weights.inference import load_for_inference

    folder = write_llama_folder(tmp_path / "llama", rope_theta=500000.0, head_dim=16)
    import_hf.main([str(folder), "--out", str(tmp_path / "run"), "model.attention=xla"])
    # the log names the config where it is, not in the staging folder renamed into place (run.partial)
    err = capsys.readouterr().err
    assert f"resolved config: {tmp_path / 'run' / 'config.yaml'} " in err and ".partial" not in err
    config, model = load_for_inference(tmp_path / "run")
    assert config.tokenizer.path == str(tmp_path / "run" / "tokenizer.json")
    assert config.model.rope_theta == 500000.0 and config.model.head_dim == 16 and config.data.variant == "raw"
    assert config.tokenizer.vocab_size == 300  # the imported tokenizer's own size, in the saved config.yaml
    _, direct = hf.load(folder, ["model.attention=xla"])
    ids = random_ids((1, T))
    np.testing.assert_array_equal(logits(model, ids), logits(direct, ids))
    checkpoints = Checkpointer(tmp_path / "run", config.train)  # training there: refused, the import kept
    try:
        with pytest.raises(CheckpointMismatchError, match=r"holds parameters only .* train.init_from=.*run"):
            checkpoints.restore_latest({}, {}, jax.numpy.zeros(2, jax.numpy.uint32), config, {})
    finally:
        checkpoints.close()
    assert load_for_inference(tmp_path / "run")[0].model == config.model
    with pytest.raises(SystemExit) as exit_:  # nothing already written is lost
        import_hf.main([str(folder), "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    jax.clear_caches()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_the_model_reads_head_dim_norm_eps_and_rope_scaling_from_its_config():
    base = load_config(None, TINY)
    ids = random_ids((1, T))
    reference = logits(build_model(base, 300, rngs=nnx.Rngs(0)), ids)
    for change in (["model.norm_eps=0.5"], ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=4.0",
                                            "model.rope_scaling.original_max_position_embeddings=8"]):
        changed = logits(build_model(load_config(None, TINY + change), 300, rngs=nnx.Rngs(0)), ids)
        assert not np.allclose(changed, reference, atol=1e-4), change
    wide = build_model(load_config(None, TINY + ["model.head_dim=16"]), 300, rngs=nnx.Rngs(0))
    assert wide.blocks[0].attn.wq.shape == (32, 4, 16) and wide.blocks[0].attn.wo.shape == (4, 16, 32)


def test_the_new_model_fields_have_defaults_of_todays_model_and_rules_that_name_the_key(tmp_path):
    config = load_config(None, TINY)
    assert (config.model.head_dim, config.model.norm_eps, config.model.rope_scaling.type) == (8, 1e-6, "none")
    assert load_config(None, TINY + ["model.head_dim=12"]).model.head_dim == 12  # any even width, 32 / 4 or not
    with pytest.raises(ConfigError, match=r"model.head_dim: got 7 \(model.rope_fraction 1.0: RoPE turns 7\), "
                                          "expected an even number"):
        load_config(None, TINY + ["model.head_dim=7"])
    with pytest.raises(ConfigError, match="model.n_heads: got 3, expected a divisor of model.d_model=32 "
                                          r"\(or set model.head_dim\)"):
        load_config(None, TINY + ["model.n_heads=3", "model.n_kv_heads=1"])
    with pytest.raises(ConfigError, match="model.rope_scaling.type: got 'longrope', expected one of none, linear, "
                                          "llama3, yarn"):
        load_config(None, TINY + ["model.rope_scaling.type=longrope"])
    with pytest.raises(ConfigError, match="model.rope_scaling.high_freq_factor: got 1.0, expected more than "
                                          "model.rope_scaling.low_freq_factor=2.0"):
        load_config(None, TINY + ["model.rope_scaling.type=llama3", "model.rope_scaling.low_freq_factor=2.0",
                                  "model.rope_scaling.high_freq_factor=1.0"])
    scaled = load_config(None, TINY + ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=32.0"])
    assert load_config(scaled.save(tmp_path / "config.yaml")) == scaled  # the nested section survives YAML


def _refused_cli(main, argv, capsys) -> str:
    capsys.readouterr()  # what earlier calls printed
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_import_and_export_refuse_a_non_empty_out_folder_and_overwrite_replaces_it_whole(tmp_path, capsys):
    from seqjax.main import export, import_hf

    folder = write_llama_folder(tmp_path / "llama")
    run, exported = tmp_path / "run", tmp_path / "hf"
    for out in (run, exported):
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    err = _refused_cli(import_hf.main, [str(folder), "--out", str(run)], capsys)
    assert f"--out {run}: not empty (holds notes.txt)" in err and "--overwrite" in err
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    import_hf.main([str(folder), "--out", str(run), "--overwrite", "model.attention=xla"])
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "tokenizer.json"]

    err = _refused_cli(export.main, ["--run", str(run), "--out", str(exported)], capsys)
    assert f"--out {exported}: not empty (holds notes.txt)" in err
    assert (exported / "notes.txt").read_text() == "mine"
    export.main(["--run", str(run), "--out", str(exported), "--overwrite"])
    assert (exported / hf.WEIGHTS).is_file() and not (exported / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "llama", "run"]  # no staging folder left
    jax.clear_caches()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_a_failed_export_leaves_nothing_half_written(tmp_path, monkeypatch):
    from seqjax.main import export, import_hf

    import_hf.main([str(write_llama_folder(tmp_path / "llama")), "--out", str(tmp_path / "run"),
                    "model.attention=xla"])

    def fail_half_way(out, *args, **kwargs):
        (out / hf.CONFIG_JSON).write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_folder", fail_half_way)
    with pytest.raises(OSError, match="disk full"):
        export.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "run"]
    jax.clear_caches()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_export_keeps_the_pad_token_and_writes_files_other_users_can_read(tmp_path):
    """The tokenizer's pad token survives import -> export (transformers reads it back), and every exported file
    has the umask's mode (safetensors wrote model.safetensors 0600)."""
    from transformers import AutoTokenizer

    from seqjax.main import export, import_hf

    folder = write_chat_llama_folder(tmp_path / "llama")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": "</s>"}))
    import_hf.main([str(folder), "--out", str(tmp_path / "run"), "model.attention=xla"])
    old = os.umask(0o022)
    try:
        export.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    finally:
        os.umask(old)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.pad_token == "</s>" and tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert json.loads((tmp_path / "hf" / hf.CONFIG_JSON).read_text())["pad_token_id"] == tokenizer.pad_token_id
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()} == {
        p.name: "0o644" for p in (tmp_path / "hf").iterdir()}
    jax.clear_caches()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_an_export_takes_over_staging_left_by_a_killed_one_and_an_unwritable_parent_is_one_line(tmp_path, capsys):
    from seqjax.main import export, import_hf

    import_hf.main([str(write_llama_folder(tmp_path / "llama")), "--out", str(tmp_path / "run"),
                    "model.attention=xla"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".hf.{int(dead.stdout)}.partial"  # an export killed while it wrote
    stale.mkdir()
    (stale / hf.CONFIG_JSON).write_text("{")
    live = tmp_path / f".hf.{os.getppid()}.partial"  # a live process's: not ours to remove
    live.mkdir()
    export.main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert not stale.exists() and live.is_dir() and (tmp_path / "hf" / hf.WEIGHTS).is_file()

    # A parent the export cannot write in (a read-only folder for a user; here, for any user, a file).
    blocked = tmp_path / "notes.txt"
    blocked.write_text("mine")
    err = _refused_cli(export.main, ["--run", str(tmp_path / "run"), "--out", str(blocked / "hf")], capsys)
    assert f"--out {blocked / 'hf'}: cannot write in {blocked}" in err and blocked.read_text() == "mine"
    jax.clear_caches()


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_non_finite_weights_are_refused_where_they_are_read_naming_the_tensor(tmp_path, capsys):
    """A NaN weight used to import with exit 0, then generate nothing and score null perplexities."""
    import shutil

    from seqjax.main import import_hf
    from seqjax.train.checkpoint import save_params
    from seqjax.weights.inference import load_for_inference

    tensors = llama_tensors(dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.inf
    bad = write_llama_folder(tmp_path / "bad", tensors)
    err = _refused_cli(import_hf.main, [str(bad), "--out", str(tmp_path / "run")], capsys)
    assert "tensor model.layers.1.mlp.up_proj.weight holds 1 non-finite value(s)" in err and "index (3, 5)" in err
    assert not (tmp_path / "run").exists()

    good = write_llama_folder(tmp_path / "good")
    import_hf.main([str(good), "--out", str(tmp_path / "run"), "model.attention=xla"])
    _, model = load_for_inference(tmp_path / "run")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params["blocks"][0]["attn"]["wq"] = np.asarray(params["blocks"][0]["attn"]["wq"]).copy()
    params["blocks"][0]["attn"]["wq"][0, 1, 2] = np.nan
    (tmp_path / "nan").mkdir()
    shutil.copyfile(tmp_path / "run" / "config.yaml", tmp_path / "nan" / "config.yaml")
    save_params(tmp_path / "nan", 0, params, {"tokens_seen": 0})
    with pytest.raises(CheckpointError, match=r"params: tensor blocks/0/attn/wq holds 1 non-finite value"):
        load_for_inference(tmp_path / "nan")
    jax.clear_caches()


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_a_folder_with_both_a_single_file_and_an_index_loads_the_weights_transformers_loads(tmp_path, caplog):
    from transformers import FlaxLlamaForCausalLM  # the reference

    folder = write_llama_folder(tmp_path / "both", seed=0)  # model.safetensors: seed 0
    cfg = json.loads((folder / "config.json").read_text())
    other = llama_tensors(cfg, seed=1)  # shards and an index with other weights beside it
    names = sorted(other)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, group in shards.items():
        save_file({n: other[n] for n in group}, str(folder / file), metadata={"format": "pt"})
    (folder / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        n: file for file, group in shards.items() for n in group}}))
    ids = random_ids((1, T))
    expected = np.asarray(FlaxLlamaForCausalLM.from_pretrained(folder)(ids).logits)
    with caplog.at_level("WARNING", logger="seqjax.hf.folders"):
        _, model = hf.load(folder, ["model.attention=xla"])
    np.testing.assert_allclose(logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    assert "holds both model.safetensors and model.safetensors.index.json: reading model.safetensors" in caplog.text
    (folder / hf.WEIGHTS).unlink()  # the shards alone are other weights: the test tells the two apart
    _, sharded = hf.load(folder, ["model.attention=xla"])
    assert not np.allclose(logits(sharded, ids), expected, atol=1e-3)
    jax.clear_caches()
