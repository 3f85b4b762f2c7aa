"""The mixture-of-experts families compute what transformers 5's own models compute: Qwen3-MoE, Mixtral, gpt-oss.

The references (tests/data/moe/<family>.{json,safetensors}) were made by transformers itself, from the committed
script scripts/make_moe_references.py: tiny random folders saved as transformers saves them (per-expert tensors
for Qwen3-MoE and Mixtral, fused ones for gpt-oss) and loaded back by ``from_pretrained``. The weights are
rebuilt here from each tensor's name; only transformers' outputs are stored. Checked: logits alone and packed,
each layer's router choices, the load-balancing loss of the padded batch with its mask against a packed row's,
greedy tokens, MXFP4 experts dequantized as transformers does, and an export that reads back the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_support import script_module, tiny_tokenizer
from seqjax.core.errors import CheckpointError
from seqjax.engine import generate
from seqjax.hf import folders as hf
from seqjax.model.experts import load_balancing_loss

REFERENCES = Path(__file__).parent / "data" / "moe"
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]
EACH = [f if f == "gpt_oss" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
SCRIPT = script_module("make_moe_references")


def reference(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    return json.loads((REFERENCES / f"{name}.json").read_text()), load_file(str(REFERENCES / f"{name}.safetensors"))


def hf_folder(name: str, folder: Path) -> Path:
    record, _ = reference(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(record["config"]))
    save_file(SCRIPT.reference_weights(record["tensors"], record.get("dtypes")), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tiny_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def load(name: str, tmp_path: Path, *overrides: str):
    folder = hf.read_folder(hf_folder(name, tmp_path / name))
    config = hf.run_config(folder, ["model.attention=xla", *overrides])
    return hf.model_with_params(config, hf.read_params(folder)), folder


def forward(model, ids: np.ndarray, segment_ids: np.ndarray | None = None, positions: np.ndarray | None = None):
    """(logits [T, V], the router terms) of one row, the forward compiled (one program a shape)."""
    ids = jnp.asarray(ids)[None]
    seg = jnp.ones_like(ids) if segment_ids is None else jnp.asarray(segment_ids)[None]
    pos = jnp.arange(ids.shape[1])[None] if positions is None else jnp.asarray(positions)[None]
    logits, terms = _forward(*nnx.split(model), ids, pos, seg)
    return np.asarray(logits)[0], terms


@jax.jit
def _forward(graphdef, state, ids, positions, segment_ids):
    features, head, terms = nnx.merge(graphdef, state).forward(ids, positions=positions, segment_ids=segment_ids)
    return features @ head, terms


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Equal to 1e-5 relative to the logits' scale (float32 on both sides)."""
    scale = float(np.abs(theirs).max())
    assert float(np.abs(ours - theirs).max()) <= 1e-5 * scale, (float(np.abs(ours - theirs).max()), scale)


def routes(model, ids: np.ndarray) -> list[np.ndarray]:
    """Each expert layer's top-k experts of each token, as transformers orders them (the router's logits)."""
    return [np.asarray(r) for r in _routes(*nnx.split(model), jnp.asarray(ids))]


@jax.jit
def _routes(graphdef, state, ids) -> list[jax.Array]:
    model = nnx.merge(graphdef, state)
    x = model.embed_tokens(ids[None])
    pos, seg = jnp.arange(len(ids))[None], jnp.ones((1, len(ids)), jnp.int32)
    out, freqs = [], model.rope_freqs()
    for i in range(model.cfg.n_layers):
        block = model.layer(i)
        attended = x + block.attn(block.attn_norm(x), pos, seg, freqs[i], model.cfg.window_of(i))
        if model.cfg.mlp_of(i) == "experts":
            logits, _, _ = block.mlp.experts.route(block.mlp_norm(attended)[0])
            out.append(jax.lax.top_k(logits, model.cfg.experts.top_k)[1])
        x, _ = block(x, pos, seg, freqs[i], model.cfg.window_of(i))
    return out


@pytest.mark.parametrize("family", EACH)
def test_logits_and_routes_equal_transformers_alone_and_packed(family, tmp_path):
    """Each sequence alone, then both packed in one row: transformers' logits, and each expert layer's choices
    (a packed document is routed as it is alone)."""
    model, _ = load(family, tmp_path)
    assert model.cfg.family == family and model.cfg.experts.enabled
    record, ref = reference(family)
    for name in ("seq0", "seq1"):
        ours, _ = forward(model, ref[f"{name}.ids"])
        assert_close(ours, ref[f"{name}.logits"])
        sparse = sum(model.cfg.mlp_of(i) == "experts" for i in range(model.cfg.n_layers))
        theirs = [ref[f"{name}.router.{j}"] for j in range(sparse)]  # (transformers': its expert layers')
        for layer, (a, b) in enumerate(zip(routes(model, ref[f"{name}.ids"]), theirs)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} layer {layer}")
    a, b = ref["seq0.ids"], ref["seq1.ids"]
    packed, terms = forward(model, np.concatenate([a, b]), np.r_[np.ones(len(a), int), np.full(len(b), 2)],
                            np.r_[np.arange(len(a)), np.arange(len(b))])
    assert_close(packed[: len(a)], ref["seq0.logits"])
    assert_close(packed[len(a):], ref["seq1.logits"])
    jax.clear_caches()


@pytest.mark.parametrize("family", EACH)
def test_a_packed_rows_load_balancing_loss_is_the_padded_batchs_with_its_mask(family, tmp_path):
    """transformers' load_balancing_loss_func over the two sequences padded into one batch with their attention
    mask; seqjax's over the same two packed in one row, with padding after them, and over the padded batch
    itself (padding never counts)."""
    model, _ = load(family, tmp_path)
    _, ref = reference(family)
    a, b = ref["seq0.ids"], ref["seq1.ids"]
    k = model.cfg.experts.top_k
    ids = np.concatenate([a, b, np.zeros(5, np.int32)])
    seg = np.r_[np.ones(len(a), int), np.full(len(b), 2), np.zeros(5, int)]
    pos = np.r_[np.arange(len(a)), np.arange(len(b)), np.zeros(5, int)]
    _, terms = forward(model, ids, seg, pos)
    expected = float(ref["padded.aux_loss"])
    assert float(load_balancing_loss(terms, k)) == pytest.approx(expected, rel=1e-5)
    width = max(len(a), len(b))
    batch = np.stack([np.pad(s, (0, width - len(s))) for s in (a, b)])
    mask = np.stack([np.pad(np.ones(len(s), int), (0, width - len(s))) for s in (a, b)])
    _, padded = _forward(*nnx.split(model), jnp.asarray(batch), jnp.tile(jnp.arange(width), (2, 1)),
                         jnp.asarray(mask))
    assert float(load_balancing_loss(padded, k)) == pytest.approx(expected, rel=1e-5)
    jax.clear_caches()


@pytest.mark.slow  # (the full suite; the fast loop keeps the logits and routes against transformers)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(family, tmp_path):
    model, _ = load(family, tmp_path)
    _, ref = reference(family)
    (out,) = generate(model, [ref["prompt.ids"].tolist()], eot_id=None, max_new_tokens=len(ref["greedy.ids"]))
    assert out.tokens == ref["greedy.ids"].tolist()
    jax.clear_caches()


def test_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
    """gpt-oss's experts stored as MXFP4 blocks and scales: the imported weights are transformers' own
    dequantization of them (convert_moe_packed_tensors), laid out as seqjax keeps them."""
    folder = hf.read_folder(hf_folder("gpt_oss_mxfp4", tmp_path / "mxfp4"))
    params = hf.read_params(folder)
    _, theirs = reference("gpt_oss_mxfp4")
    for i in range(folder.model.n_layers):
        experts = params["blocks"][i]["mlp"]["experts"]
        gate_up = theirs[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(experts["w_gate"], gate_up[..., ::2])
        np.testing.assert_array_equal(experts["w_up"], gate_up[..., 1::2])
        np.testing.assert_array_equal(experts["w_down"], theirs[f"model.layers.{i}.mlp.experts.down_proj"])


def test_an_export_reads_back_the_same_model(tmp_path):
    """seqjax's export of each family holds transformers' tensor names (per-expert or fused, as the family
    stores them) and reads back to the same parameters."""
    from seqjax.hf.tensors import hf_shapes, to_hf

    for family in FAMILIES:
        record, _ = reference(family)
        folder = hf.read_folder(hf_folder(family, tmp_path / family))
        params = hf.read_params(folder)
        tensors = to_hf(params, folder.model)
        assert set(tensors) == set(record["tensors"]) == set(hf_shapes(folder.model))
        rebuilt = SCRIPT.reference_weights(record["tensors"])
        for name, value in tensors.items():
            np.testing.assert_array_equal(value, rebuilt[name], err_msg=f"{family} {name}")


@pytest.mark.parametrize("field, value, message", [
    ("shared_expert_intermediate_size", 64, "shared_expert_intermediate_size: got 64, expected null or 0"),
    ("n_group", 4, "n_group: got 4, expected null or 1 (no group-limited routing)"),
    ("kv_lora_rank", 32, "kv_lora_rank: got 32, expected null (no multi-head latent attention)"),
    ("scoring_func", "sigmoid", "scoring_func: got 'sigmoid', expected softmax"),
])
def test_moe_features_seqjax_does_not_compute_are_one_line_naming_the_field(field, value, message, tmp_path):
    record, _ = reference("qwen3_moe")
    folder = hf_folder("qwen3_moe", tmp_path / "q")
    (folder / "config.json").write_text(json.dumps({**record["config"], field: value}))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf.read_folder(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_seqjax_export_with_equal_logits(family, tmp_path):
    """Live, where torch and transformers >= 5.24 import: seqjax's export of each family, loaded by transformers'
    AutoModelForCausalLM, gives the reference's logits (per-expert or fused tensors as the family stores them)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip("transformers >= 5.24 computes these families as the references were made")
    folder = hf.read_folder(hf_folder(family, tmp_path / family))
    hf.write_folder(tmp_path / "export", folder.model, hf.read_params(folder), tokenizer_json=folder.tokenizer,
                    eos_token="<|endoftext|>", bos_token=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    _, ref = reference(family)
    with torch.no_grad():
        ours = model(torch.tensor([ref["seq0.ids"].tolist()])).logits[0].numpy()
    assert_close(ours, ref["seq0.logits"])


@pytest.mark.parametrize("family", ["gpt_oss", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_peft_adapters_on_the_experts_compute_and_export_as_peft_does(family, tmp_path):
    """A PEFT adapter folder with LoRA on q_proj, v_proj and, by target_parameters, on every expert layer's fused
    gate_up_proj and down_proj (peft 0.21's ParamWrapper; gpt-oss's gate and up interleaved), read onto its
    base: peft's own logits. Exported again, every tensor is the one read, under peft's names (the first
    targeted parameter nested as base_layer), with the same target_parameters."""
    from seqjax.hf import peft as hf_peft
    from seqjax.weights.inference import with_adapter

    record = json.loads((REFERENCES / f"{family}-lora.json").read_text())
    theirs = load_file(str(REFERENCES / f"{family}-lora.safetensors"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(record["adapter_config"]))
    drawn = SCRIPT.reference_weights(record["tensors"])
    save_file(drawn, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    folder = hf.read_folder(hf_folder(family, tmp_path / family))
    config = hf.run_config(folder, ["model.attention=xla"])
    base = hf.model_with_params(config, hf.read_params(folder))
    config, model = with_adapter(config, base, str(adapter))
    assert {"experts_gate_up", "experts_down"} <= set(config.model.lora.targets)
    ours, _ = forward(model, theirs["seq0.ids"])
    assert_close(ours, theirs["seq0.logits"])
    from flax import nnx

    trained = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    exported = hf_peft.to_peft(trained, config.model)
    assert set(exported) == set(drawn)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, drawn[name], err_msg=name)
    written = hf_peft.adapter_config(config.model, None)
    assert sorted(written["target_parameters"]) == sorted(record["adapter_config"]["target_parameters"])
