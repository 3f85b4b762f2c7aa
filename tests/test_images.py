"""Images as Qwen-VL reads them: seqjax's preprocessing equals transformers' own Qwen2-VL image processor (its PIL
backend) on images of odd sizes, aspect ratios and modes, for Qwen2.5-VL's and Qwen3-VL's settings; a bad image is
one line naming the record.

The references (tests/data/vision/images.json) were made by transformers itself from the committed script
scripts/make_image_references.py; the images are drawn from their names by that script's own function.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hf_support import script_module
from seqjax.core.errors import CorpusError
from seqjax.store.images import ImageSpec, image_tokens, open_image, pixel_values, smart_resize

REFERENCE = json.loads((Path(__file__).parent / "data" / "vision" / "images.json").read_text())
SCRIPT = script_module("make_image_references")


def spec(setting: str) -> ImageSpec:
    values, bounds = REFERENCE["settings"][setting], REFERENCE["bounds"]
    return ImageSpec(patch_size=values["patch_size"], merge_size=bounds["merge_size"],
                     temporal_patch_size=bounds["temporal_patch_size"], min_pixels=bounds["min_pixels"],
                     max_pixels=bounds["max_pixels"], image_mean=tuple(values["image_mean"]),
                     image_std=tuple(values["image_std"]))


@pytest.mark.parametrize("key", sorted(REFERENCE["images"]))
def test_pixel_values_equal_transformers_image_processor(key):
    setting, name = key.split("/")
    expected = REFERENCE["images"][key]
    pixels, grid = pixel_values(SCRIPT.images()[name], spec(setting))
    assert list(grid) == expected["grid"] and list(pixels.shape) == expected["shape"]
    where = SCRIPT.sample_positions(key, pixels.shape)
    np.testing.assert_allclose(pixels.reshape(-1)[where], expected["samples"], rtol=0, atol=1e-6)
    assert float(pixels.astype(np.float64).sum()) == pytest.approx(expected["sum"], rel=1e-7, abs=1e-3)
    assert float((pixels.astype(np.float64) ** 2).sum()) == pytest.approx(expected["sum_squares"], rel=1e-7)
    assert image_tokens(grid, spec(setting)) * 4 == pixels.shape[0]


def test_smart_resize_keeps_the_bounds_and_the_factor():
    s = ImageSpec(max_pixels=28 * 28 * 16)
    for h, w in ((27, 29), (1000, 1000), (400, 90), (90, 400)):  # (extreme ratios may pass max: as transformers)
        rh, rw = smart_resize(h, w, s)
        assert rh % 28 == 0 and rw % 28 == 0 and s.min_pixels <= rh * rw <= s.max_pixels, (h, w, rh, rw)
    with pytest.raises(ValueError, match="aspect ratio of 201; expected at most 200"):
        smart_resize(1, 201, s)


def test_a_missing_unreadable_or_truncated_image_is_one_line_naming_the_record(tmp_path):
    image = SCRIPT.images()["wide"]
    image.save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.png").write_text("not an image")
    assert open_image(tmp_path / "ok.png", "r:1").size == image.size
    assert open_image(data, "r:1").size == image.size  # (bytes, as a parquet column holds them)
    for file, expected in (("gone.png", "not found"), ("cut.png", "unreadable or truncated"),
                           ("text.png", "unreadable or truncated")):
        with pytest.raises(CorpusError, match=f"^data.jsonl:3: image .*{file}.* {expected}"):
            open_image(tmp_path / file, "data.jsonl:3")


ROPE = json.loads((Path(__file__).parent / "data" / "vision" / "rope.json").read_text())


@pytest.mark.parametrize("key", sorted(ROPE["positions"]))
def test_the_3d_rope_index_equals_transformers_get_rope_index(key):
    from seqjax.store.images import rope_index

    parts = ROPE["sequences"][key.split("/")[1]]
    image_token, grids = [], []
    for part in parts:
        if isinstance(part, int):
            image_token += [False] * part
        else:
            grids.append(tuple(part))
            image_token += [True] * (part[0] * part[1] * part[2] // 4)
    np.testing.assert_array_equal(rope_index(np.asarray(image_token), grids, 2), ROPE["positions"][key])
