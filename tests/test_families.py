"""Every family seqjax loads computes what transformers' own model computes: logits, packed rows, greedy tokens.

The references (tests/data/families/<family>.{json,safetensors}) were made by transformers 5 itself, from a
committed script (scripts/make_family_references.py), on small random models that exercise what each family
computes: Qwen2's biases, Qwen3's q/k norms, Gemma 3's (1 + w) norms, GeGLU, embedding scale,
query_pre_attn_scalar, interleaved sliding layers with their own RoPE base, Mistral's and Qwen's sliding
windows, Llama 3.1's RoPE scaling. The weights are rebuilt here from each tensor's name (the script's
``reference_weights``), so only transformers' outputs are stored. Where torch imports, a live test also loads
seqjax's export in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_support import script_module, tiny_tokenizer
from model_support import compiled_logits
from seqjax.core.errors import CheckpointError
from seqjax.engine import generate
from seqjax.hf import families
from seqjax.hf import folders as hf

REFERENCES = Path(__file__).parent / "data" / "families"
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
# The fast loop checks Gemma 3 (the family that differs most); the full suite every family.
EACH = [f if f == "gemma3" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


SCRIPT = script_module("make_family_references")  # its reference_weights rebuild the references' weights


def reference(family: str) -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((REFERENCES / f"{family}.json").read_text()), load_file(str(REFERENCES / f"{family}.safetensors"))


def hf_folder(family: str, folder: Path) -> Path:
    """The reference model as an HF folder: transformers' config.json, the weights rebuilt by name, a tokenizer."""
    record, _ = reference(family)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(record["config"]))
    save_file(SCRIPT.reference_weights(record["tensors"]), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tiny_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def load(family: str, tmp_path: Path, *overrides: str):
    folder = hf.read_folder(hf_folder(family, tmp_path / family))
    config = hf.run_config(folder, ["model.attention=xla", *overrides])
    return hf.model_with_params(config, hf.read_params(folder)), folder


def logits(model, ids: np.ndarray, segment_ids: np.ndarray | None = None, positions: np.ndarray | None = None):
    """One row's float32 logits [T, V], the forward compiled (one program a shape, not an op at a time)."""
    ids = jnp.asarray(ids)[None]
    seg = jnp.ones_like(ids) if segment_ids is None else jnp.asarray(segment_ids)[None]
    pos = jnp.arange(ids.shape[1])[None] if positions is None else jnp.asarray(positions)[None]
    return np.asarray(compiled_logits(model, ids, pos, seg))[0]


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Equal to 1e-5 relative to the logits' scale (float32 on both sides)."""
    scale = float(np.abs(theirs).max())
    assert float(np.abs(ours - theirs).max()) <= 1e-5 * scale, (float(np.abs(ours - theirs).max()), scale)


def assert_packed_rows_are_each_alone(model, ref) -> None:
    """Both reference sequences packed into one row (segments 1 and 2, positions restarting): each gives
    transformers' logits for it alone."""
    a, b = ref["seq0.ids"], ref["seq1.ids"]
    packed = logits(model, np.concatenate([a, b]), np.r_[np.ones(len(a), int), np.full(len(b), 2)],
                    np.r_[np.arange(len(a)), np.arange(len(b))])
    assert_close(packed[: len(a)], ref["seq0.logits"])
    assert_close(packed[len(a):], ref["seq1.logits"])


@pytest.mark.parametrize("family", EACH)
def test_logits_equal_transformers_own_model_alone_and_packed(family, tmp_path):
    model, folder = load(family, tmp_path)
    assert model.cfg.family == family
    _, ref = reference(family)
    for name in ("seq0", "seq1"):
        assert_close(logits(model, ref[f"{name}.ids"]), ref[f"{name}.logits"])
    assert_packed_rows_are_each_alone(model, ref)
    jax.clear_caches()


@pytest.mark.parametrize("family", EACH)
def test_a_tied_config_with_its_own_head_in_the_file_computes_transformers_logits(family, tmp_path):
    """config.json says tie_word_embeddings, the folder holds a different lm_head.weight: transformers 5 keeps the
    file's head, untied, and seqjax reads the folder the same way (logits equal to transformers' own)."""
    record, ref = reference(family)
    folder = hf_folder(family, tmp_path / family)
    (folder / "config.json").write_text(json.dumps({**record["config"], "tie_word_embeddings": True}))
    shapes = {**record["tensors"], "lm_head.weight": record["tensors"]["model.embed_tokens.weight"]}
    save_file(SCRIPT.reference_weights(shapes), str(folder / "model.safetensors"), metadata={"format": "pt"})
    read = hf.read_folder(folder)
    assert read.model.tie_embeddings is False
    model = hf.model_with_params(hf.run_config(read, ["model.attention=xla"]), hf.read_params(read))
    assert_close(logits(model, ref["seq0.ids"]), ref["tied_own_head.seq0.logits"])
    jax.clear_caches()


@pytest.mark.parametrize("family", EACH)
def test_greedy_tokens_equal_transformers_generate(family, tmp_path):
    model, _ = load(family, tmp_path)
    _, ref = reference(family)
    (out,) = generate(model, [ref["prompt.ids"].tolist()], eot_id=None, max_new_tokens=len(ref["greedy.ids"]))
    assert out.tokens == ref["greedy.ids"].tolist()
    jax.clear_caches()


@pytest.mark.parametrize("family", ["gemma3", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_scanned_layers_give_the_same_logits_with_per_layer_windows_and_rope(family, tmp_path):
    """model.scan_layers runs one traced block for all layers: sliding and full layers, and Gemma 3's two RoPE
    bases, ride along as scanned inputs."""
    model, _ = load(family, tmp_path, "model.scan_layers=true")
    _, ref = reference(family)
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.parametrize("family", EACH)
def test_export_writes_back_the_same_tensors_and_the_family_config_transformers_read(family, tmp_path):
    model, folder = load(family, tmp_path)
    record, _ = reference(family)
    out = tmp_path / "export"
    hf.write_folder(out, model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokenizer_json=folder.tokenizer,
                    eos_token=folder.eos_token, bos_token=folder.bos_token)
    written = load_file(str(out / hf.WEIGHTS))
    weights = SCRIPT.reference_weights(record["tensors"])
    assert set(written) == set(weights)
    for name, tensor in weights.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    exported = json.loads((out / "config.json").read_text())
    again = families.model_config_from_hf(exported, "export")
    computes = [f.name for f in dataclasses.fields(again) if f.name not in ("attention", "init_std")]
    assert {k: getattr(again, k) for k in computes} == {k: getattr(model.cfg, k) for k in computes}
    for key in ("architectures", "model_type", "tie_word_embeddings", "num_key_value_heads", "sliding_window"):
        assert exported.get(key) == record["config"].get(key), key
    jax.clear_caches()


def test_every_field_that_changes_the_model_is_read_or_refused():
    record, _ = reference("gemma3")
    base = record["config"]
    for field, value, message in [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping: got 30.0, expected null"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping: got 50.0, expected null"),
        ("hidden_activation", "gelu", "hidden_activation: got 'gelu', expected 'gelu_pytorch_tanh'"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention: got True, expected false"),
        ("attention_bias", True, "attention_bias: got True, expected false"),
        ("architectures", ["Gemma3ForConditionalGeneration"], "architectures: got ['Gemma3ForConditionalGeneration']"),
    ]:
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
            families.model_config_from_hf({**base, field: value}, "config.json")
    qwen3 = reference("qwen3")[0]["config"]
    with pytest.raises(CheckpointError, match="attention_bias: got True, expected false"):
        families.model_config_from_hf({**qwen3, "attention_bias": True}, "config.json")
    bad_rope = {**qwen3, "rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}}
    with pytest.raises(CheckpointError, match="rope_parameters.rope_type: got 'longrope'"):
        families.model_config_from_hf(bad_rope, "config.json")
    # transformers 4's spelling of Gemma 3's RoPE (rope_theta, rope_local_base_freq, rope_scaling) reads the same
    old = {k: v for k, v in base.items() if k != "rope_parameters"} | {
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert families.model_config_from_hf(old, "c") == families.model_config_from_hf(base, "c")


@pytest.mark.slow  # (the fast loop: tests/test_flash.py's sliding windows against the dense mask)
@pytest.mark.parametrize("backend", ["pallas", "splash"])
@pytest.mark.parametrize("scan", [False, True])
def test_the_kernels_compute_sliding_layers_as_transformers_does(backend, scan, tmp_path):
    """Gemma 3's sliding (window 4) and global layers on the flash kernel and on splash (both in interpret mode
    here), packed: each document's logits are transformers' own. Under scan_layers the window is traced, so the
    flash kernel reads it from per-layer metadata and splash picks one of its two static masks."""
    model, _ = load("gemma3", tmp_path, f"model.attention={backend}", f"model.scan_layers={str(scan).lower()}")
    assert_packed_rows_are_each_alone(model, reference("gemma3")[1])
    jax.clear_caches()


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_seqjax_export_with_equal_logits(family, tmp_path):
    """Live, where torch imports: seqjax's export, loaded by transformers' AutoModelForCausalLM."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers >= 5 has these families in PyTorch")
    model, folder = load(family, tmp_path)
    hf.write_folder(tmp_path / "export", model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                    tokenizer_json=folder.tokenizer, eos_token=folder.eos_token, bos_token=folder.bos_token)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    _, ref = reference(family)
    with torch.no_grad():
        out = theirs(torch.tensor(ref["seq0.ids"][None].astype(np.int64))).logits[0].numpy()
    assert_close(logits(model, ref["seq0.ids"]), out)
