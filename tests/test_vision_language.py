"""Qwen3-VL's forward pass (tower, image tokens in the text, interleaved M-RoPE, DeepStack) equal to
transformers' Qwen3VLForConditionalGeneration: each example alone, and the three packed into one row with padding.

The references (tests/data/vision/vl*.{json,safetensors}: a tiny random Qwen3-VL and each example's logits computed
alone) were made by transformers itself from the committed script scripts/make_image_references.py.
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
from safetensors.numpy import load_file

from hf_support import script_module
from seqjax.core.errors import CheckpointError
from seqjax.hf.tensors import from_hf
from seqjax.hf.vision import text_tensors, vision_language_config, vision_params
from seqjax.model.multimodal import VisionLanguageModel
from seqjax.model.stacking import blocks_layout
from seqjax.model.transformer import build_model
from seqjax.model.vision import VisionTower
from seqjax.store.images import QWEN3_VL, ImageSpec, patch_inputs, pixel_values, rope_index

DATA = Path(__file__).parent / "data" / "vision"
REFERENCE = json.loads((DATA / "vl.json").read_text())
LOGITS = load_file(str(DATA / "vl_logits.safetensors"))
SCRIPT = script_module("make_image_references")
VL = vision_language_config(REFERENCE["config"])


def vl_model() -> VisionLanguageModel:
    tensors = load_file(str(DATA / "vl.safetensors"))
    text = text_tensors(tensors)
    cfg = dataclasses.replace(VL.text, attention="xla")
    lm = build_model(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(lm)
    nnx.replace_by_pure_dict(state, blocks_layout(from_hf(text.__getitem__, text, cfg, "vl.safetensors"), False))
    lm = nnx.merge(graphdef, state)
    tower = VisionTower(VL.vision, nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    nnx.replace_by_pure_dict(state, vision_params(tensors, VL.vision, source="vl.safetensors"))
    return VisionLanguageModel(lm, nnx.merge(graphdef, state), VL.mrope_section, VL.mrope_interleaved)


def spec() -> ImageSpec:
    b = REFERENCE["bounds"]
    return ImageSpec(patch_size=QWEN3_VL.patch_size, merge_size=b["merge_size"], temporal_patch_size=2,
                     min_pixels=b["min_pixels"], max_pixels=b["max_pixels"], image_mean=QWEN3_VL.image_mean,
                     image_std=QWEN3_VL.image_std)


def packed(names: list[str], width: int, patch_budget: int):
    """One row holding ``names``' examples in order (segment ids 1, 2, ...), right-padded to ``width``; their
    images in one patch stream padded to ``patch_budget``."""
    drawn, merge = SCRIPT.images(), VL.vision.spatial_merge_size
    ids, segments, positions, image_index, pixels, grids = [], [], [], [], [], []
    for segment, name in enumerate(names, start=1):
        example = REFERENCE["examples"][name]
        e_ids = np.asarray(example["ids"])
        is_image = e_ids == VL.image_token_id
        positions.append(rope_index(is_image, [tuple(g) for g in example["grids"]], merge).T)
        counted = sum(int(i >= 0) for i in image_index)
        image_index += np.where(is_image, counted + np.cumsum(is_image) - 1, -1).tolist()
        ids += e_ids.tolist()
        segments += [segment] * len(e_ids)
        for image in example["images"]:
            values, grid = pixel_values(drawn[image], spec())
            pixels.append(values)
            grids.append(grid)
    pad = width - len(ids)
    patches = patch_inputs(grids, merge, VL.vision.grid_side, patch_budget)
    stream = np.concatenate(pixels) if pixels else np.zeros((0, VL.vision.patch_dim), np.float32)
    stream = np.concatenate([stream, np.zeros((patch_budget - len(stream), stream.shape[1]), np.float32)])
    row = {"inputs": ids + [0] * pad, "segment_ids": segments + [0] * pad, "image_index": image_index + [-1] * pad}
    batch = {k: jnp.asarray([v], jnp.int32) for k, v in row.items()}
    batch["positions_3d"] = jnp.asarray(np.concatenate(positions + [np.zeros((pad, 3), np.int64)])[None], jnp.int32)
    return batch, {"patches": jnp.asarray(stream), "patch_segment_ids": jnp.asarray(patches["segment_ids"]),
                   **{k: jnp.asarray(patches[k]) for k in ("rows", "columns", "table_index", "table_weight")}}


def logits(model, names, width, patch_budget):
    batch, patches = packed(names, width, patch_budget)
    return np.asarray(jax.jit(lambda m, b, p: m(b["inputs"], segment_ids=b["segment_ids"],
                                                   positions_3d=b["positions_3d"], image_index=b["image_index"],
                                                   **p))(model, batch, patches))[0]


@pytest.fixture(scope="module")
def model():
    return vl_model()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE["examples"]))
def test_each_image_and_text_example_alone_equals_transformers(model, name):
    n = len(REFERENCE["examples"][name]["ids"])
    ours = logits(model, [name], n, 64)
    theirs = LOGITS[name]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


def test_the_examples_packed_in_one_row_equal_transformers_each_alone(model):
    """Three examples (two with images, one with two of different sizes) in one padded row, their four images in
    one padded patch stream: each example's logits are transformers' for it alone."""
    names = ["two_images", "text_only", "one_image"]
    ours = logits(model, names, 52, 96)
    at = 0
    for name in names:
        n = len(REFERENCE["examples"][name]["ids"])
        theirs = LOGITS[name]
        np.testing.assert_allclose(ours[at:at + n], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
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
