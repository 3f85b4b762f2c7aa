"""Qwen3-VL's forward pass (tower, image tokens in the text, interleaved M-RoPE, DeepStack) equal to
transformers' Qwen3VLForConditionalGeneration: each example alone, and the three packed into one row with padding.

The references (tests/data/vision/vl*.{json,safetensors}: a tiny random Qwen3-VL and each example's logits computed
alone) were made by transformers itself from the committed script scripts/make_image_references.py.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqjax.core.errors import CheckpointError
from seqjax.hf import folders
from seqjax.hf.vision import vision_language_config
from seqjax.model import build_model
from vision_support import LOGITS, REFERENCE, VL, batch, logits, vl_model, write_hf_folder


@pytest.fixture(scope="module")
def model():
    return vl_model()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE["examples"]))
def test_each_image_and_text_example_alone_equals_transformers(model, name):
    n = len(REFERENCE["examples"][name]["ids"]) - 1  # the inputs: the last id is only a target
    ours = logits(model, [[name]], n, 64)[0]
    theirs = LOGITS[name][:n]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def test_the_examples_packed_in_rows_equal_transformers_each_alone(model):
    """Three examples (two with images, one with two of different sizes) in one padded row, their four images in
    the row's padded patch stream, and a second row with one of them again: each example's logits are
    transformers' for it alone, whatever it shares its row with."""
    rows = [["two_images", "text_only", "one_image"], ["one_image"]]
    ours = logits(model, rows, 52, 96)
    for r, names in enumerate(rows):
        at = 0
        for name in names:
            n = len(REFERENCE["examples"][name]["ids"]) - 1
            theirs = LOGITS[name][:n]
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


def test_a_qwen3_vl_folder_with_sharded_weights_reads_as_the_same_model(model, tmp_path):
    """The reference checkpoint saved as a Hugging Face folder (config.json, two shards and their index, a
    tokenizer) reads back through the one folder reader as the same model: the same logits on a packed batch,
    bit for bit (the folder's embedding has rows for the tokenizer's ids beyond the reference's)."""
    folder = write_hf_folder(tmp_path / "vl", shards=2)
    config, read = folders.load(folder, ["model.attention=xla"])
    assert config.model.vision == VL.text.vision and config.model.mrope_section == VL.text.mrope_section
    rows = [["two_images", "text_only"], ["one_image"]]
    vocab = REFERENCE["config"]["text_config"]["vocab_size"]
    np.testing.assert_array_equal(logits(read, rows, 40, 96)[..., :vocab], logits(model, rows, 40, 96))
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
