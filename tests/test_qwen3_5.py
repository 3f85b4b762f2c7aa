"""Qwen3.5's text model computes what transformers 5's own ``Qwen3_5ForCausalLM`` computes, and packs where
transformers leaks.

The reference (tests/data/qwen3_5/qwen3_5.{json,safetensors}) was made by transformers itself, through its torch
path, from the committed script scripts/make_qwen3_5_references.py: a tiny random folder of three Gated DeltaNet
layers and one gated full-attention layer with partial RoPE and (1 + w) norms. The weights are rebuilt here from
each tensor's name; only transformers' outputs are stored. Checked: logits alone; the three documents packed
in one row give each its logits alone (where transformers' own packed row, stored too, does not); greedy tokens
through the generation engine; an export that reads back the same tensors and that transformers loads to the
same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from seqjax.core.errors import CheckpointError
from seqjax.hf import folders as hf
from test_moe_families import SCRIPT, assert_close

REFERENCES = Path(__file__).parent / "data" / "qwen3_5"


VARIANTS = ["qwen3_5", "qwen3_5_moe"]


def reference(name: str = "qwen3_5") -> tuple[dict, dict[str, np.ndarray]]:
    return (json.loads((REFERENCES / f"{name}.json").read_text()),
            load_file(str(REFERENCES / f"{name}.safetensors")))


def hf_folder(folder: Path, config: dict | None = None, name: str = "qwen3_5") -> Path:
    from safetensors.numpy import save_file

    from hf_support import tiny_tokenizer

    record, _ = reference(name)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or record["config"]))
    save_file(SCRIPT.reference_weights(record["tensors"]), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tiny_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module", params=["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def imported(request, tmp_path_factory):
    folder = hf.read_folder(hf_folder(tmp_path_factory.mktemp(request.param) / "hf", name=request.param))
    config = hf.run_config(folder, ["model.attention=xla"])
    return hf.model_with_params(config, hf.read_params(folder)), folder


def jitted(model, ids: np.ndarray, segment_ids: np.ndarray | None = None, positions: np.ndarray | None = None):
    """One row's logits [T, V] (float32), compiled once per shape."""
    graphdef, state = nnx.split(model)
    seg = np.ones(len(ids), int) if segment_ids is None else segment_ids
    pos = np.arange(len(ids)) if positions is None else positions
    return np.asarray(_logits(graphdef, state, *(jnp.asarray(a)[None] for a in (ids, seg, pos))))[0]


@jax.jit
def _logits(graphdef, state, ids, seg, pos):
    features, head, _ = nnx.merge(graphdef, state).forward(ids, positions=pos, segment_ids=seg)
    return features @ head


@jax.jit
def _terms(graphdef, state, ids, seg, pos):
    *_, terms = nnx.merge(graphdef, state).forward(ids, positions=pos, segment_ids=seg)
    return terms


def test_the_folder_reads_as_qwen3_5s_settings(imported):
    model, folder = imported
    cfg = model.cfg
    record, _ = reference(cfg.family)
    assert (cfg.attention_gate, cfg.norm_plus_one, cfg.qk_norm) == (True, True, True)
    if cfg.family == "qwen3_5_moe":
        ex = cfg.experts
        assert (ex.count, ex.top_k, ex.d_ff, ex.shared_d_ff, ex.norm_topk_prob, ex.aux_loss_coef) == (
            4, 2, 16, 24, True, 0.01)
        assert all(cfg.mlp_of(i) == "experts" for i in range(cfg.n_layers))
    assert cfg.layer_types == ["linear", "full", "linear", "linear"] and cfg.rotary_dim == 4
    assert (cfg.deltanet.key_heads, cfg.deltanet.value_heads, cfg.deltanet.key_dim, cfg.deltanet.conv_width) == (
        2, 4, 8, 4)


def test_logits_equal_transformers_alone_and_each_packed_document_its_own(imported):
    """Each sequence alone: transformers' logits. All three in one row (the last shorter than the convolution):
    each document's logits alone, where transformers' own packed row carries its state across them."""
    model, _ = imported
    _, ref = reference(model.cfg.family)
    names = ("seq0", "seq1", "seq2")
    for name in names:
        assert_close(jitted(model, ref[f"{name}.ids"]), ref[f"{name}.logits"])
    docs = [ref[f"{name}.ids"] for name in names]
    seg = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])
    pos = np.concatenate([np.arange(len(d)) for d in docs])
    packed = jitted(model, np.concatenate(docs), seg, pos)
    start = 0
    leaked = []
    for name, doc in zip(names, docs):
        assert_close(packed[start:start + len(doc)], ref[f"{name}.logits"])
        leaked.append(float(np.abs(ref["leaky.logits"][start:start + len(doc)] - ref[f"{name}.logits"]).max()))
        start += len(doc)
    assert leaked[0] == pytest.approx(0, abs=1e-4) and min(leaked[1:]) > 1e-2, leaked  # (transformers' leak)


def test_greedy_tokens_through_the_engine_equal_transformers_generate(imported):
    """The engine keeps each Gated DeltaNet layer's convolution window and state per decode slot (copied
    from its prompt's after the prefill), as transformers' generate carries them; the tokens are its. The
    prompt is prefilled packed between two others in one row (6 + 5 + 3 tokens in a row of 16): the state and
    window it hands on are its own."""
    from seqjax.engine import generate

    model, _ = imported
    _, ref = reference(model.cfg.family)
    prompts = [[7, 3, 2, 11, 4, 9], ref["prompt.ids"].tolist(), [13, 8, 21]]
    out = generate(model, prompts, eot_id=None, max_new_tokens=len(ref["greedy.ids"]))[1]
    assert out.tokens == ref["greedy.ids"].tolist()


def test_an_export_holds_transformers_tensors_and_reads_back_the_same(imported, tmp_path):
    from seqjax.hf.tensors import hf_shapes, to_hf

    model, folder = imported
    record, _ = reference(model.cfg.family)
    tensors = to_hf(hf.read_params(folder), folder.model)
    assert set(tensors) == set(record["tensors"]) == set(hf_shapes(folder.model))
    rebuilt = SCRIPT.reference_weights(record["tensors"])
    for name, value in tensors.items():
        np.testing.assert_array_equal(value, rebuilt[name], err_msg=name)
    hf.write_folder(tmp_path / "export", folder.model, hf.read_params(folder), tokenizer_json=folder.tokenizer,
                    eos_token="<|endoftext|>", bos_token=None)
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["architectures"] == record["config"]["architectures"]
    keys = ["layer_types", "linear_num_value_heads", "linear_key_head_dim", "linear_conv_kernel_dim"]
    if model.cfg.family == "qwen3_5_moe":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    for key in keys:
        assert written[key] == record["config"][key], key
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.25
    again = hf.read_folder(tmp_path / "export")
    assert again.model == folder.model


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     "layer_types: got .*, expected a list of linear_attention and full_attention"),
    ({"attention_bias": True}, "attention_bias: got True, expected false"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"partial_rotary_factor: got 1.5, expected a share in \(0, 1\]"),
    ({"linear_num_value_heads": 3}, "model.deltanet.value_heads: got 3, expected a multiple of"),
])
def test_what_seqjax_cannot_compute_is_one_line(change, message, tmp_path):
    record, _ = reference()
    folder = hf_folder(tmp_path / "q", {**record["config"], **change})
    with pytest.raises(CheckpointError, match=message):
        hf.read_folder(folder)


@pytest.mark.parametrize("name", VARIANTS)
def test_an_ungated_attention_is_one_line_in_either_row(name, tmp_path):
    """Both rows compute the gated attention only: a folder saying attn_output_gate false is refused."""
    record, _ = reference(name)
    folder = hf_folder(tmp_path / "q", {**record["config"], "attn_output_gate": False}, name=name)
    with pytest.raises(CheckpointError, match=r"attn_output_gate: got False, expected true \(gated attention\)"):
        hf.read_folder(folder)


def test_transformers_loads_seqjax_export_with_equal_logits(imported, tmp_path):
    """Live, where torch and transformers >= 5.24 import: seqjax's export, loaded by transformers, gives the
    reference's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24):
        pytest.skip("transformers >= 5.24 computes Qwen3.5 as the reference was made")
    _, folder = imported
    hf.write_folder(tmp_path / "export", folder.model, hf.read_params(folder), tokenizer_json=folder.tokenizer,
                    eos_token="<|endoftext|>", bos_token=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    _, ref = reference(folder.model.family)
    with torch.no_grad():
        ours = model(torch.tensor([ref["seq0.ids"].tolist()])).logits[0].numpy()
    assert_close(ours, ref["seq0.logits"])

def test_the_routers_load_balancing_loss_is_transformers_padded_batchs(tmp_path):
    """Qwen3.5-MoE: transformers' load_balancing_loss_func over two sequences padded into one batch with their
    attention mask; seqjax's over the same two packed in one row with padding after them."""
    from seqjax.model.experts import load_balancing_loss

    folder = hf.read_folder(hf_folder(tmp_path / "moe", name="qwen3_5_moe"))
    model = hf.model_with_params(hf.run_config(folder, ["model.attention=xla"]), hf.read_params(folder))
    _, ref = reference("qwen3_5_moe")
    a, b = ref["seq0.ids"], ref["seq1.ids"]
    ids = np.concatenate([a, b, np.zeros(5, np.int32)])
    seg = np.r_[np.ones(len(a), int), np.full(len(b), 2), np.zeros(5, int)]
    pos = np.r_[np.arange(len(a)), np.arange(len(b)), np.zeros(5, int)]
    terms = _terms(*nnx.split(model), *(jnp.asarray(a)[None] for a in (ids, seg, pos)))
    assert float(load_balancing_loss(terms, 2)) == pytest.approx(float(ref["padded.aux_loss"]), rel=1e-5)


@pytest.mark.slow  # (the fast loop keeps the logits against transformers)
def test_peft_adapters_on_the_deltanet_and_gated_attention_compute_and_export_as_peft_does(tmp_path):
    """A PEFT adapter folder with LoRA on the gated attention's q, v and o, every Gated DeltaNet projection
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) and the MLP's gate and down (peft 0.21 on
    transformers' own Qwen3.5), read onto its base: peft's own logits. Exported again, every tensor is the one
    read, under peft's names, with the same target_modules; folded into the base, the same logits."""
    from safetensors.numpy import save_file

    from seqjax.hf import peft as hf_peft
    from seqjax.weights.inference import with_adapter

    record = json.loads((REFERENCES / "qwen3_5-lora.json").read_text())
    theirs = load_file(str(REFERENCES / "qwen3_5-lora.safetensors"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(record["adapter_config"]))
    drawn = SCRIPT.reference_weights(record["tensors"])
    save_file(drawn, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    folder = hf.read_folder(hf_folder(tmp_path / "base"))
    config = hf.run_config(folder, ["model.attention=xla"])
    base = hf.model_with_params(config, hf.read_params(folder))
    config, model = with_adapter(config, base, str(adapter))
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= set(config.model.lora.targets)
    assert_close(jitted(model, theirs["seq0.ids"]), theirs["seq0.logits"])
    trained = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    exported = hf_peft.to_peft(trained, config.model)
    assert set(exported) == set(drawn)
    for name, value in exported.items():
        np.testing.assert_array_equal(value, drawn[name], err_msg=name)
    assert sorted(hf_peft.adapter_config(config.model, None)["target_modules"]) == sorted(
        record["adapter_config"]["target_modules"])
    from seqjax.model.assembly import fold

    merged = fold(hf.read_params(folder), trained, config.model)
    plain = hf.model_with_params(hf.run_config(folder, ["model.attention=xla"]), merged)
    # (W + s A B rounded to float32 once, where the adapters add x A B to x W: sums in another order, which
    # the DeltaNet's recurrence carries on; a mis-laid fold would move the logits by the adapters' size, ~1)
    ours, scale = jitted(plain, theirs["seq0.ids"]), float(np.abs(theirs["seq0.logits"]).max())
    assert float(np.abs(ours - theirs["seq0.logits"]).max()) <= 1e-4 * scale


def test_a_row_split_over_the_context_axis_is_refused_with_linear_layers(tmp_path):
    """A Gated DeltaNet's state runs along the whole row: mesh.context > 1 would cut it between shards, so the
    run refuses in one line (seqjax hands no state from shard to shard), as the peers refuse."""
    from seqjax.config.load import load_config
    from seqjax.core.errors import ConfigError

    folder = hf.read_folder(hf_folder(tmp_path / "q"))
    with pytest.raises(ConfigError, match=r"mesh.context: got 2 with linear layers .* expected mesh.context=1"):
        hf.run_config(folder, ["model.attention=xla", "mesh.context=2", "data.seq_len=64"])
    with pytest.raises(ConfigError, match="mesh.context: got 2 with linear layers"):
        load_config(None, ["model.layer_types=[linear,full]", "model.n_layers=2", "model.deltanet.key_heads=2",
                           "model.deltanet.value_heads=2", "mesh.context=2", "data.seq_len=64"])


MTP = {"mtp.fc.weight": (32, 64), "mtp.layers.0.mlp.gate_proj.weight": (48, 32), "mtp.norm.weight": (32,)}


def mtp_tensors() -> dict[str, np.ndarray]:
    """Multi-token-prediction layers as the Hub stores them (bfloat16), drawn at random."""
    rng = np.random.default_rng(7)
    return {name: rng.normal(size=shape).astype(jnp.bfloat16) for name, shape in MTP.items()}


def hub_folder(folder: Path) -> Path:
    """The tiny reference model as the Hub ships Qwen3.5: Qwen3_5ForConditionalGeneration, the text model under
    model.language_model.* with its config in text_config, beside a vision tower (model.visual.*) and
    multi-token-prediction layers (mtp.*, with their config field)."""
    from safetensors.numpy import save_file

    record, _ = reference("qwen3_5")
    text = {k: v for k, v in record["config"].items() if k not in ("architectures", "model_type")}
    folder = hf_folder(folder, {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                "text_config": {**text, "mtp_num_hidden_layers": 1},
                                "vision_config": {"depth": 2, "hidden_size": 16}, "image_token_id": 5})
    weights = SCRIPT.reference_weights(record["tensors"])
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): w
               for n, w in weights.items()}
    tower = {"model.visual.blocks.0.attn.qkv.weight": np.ones((48, 16), np.float32)}
    save_file({**renamed, **tower, **mtp_tensors()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_folder_with_the_vision_tower_trains_its_text_model_and_says_so(tmp_path, caplog):
    """seqjax reads a Hub folder's text model (the reference's logits), leaves the tower out, says so in one line,
    and refuses images (the model has no tower)."""
    import logging

    _, ref = reference("qwen3_5")
    with caplog.at_level(logging.INFO, logger="seqjax.hf.folders"):
        read = hf.read_folder(hub_folder(tmp_path / "vl"))
        hf.read_folder(tmp_path / "vl")  # (an export with --hf reads the folder twice: the line is said once)
    assert "a Qwen3.5 folder with a vision tower: seqjax reads its text model" in caplog.text
    assert caplog.text.count("3 tensors seqjax keeps as they are but does not compute or train (mtp.*)") == 1
    assert read.model.family == "qwen3_5" and read.model.vision.depth == 0
    model = hf.model_with_params(hf.run_config(read, ["model.attention=xla"]), hf.read_params(read))
    assert_close(jitted(model, ref["seq0.ids"]), ref["seq0.logits"])
    with pytest.raises(ValueError, match="the batch has image fields .* but the model has no vision tower"):
        model.forward(jnp.ones((1, 4), jnp.int32), positions=jnp.zeros((1, 4), jnp.int32),
                      segment_ids=jnp.ones((1, 4), jnp.int32), positions_3d=jnp.zeros((1, 4, 3), jnp.int32),
                      pixel_values=jnp.zeros((4, 8)))


def exported(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    from seqjax.hf.folders import tensor_files, tensor_reader

    read = tensor_reader(tensor_files(folder))
    return {n: read(n) for n in tensor_files(folder)}, json.loads((folder / "config.json").read_text())


def test_mtp_layers_are_kept_through_import_and_export_untrained(tmp_path):
    """Qwen3.5's multi-token-prediction layers (mtp.*) are no part of the model seqjax computes: an import keeps
    them in the run folder as stored, and an export writes them back under their names with their config field,
    beside the text model (where transformers' Qwen3_5ForCausalLM ignores them and vLLM reads them). A
    Qwen3_5ForCausalLM folder holding them, refused before as having tensors with no place, reads too."""
    from seqjax.hf.carried import CARRIED_FILE, read_carried
    from seqjax.main import export, import_hf

    record, _ = reference("qwen3_5")
    hub = hub_folder(tmp_path / "hub")
    import_hf.main([str(hub), "--out", str(tmp_path / "run")])
    kept, fields = read_carried(tmp_path / "run")
    assert (tmp_path / "run" / CARRIED_FILE).is_file() and fields == {"mtp_num_hidden_layers": 1}
    for name, value in mtp_tensors().items():
        assert kept[name].dtype == value.dtype and np.array_equal(kept[name], value), name
    for source, flag in ((tmp_path / "run", "--run"), (hub, "--hf")):
        out = tmp_path / f"export{flag}"
        export.main([flag, str(source), "--out", str(out)])
        tensors, config = exported(out)
        assert set(tensors) == set(record["tensors"]) | set(MTP) and config["mtp_num_hidden_layers"] == 1
        assert config["architectures"] == ["Qwen3_5ForCausalLM"]
        for name, value in mtp_tensors().items():
            np.testing.assert_array_equal(tensors[name], value.astype(np.float32), err_msg=name)
    # the export, a text folder with mtp.*, reads again, keeping them
    again = hf.read_folder(tmp_path / "export--run")
    assert again.carried == tuple(sorted(MTP)) and again.model == hf.read_folder(hub).model
    hf.read_params(again)
