"""Shared helpers for the image tests: the tiny Qwen3-VL reference checkpoint (tests/data/vision/, made by
transformers from scripts/make_image_references.py) as a seqjax model, its examples as batches read them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from hf_support import script_module
from seqjax.data.image_rows import ImageExample, ImageLayout, image_batch
from seqjax.hf.vision import vision_language_config, vision_language_model
from seqjax.model.multimodal import VisionLanguageModel
from seqjax.store.images import QWEN3_VL, ImageSpec, pixel_values

DATA = Path(__file__).parent / "data" / "vision"
REFERENCE = json.loads((DATA / "vl.json").read_text())
LOGITS = load_file(str(DATA / "vl_logits.safetensors"))
SCRIPT = script_module("make_image_references")
VL = vision_language_config(REFERENCE["config"])


def vl_model(**text) -> VisionLanguageModel:
    """The reference checkpoint as a seqjax model; ``text``: language-model settings (lora, scan_layers, ...)."""
    cfg = dataclasses.replace(VL.text, attention="xla", **text)
    return vision_language_model(load_file(str(DATA / "vl.safetensors")), VL, cfg, "vl.safetensors")


def spec() -> ImageSpec:
    b = REFERENCE["bounds"]
    return ImageSpec(patch_size=QWEN3_VL.patch_size, merge_size=b["merge_size"], temporal_patch_size=2,
                     min_pixels=b["min_pixels"], max_pixels=b["max_pixels"], image_mean=QWEN3_VL.image_mean,
                     image_std=QWEN3_VL.image_std)


def example(name: str) -> ImageExample:
    """A reference example as a batch reads it: its ids, every non-image target scored, its images' patches."""
    drawn, record = SCRIPT.images(), REFERENCE["examples"][name]
    ids = np.asarray(record["ids"])
    pixels, grids = [], []
    for image in record["images"]:
        values, grid = pixel_values(drawn[image], spec())
        pixels.append(values)
        grids.append(tuple(grid))
    pixels = np.concatenate(pixels) if pixels else np.zeros((0, VL.vision.patch_dim), np.float32)
    return ImageExample(ids, (ids != VL.image_token_id).astype(np.float32), pixels, tuple(grids))


LAYOUT = ImageLayout(VL.image_token_id, VL.vision.spatial_merge_size, VL.vision.patch_dim)


def logits(model, rows: list[list[str]], width: int, patches_per_row: int) -> np.ndarray:
    """[B, width, V]: ``rows``' examples packed in order, each row's images in its own patch stream."""
    fields = {k: jnp.asarray(v) for k, v in batch(rows, width, patches_per_row).items()
              if k not in ("targets", "weights")}
    return np.asarray(jax.jit(lambda m, f: m(f.pop("inputs"), **f))(model, fields))


def batch(rows: list[list[str]], width: int, patches_per_row: int) -> dict[str, np.ndarray]:
    """``rows``' examples packed in order, each row's images in its own patch stream."""
    examples = [example(name) for row in rows for name in row]
    row_of = np.asarray([r for r, row in enumerate(rows) for _ in row])
    return image_batch(examples, row_of, len(rows), width, patches_per_row, LAYOUT)
