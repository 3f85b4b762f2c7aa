"""The vision encoder over a packed patch stream (Qwen3-VL's; Qwen2.5-VL's windows as segments):
equal to transformers' on four images of different grids given together, and packing-proof: an image
computes the same alone, in any order, beside any other image, with padding patches after it (the
non-causal form of the one mask).

The references (tests/data/vision/tower.*) were made by transformers itself (Qwen3VLVisionModel,
eager attention, random weights) from the committed script scripts/make_image_references.py; the
images are drawn from their names by that script's own function and preprocessed here by seqjax
(equal to transformers' processor: tests/test_images.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from safetensors.numpy import load_file

from hf_support import script_module
from seqjax.config.vision import VisionConfig, vision_from_hf
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf.vision import vision_params
from seqjax.model.mask import segment_mask
from seqjax.model.vision import VisionTower, table_taps, window_segments
from seqjax.store.images import QWEN3_VL, ImageSpec, patch_inputs, pixel_values

DATA = Path(__file__).parent / "data" / "vision"
REFERENCE = json.loads((DATA / "tower.json").read_text())
SCRIPT = script_module("make_image_references")
CFG = vision_from_hf({**REFERENCE["config"], "model_type": "qwen3_vl"})


def tower() -> VisionTower:
    model = VisionTower(CFG, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tensors = load_file(str(DATA / "tower.safetensors"))
    nnx.replace_by_pure_dict(state, vision_params(tensors.__getitem__, set(tensors), CFG, prefix=""))
    return nnx.merge(graphdef, state)


def images() -> list[np.ndarray]:
    bounds = REFERENCE["bounds"]
    spec = ImageSpec(patch_size=QWEN3_VL.patch_size, merge_size=bounds["merge_size"],
                     temporal_patch_size=bounds["temporal_patch_size"], min_pixels=bounds["min_pixels"],
                     max_pixels=bounds["max_pixels"], image_mean=QWEN3_VL.image_mean, image_std=QWEN3_VL.image_std)
    drawn = SCRIPT.images()
    return [pixel_values(drawn[name], spec) for name in REFERENCE["images"]]


def run(model: VisionTower, chosen: list[tuple[np.ndarray, tuple]], budget: int | None = None):
    inputs = patch_inputs([grid for _, grid in chosen], CFG.spatial_merge_size, budget)
    pixels = np.concatenate([p for p, _ in chosen])
    pixels = np.concatenate([pixels, np.zeros((len(inputs["rows"]) - len(pixels), pixels.shape[1]), np.float32)])
    tokens, deepstack = jax.jit(lambda m, *a: m(*a))(model, jnp.asarray(pixels), *map(jnp.asarray, (
        inputs["segment_ids"], inputs["rows"], inputs["columns"], inputs["heights"], inputs["widths"])))
    return np.asarray(tokens), np.asarray(deepstack)


MODEL = None


def model() -> VisionTower:
    global MODEL
    if MODEL is None:
        MODEL = tower()
    return MODEL


def test_image_tokens_and_deepstack_features_equal_transformers_on_images_packed_together():
    chosen = images()
    assert [list(g) for _, g in chosen] == REFERENCE["grids"]
    tokens, deepstack = run(model(), chosen)
    expected = np.asarray(REFERENCE["tokens"], np.float32)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(tokens, expected, rtol=0, atol=1e-5 * scale)
    for ours, theirs in zip(deepstack, REFERENCE["deepstack"], strict=True):
        theirs = np.asarray(theirs, np.float32)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(st.permutations(range(4)), st.integers(1, 4), st.integers(0, 3))
def test_an_image_computes_the_same_alone_as_packed_in_any_order_with_padding(order, count, pad_groups):
    """No patch attends across images: each image's tokens, packed with others in a drawn order and
    padded by a drawn number of merge groups, equal that image's tokens computed alone."""
    chosen = images()
    picked = [chosen[i] for i in order[:count]]
    group = CFG.spatial_merge_size**2
    total = sum(len(p) for p, _ in picked) + pad_groups * group
    tokens, deepstack = run(model(), picked, budget=total)
    at = 0
    for pixels, grid in picked:
        alone, alone_deep = run(model(), [(pixels, grid)])
        n = len(pixels) // group
        np.testing.assert_allclose(tokens[at:at + n], alone, rtol=0, atol=2e-5 * np.abs(alone).max())
        np.testing.assert_allclose(deepstack[:, at:at + n], alone_deep, rtol=0, atol=2e-5 * np.abs(alone_deep).max())
        at += n


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_the_non_causal_mask_joins_exactly_the_patches_of_one_image(segments):
    ids = np.asarray(segments, np.int32)
    mask = np.asarray(segment_mask(jnp.asarray(ids)[None], causal=False))[0]
    expected = (ids[:, None] == ids[None, :]) & (ids[:, None] != 0)
    assert (mask == expected).all()


WINDOW_SEGMENTS = jax.jit(window_segments, static_argnums=4)
WINDOW_STREAM = 4 * 4 * 49 + 4 * 6  # the most patches the draws below give (padding more, as a row's budget does)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=4), st.integers(1, 3),
       st.integers(0, 6))
def test_window_segments_join_exactly_the_patches_of_one_window_of_one_image(groups, window, pad):
    """Qwen2.5-VL's windows as segments: two patches share an id iff they are of the same image and
    the same window (``window`` x ``window`` merged groups from the image's top-left corner,
    transformers' get_vision_window_index), and padding patches have 0; so the non-causal mask over
    these ids keeps every window to itself, whatever the images' sizes and order."""
    grids = [(1, 2 * h, 2 * w) for h, w in groups]  # merged groups high and wide
    inputs = patch_inputs(grids, 2, sum(h * w for _, h, w in grids) + 4 * pad)
    side = 2 * window
    fields = [np.pad(inputs[k], (0, WINDOW_STREAM - len(inputs[k]))) for k in ("segment_ids", "rows", "columns",
                                                                               "widths")]
    ids = np.asarray(WINDOW_SEGMENTS(*map(jnp.asarray, fields), side))[:len(inputs["rows"])]  # one compile a side
    seg, rows, cols = inputs["segment_ids"], inputs["rows"], inputs["columns"]
    key = [(s, r // side, c // side) if s else None for s, r, c in zip(seg, rows, cols)]
    expected = np.asarray([[a is not None and a == b for b in key] for a in key])
    assert ((ids[:, None] == ids[None, :]) & (ids[:, None] != 0) == expected).all()
    assert ((ids == 0) == (seg == 0)).all()


def test_patch_inputs_follow_the_processors_merge_order_and_pad_to_the_budget():
    inputs = patch_inputs([(1, 2, 4), (1, 2, 2)], 2, budget=16)
    assert inputs["segment_ids"].tolist() == [1] * 8 + [2] * 4 + [0] * 4
    assert inputs["rows"][:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert inputs["columns"][:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert inputs["heights"][:12].tolist() == [2] * 12 and inputs["widths"][:12].tolist() == [4] * 8 + [2] * 4
    # corners aligned: the grid's first and last patch take the table's corners with weight 1
    index, weight = map(np.asarray, table_taps(*(jnp.asarray(inputs[k]) for k in ("rows", "columns", "heights",
                                                                                 "widths")), 4))
    assert index[0][0] == 0 and weight[0][0] == 1
    assert (inputs["rows"][7], inputs["columns"][7]) == (1, 3)  # patch 7 in merge order
    assert index[7][0] == 3 * 4 + 3 and weight[7][0] == 1
    np.testing.assert_allclose(weight[:12].sum(axis=1), 1, rtol=1e-6)
    assert np.isfinite(weight).all()  # padding too
    with pytest.raises(ValueError, match="more than the budget of 4"):
        patch_inputs([(1, 2, 4)], 2, budget=4)


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "qwen2_vl"}, "model_type 'qwen2_vl' is not supported"),
    ({"window_size": 112}, "window_size are not read by seqjax's qwen3_vl"),
    ({"model_type": "qwen2_5_vl", "num_position_embeddings": 16}, "num_position_embeddings are not read"),
    ({"model_type": "qwen2_5_vl", "in_chans": 4}, "in_chans 4 differs from in_channels 3"),
    ({"model_type": "qwen2_5_vl", "fullatt_block_indexes": [40]}, r"fullatt_block_indexes \[40\]; expected layers "
     "below depth 32"),
    ({"hidden_act": "quick_gelu"}, "hidden_act 'quick_gelu'"),
    ({"num_position_embeddings": 10}, "num_position_embeddings 10 is not a square"),
    ({"deepstack_visual_indexes": [5], "depth": 3}, r"deepstack_visual_indexes \[5\]"),
])
def test_a_vision_config_field_seqjax_does_not_compute_is_one_line(fields, match):
    with pytest.raises(ConfigError, match=match):
        vision_from_hf(fields)


def test_a_missing_vision_tensor_is_one_line_naming_it():
    tensors = load_file(str(DATA / "tower.safetensors"))
    del tensors["blocks.1.attn.qkv.bias"]
    with pytest.raises(CheckpointError, match="tensor blocks.1.attn.qkv.bias is missing"):
        vision_params(tensors.__getitem__, set(tensors), CFG, prefix="", source="tower.safetensors")
    assert VisionConfig().grid_side == 48
