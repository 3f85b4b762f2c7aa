"""The forward passes of Qwen3-VL (tower, image tokens in the text, interleaved M-RoPE, DeepStack) and Qwen2.5-VL
(a windowed tower with a full block, M-RoPE in three runs, a Qwen2 text model) equal to transformers'
Qwen3VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration: each example alone, and the three packed
into one row with padding.

The references (tests/data/vision/vl*.{json,safetensors}, vl25*: tiny random models and each example's logits
computed alone) were made by transformers itself from the committed script scripts/make_image_references.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from seqjax.config.load import load_config
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf import folders
from seqjax.hf.vision import vision_language_config
from seqjax.model import build_model
from seqjax.model.assembly import full_weights
from seqjax.model.attention import attention
from seqjax.weights import init_from
from vision_support import QWEN2_5, REFERENCE, REFERENCES, VL, batch, hub_name, tiny_overrides, write_hf_folder

MODELS: dict = {}


def model_of(family: str):
    """Each reference as a seqjax model, built once per module."""
    if family not in MODELS:
        MODELS[family] = REFERENCES[family].model()
    return MODELS[family]


@pytest.fixture(scope="module")
def model():
    return model_of("qwen3_vl")


@pytest.mark.slow
@pytest.mark.parametrize("family,name", [(f, n) for f, ref in REFERENCES.items()
                                         for n in sorted(ref.record["examples"])])
def test_each_image_and_text_example_alone_equals_transformers(family, name):
    ref = REFERENCES[family]
    n = len(ref.record["examples"][name]["ids"]) - 1  # the inputs: the last id is only a target
    ours = ref.logits(model_of(family), [[name]], n, 64)[0]
    theirs = ref.logits_of[name][:n]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("family", [f if f == "qwen2_5_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(REFERENCES)])
def test_the_examples_packed_in_rows_equal_transformers_each_alone(family):
    """Three examples (two with images, one with two of different sizes) in one padded row, their four images in
    the row's padded patch stream, and a second row with one of them again: each example's logits are
    transformers' for it alone, whatever it shares its row with. Qwen2.5-VL's images span several windows each
    (the last ones cut by the image's edges), and its middle block sees the whole image."""
    ref = REFERENCES[family]
    rows = [["two_images", "text_only", "one_image"], ["one_image"]]
    ours = ref.logits(model_of(family), rows, 52, 96)
    for r, names in enumerate(rows):
        at = 0
        for name in names:
            n = len(ref.record["examples"][name]["ids"]) - 1
            theirs = ref.logits_of[name][:n]
            np.testing.assert_allclose(ours[r, at:at + n], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
            at += n


def test_a_qwen3_vl_config_without_mrope_or_token_ids_is_one_line():
    config = json.loads(json.dumps(REFERENCE["config"]))
    del config["text_config"]["rope_parameters"]["mrope_section"]
    with pytest.raises(CheckpointError, match="mrope_section is None; expected three sizes"):
        vision_language_config(config)
    config = json.loads(json.dumps(REFERENCE["config"]))
    config["vision_config"]["out_hidden_size"] = 7
    with pytest.raises(CheckpointError, match="out_hidden_size 7; expected the text model's hidden_size 24"):
        vision_language_config(config)


def test_a_qwen2_5_vl_config_field_of_the_other_encoder_or_a_window_under_a_group_is_one_line():
    config = json.loads(json.dumps(QWEN2_5.record["config"]))
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    with pytest.raises(CheckpointError, match="deepstack_visual_indexes are not read by seqjax's qwen2_5_vl"):
        vision_language_config(config)
    config = json.loads(json.dumps(QWEN2_5.record["config"]))
    config["vision_config"]["window_size"] = 20
    with pytest.raises(CheckpointError, match="window_size 20 is under one merged group .28 pixels."):
        vision_language_config(config)


def test_a_hub_qwen2_5_vl_folder_reads_as_the_same_model(tmp_path):
    """The Qwen2.5-VL reference as the Hub keeps such checkpoints, which is also what transformers' save_pretrained
    writes for it (``visual.*`` and ``model.layers.*``, vl25_saved.json), with the text model's fields flat in
    config.json and M-RoPE as rope_scaling of type mrope: the same logits on a packed batch, bit for bit."""
    saved = set(json.loads((Path(__file__).parent / "data" / "vision" / "vl25_saved.json").read_text())["names"])
    assert {hub_name(name) for name in QWEN2_5.tensors()} == saved
    folder = write_hf_folder(tmp_path / "vl25", ref=QWEN2_5, hub_layout=True)
    assert "text_config" not in json.loads((folder / "config.json").read_text())
    config, read = folders.load(folder, ["model.attention=xla"])
    assert config.model.vision == QWEN2_5.vl.text.vision and not config.model.mrope_interleaved
    rows = [["two_images", "text_only"], ["one_image"]]
    vocab = QWEN2_5.record["config"]["text_config"]["vocab_size"]
    np.testing.assert_array_equal(QWEN2_5.logits(read, rows, 40, 96)[..., :vocab],
                                  QWEN2_5.logits(model_of("qwen2_5_vl"), rows, 40, 96))


def test_a_qwen3_vl_folder_with_sharded_weights_reads_as_the_same_model(model, tmp_path):
    """The reference checkpoint saved as a Hugging Face folder (config.json, two shards and their index, a
    tokenizer) reads back through the one folder reader as the same model: the same logits on a packed batch,
    bit for bit (the folder's embedding has rows for the tokenizer's ids beyond the reference's)."""
    folder = write_hf_folder(tmp_path / "vl", shards=2)
    config, read = folders.load(folder, ["model.attention=xla"])
    assert config.model.vision == VL.text.vision and config.model.mrope_section == VL.text.mrope_section
    rows = [["two_images", "text_only"], ["one_image"]]
    vocab = REFERENCE["config"]["text_config"]["vocab_size"]
    np.testing.assert_array_equal(REFERENCES["qwen3_vl"].logits(read, rows, 40, 96)[..., :vocab],
                                  REFERENCES["qwen3_vl"].logits(model, rows, 40, 96))
    shard = folder / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])  # truncated
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: cannot read tensor"):
        folders.load(folder)


def test_image_fields_without_a_tower_or_without_their_positions_are_one_line(model):
    fields = {k: jnp.asarray(v) for k, v in batch([["one_image"]], 30, 64).items() if k not in ("targets", "weights")}
    inputs = fields.pop("inputs")
    text_model = build_model(dataclasses.replace(VL.text, vision=dataclasses.replace(VL.text.vision, depth=0),
                                                 mrope_section=[]), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="the batch has image fields .* but the model has no vision tower"):
        text_model(inputs, **fields)
    with pytest.raises(ValueError, match="positions_3d and the image fields go together"):
        model(inputs, **{k: v for k, v in fields.items() if k != "positions_3d"})


# (the fast loop writes Qwen2.5-VL's; the VL round trip, tests/test_vision_run.py, merges Qwen3-VL's)
@pytest.mark.parametrize("family", [pytest.param("qwen3_vl", marks=pytest.mark.slow), "qwen2_5_vl"])
def test_a_vl_model_written_as_a_hugging_face_folder_reads_back_as_the_same_model(family, tmp_path):
    """seqjax.hf.write_folder on a VL model (what ``seqjax.export --merge`` calls): the tensors under the names
    transformers' save_pretrained gives them (Qwen3-VL: model.language_model.*, model.visual.*; Qwen2.5-VL: the
    Hub's model.* and visual.*, vl25_saved.json), config.json with transformers' own values for every field it
    writes (the reference's config.json, made by transformers), the processor's preprocessor_config.json beside
    them; read back, the same logits bit for bit."""
    ref = REFERENCES[family]
    base = write_hf_folder(tmp_path / "base", ref=ref)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": ref.spec.patch_size}))
    config, model = folders.load(base, ["model.attention=xla"])
    written = folders.write_folder(tmp_path / "out", model.cfg, full_weights(model), tokenizer_json=base /
                                   "tokenizer.json", eos_token="<|im_end|>", bos_token=None,
                                   image_processor=tmp_path / "preprocessor_config.json")
    out = Path(written["out"])
    assert json.loads((out / "preprocessor_config.json").read_text()) == {"patch_size": ref.spec.patch_size}
    names = set(safe_open(str(out / "model.safetensors"), "np").keys())
    theirs = {hub_name(n) if family == "qwen2_5_vl" else n for n in ref.tensors()}
    assert names == theirs
    ours, reference = json.loads((out / "config.json").read_text()), json.loads((base / "config.json").read_text())
    for section in ("vision_config", "text_config"):
        for key, value in ours[section].items():
            # (the tokenizer's ids, seqjax's context length, and max_window_layers, which nothing reads without
            # use_sliding_window, are the run's)
            if key in reference[section] and key not in ("bos_token_id", "eos_token_id", "max_position_embeddings",
                                                         "max_window_layers"):
                assert reference[section][key] == value, (section, key)
    assert {k: ours[k] for k in ("architectures", "model_type", "image_token_id", "vision_start_token_id",
                                 "vision_end_token_id", "video_token_id")} == {
        k: reference[k] for k in ("architectures", "model_type", "image_token_id", "vision_start_token_id",
                                  "vision_end_token_id", "video_token_id")}
    _, read = folders.load(out, ["model.attention=xla"])
    assert read.cfg.vision == model.cfg.vision
    rows = [["two_images", "text_only"], ["one_image"]]
    np.testing.assert_array_equal(ref.logits(read, rows, 40, 96), ref.logits(model, rows, 40, 96))


def test_a_tower_mixed_from_both_models_writes_no_folder(tmp_path):
    model = model_of("qwen3_vl")
    mixed = dataclasses.replace(model.cfg, vision=dataclasses.replace(model.cfg.vision, window_size=64,
                                                                      fullatt_block_indexes=[1]))
    with pytest.raises(CheckpointError, match="is neither Qwen3-VL's nor Qwen2.5-VL's settings"):
        folders.write_folder(tmp_path / "out", mixed, full_weights(model), tokenizer_json=tmp_path / "none.json",
                             eos_token="<|im_end|>", bos_token=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # (the fast loop checks the kernel's non-causal form itself: tests/test_flash.py)
@pytest.mark.parametrize("family", sorted(REFERENCES))
def test_the_towers_flash_kernel_in_its_non_causal_form_gives_the_dense_masks_logits(family):
    """model.vision.attention=pallas (the flash kernel's non-causal form, interpreted on a CPU; Qwen2.5-VL's
    windows and its full block as two sets of segment ids) gives the dense mask's logits on a packed batch with
    padding patches; a backend that cannot honour the non-causal mask is one line."""
    ref = REFERENCES[family]
    kernel = ref.model(vision=dataclasses.replace(ref.vl.text.vision, attention="pallas"))
    rows = [["two_images", "text_only", "one_image"], ["one_image"]]
    ours, dense = ref.logits(kernel, rows, 52, 96), ref.logits(model_of(family), rows, 52, 96)
    np.testing.assert_allclose(ours, dense, rtol=0, atol=1e-5 * np.abs(dense).max())
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ConfigError, match="got 'cudnn', which cannot honour the non-causal mask"):
        attention(q, q, q, jnp.ones((1, 8), jnp.int32), backend="cudnn", causal=False)
    with pytest.raises(ConfigError, match="model.vision.attention"):
        load_config(None, ["model.vision.attention=cudnn"])


def test_configs_qwen2_5_vl_lora_takes_a_small_hub_qwen2_5_vl_folder_by_its_path_alone(tmp_path):
    """configs/qwen2_5_vl_lora.yaml (Qwen2.5-VL-7B's settings) with a tiny Hub-layout folder as train.init_from and
    no model key on the command line: the folder's config.json decides the model, tower included. A model key the
    command line sets that contradicts the folder (the windows, which no shape would show) is one line, never a
    tower computing something else."""
    folder = write_hf_folder(tmp_path / "vl25", ref=QWEN2_5, hub_layout=True)
    config_file = Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_vl_lora.yaml"
    given = load_config(config_file, [f"train.init_from={folder}"])
    assert given.model.d_model != QWEN2_5.vl.text.d_model  # (the file's 7B shape)
    config = init_from.adopt(given, init_from.read_source(str(folder)), given.explicit)
    assert config.model.vision == QWEN2_5.vl.text.vision and config.model.qkv_bias
    assert config.model.d_model == QWEN2_5.vl.text.d_model and config.model.lora.rank == given.model.lora.rank
    windowless = load_config(config_file, [f"train.init_from={folder}", "model.vision.window_size=0"])
    with pytest.raises(ConfigError, match="model.vision.window_size: got 0 on the command line, but .* has 56; "
                                          "leave it out"):
        init_from.adopt(windowless, init_from.read_source(str(folder)), windowless.explicit)


def test_a_vl_folder_and_its_import_carry_their_image_processor(tmp_path):
    """A Qwen3-VL folder's preprocessor_config.json, and the copy seqjax.import keeps beside the run's tokenizer:
    a command that reads chats takes it (and a patch budget of four per token) with no data.image_processor."""
    from seqjax.main import import_hf
    from seqjax.weights.inference import load_folder, load_for_inference
    from vision_support import PROCESSOR

    folder = write_hf_folder(tmp_path / "vl")
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    import_hf.main([str(folder), "--out", str(tmp_path / "imported")])
    assert (tmp_path / "imported" / "preprocessor_config.json").read_text() == json.dumps(PROCESSOR)
    chats = ["data.corpus=jsonl", "data.format=chat", "data.train_files=[x.jsonl]", "data.seq_len=64",
             "model.attention=xla"]
    for config, where in ((load_for_inference(tmp_path / "imported", chats)[0], tmp_path / "imported"),
                          (load_folder(folder, chats)[0], folder)):
        assert config.data.image_processor == str(where / "preprocessor_config.json")
        assert config.data.patches_per_row == 4 * 64
    text_only = load_folder(folder, ["model.attention=xla"])[0]  # (no chats: nothing to read images with)
    assert text_only.data.image_processor is None


def test_an_image_processor_that_cuts_other_patches_than_the_towers_is_one_line(tmp_path):
    """Qwen3-VL's processor (patch 16) for Qwen2.5-VL's tower (patch 14): refused before any image is read."""
    from seqjax.train.setup import objective_of

    processor = tmp_path / "preprocessor_config.json"
    processor.write_text(json.dumps({"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}))
    config_file = Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_vl_lora.yaml"
    config = load_config(config_file, [*tiny_overrides(QWEN2_5), f"data.image_processor={processor}"])
    with pytest.raises(ConfigError, match="has patch_size 16, but model.vision's tower takes 14"):
        objective_of(config)
    processor.write_text(json.dumps({"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}))
    assert objective_of(config) is not None


# The Hub's Qwen2.5-VL-7B-Instruct config.json (its published fields, flat as the Hub keeps them)
HUB_QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 152064}


def test_the_hubs_qwen2_5_vl_7b_config_reads_as_configs_qwen2_5_vl_lora_yamls_model():
    """Every field of the real checkpoint's config.json is read (none refused), and the model it describes is the
    shipped config's, but for what a run chooses (dtypes, remat, scan, the chunked loss, LoRA, the context)."""
    read = vision_language_config(HUB_QWEN2_5_VL_7B).text
    shipped = load_config(Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_vl_lora.yaml").model
    chosen = {"max_seq_len", "param_dtype", "compute_dtype", "remat", "scan_layers", "loss_chunk_tokens", "lora"}
    differ = {f.name for f in dataclasses.fields(shipped) if getattr(read, f.name) != getattr(shipped, f.name)}
    assert differ <= chosen, differ
    assert read.vision.encoder == "qwen2_5_vl" and read.qkv_bias and not read.mrope_interleaved
