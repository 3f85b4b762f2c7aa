"""Images as a Qwen-VL vision encoder reads them: decoded with Pillow, resized, normalized and cut into
patches as transformers' Qwen2-VL image processor (its PIL backend) does, in numpy.

For an image of ``H x W`` pixels and an :class:`ImageSpec` (patch size p, merge size m, temporal
patch size t):

1. **Resize** to ``smart_resize(H, W)``: both sides multiples of ``p * m``, the aspect ratio kept as closely as
   possible, the pixel count within ``[min_pixels, max_pixels]``; bicubic, on the 8-bit RGB image
   (Pillow).
2. **Rescale** to [0, 1] (computed in float64, kept as float32) and **normalize** by ``image_mean`` and
   ``image_std`` per channel (float32).
3. **Patchify**: ``grid = (1, h / p, w / p)``; the patches [grid_h * grid_w, 3 * t * p * p] in the order the
   merger reads them (each ``m x m`` group of neighbouring patches consecutive), every patch
   repeated ``t`` times along time (an image is one frame of a video of ``t``).

For example a 100 x 60 image at p = 14, m = 2 resizes to 112 x 56: a grid of (1, 8, 4), 32 patches
of 3 * 2 * 14 * 14 = 1176 values, and 8 merged groups: 8 image tokens in the text.

Qwen2.5-VL's processor uses CLIP's mean and std and p = 14; Qwen3-VL's 0.5 and 0.5 and p = 16
(:data:`QWEN3_VL`). ``tests/test_images.py`` compares with transformers' own processor.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from seqjax.core.errors import CorpusError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """A Qwen-VL image processor's settings (its preprocessor_config.json), transformers' defaults."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @property
    def patch_dim(self) -> int:
        """Values in one patch: 3 channels x the temporal pair x p x p."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    @property
    def factor(self) -> int:
        """What both resized sides are multiples of: one merged group of patches."""
        return self.patch_size * self.merge_size


def image_spec_from_hf(config: dict, source: str = "preprocessor_config.json") -> ImageSpec:
    """A Qwen-VL ``preprocessor_config.json`` (a dict) as an :class:`ImageSpec`: the pixel bounds from
    ``min_pixels``/``max_pixels`` or ``size`` (``shortest_edge``/``longest_edge``, transformers 5's
    names), every setting that changes the computation read, or refused in one line when seqjax
    computes something else."""
    size = config.get("size") or {}
    values = {"patch_size": config.get("patch_size", 14), "merge_size": config.get("merge_size", 2),
              "temporal_patch_size": config.get("temporal_patch_size", 2),
              "min_pixels": config.get("min_pixels", size.get("shortest_edge", ImageSpec.min_pixels)),
              "max_pixels": config.get("max_pixels", size.get("longest_edge", ImageSpec.max_pixels)),
              "image_mean": tuple(config.get("image_mean", CLIP_MEAN)),
              "image_std": tuple(config.get("image_std", CLIP_STD))}
    computed = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "resample": 3, "rescale_factor": 1 / 255}
    for key, wanted in computed.items():
        if key in config and config[key] != wanted and not (key == "rescale_factor"
                                                            and abs(config[key] - wanted) < 1e-12):
            raise CorpusError(f"{source}: {key} is {config[key]!r}; seqjax preprocesses images with {key}="
                              f"{wanted!r} only")
    for key in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
        if not isinstance(values[key], int) or values[key] < 1:
            raise CorpusError(f"{source}: {key} is {values[key]!r}; expected a positive integer")
    if len(values["image_mean"]) != 3 or len(values["image_std"]) != 3:
        raise CorpusError(f"{source}: image_mean and image_std need three values (RGB)")
    return ImageSpec(**values)


QWEN3_VL = ImageSpec(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


def smart_resize(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The resized ``(height, width)``: multiples of ``spec.factor``, the pixel count within the spec's bounds,
    the aspect ratio kept as closely as those allow (transformers' ``smart_resize``)."""
    factor = spec.factor
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an aspect ratio of {max(height, width) / min(height, width):.0f}; expected at most 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def open_image(source: str | Path | bytes, where: str):
    """A record's image (a file, or its bytes) decoded as 8-bit RGB; a missing, unreadable or truncated one is
    one line naming ``where``."""
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
            image.load()
            return to_rgb(image)
    except FileNotFoundError:
        raise CorpusError(f"{where}: image {source} not found; expected a path relative to the data file, or the "
                          "image's bytes") from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        name = "its bytes" if isinstance(source, bytes) else str(source)
        raise CorpusError(f"{where}: image {name} is unreadable or truncated ({err}); expected a whole PNG, JPEG "
                          "or other image Pillow decodes") from None


def to_rgb(image):
    """8-bit RGB, transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def pixel_values(image, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(patches [grid_h * grid_w, 3 * t * p * p] float32, grid (1, grid_h, grid_w))`` of an image."""
    return patchify(resized(image, spec), spec)


def resized(image, spec: ImageSpec) -> np.ndarray:
    """Steps 1 of the processor: the image as 8-bit RGB [H, W, 3] at ``smart_resize``'s size (what a store
    keeps: the rest is exact arithmetic on it, 8 times smaller than the float patches)."""
    image = to_rgb(image)
    height, width = smart_resize(image.height, image.width, spec)
    return np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC), np.uint8)


def patchify(pixels_8bit: np.ndarray, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Steps 2 and 3 on a :func:`resized` image: ``(patches, grid)`` as :func:`pixel_values`."""
    height, width = pixels_8bit.shape[:2]
    pixels = (np.asarray(pixels_8bit).astype(np.float64) * (1 / 255)).astype(np.float32)  # [H, W, 3]
    pixels = (pixels - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = height // p, width // p
    patches = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)


def image_tokens(grid: tuple[int, int, int], spec: ImageSpec) -> int:
    """The image-pad tokens an image of ``grid`` takes in the text: one per merged group of patches."""
    return grid[0] * grid[1] * grid[2] // (spec.merge_size**2)


def rope_index(image_token: np.ndarray, grids: list[tuple[int, int, int]], merge_size: int) -> np.ndarray:
    """The 3-D rotary positions [3, n] (time, height, width) of one example's ``n`` tokens, counted from 0:
    ``image_token[i]`` is True on an image's tokens (its merged patch groups), ``grids`` are the
    example's images in order (in patches). Text counts 0, 1, 2, ... on all three axes; an image's
    tokens take ``start + (0, row, column)`` over its merged grid, and the text after it goes on
    from ``start + max(rows, columns)``: Qwen2.5-VL's and Qwen3-VL's ``get_rope_index`` for images.
    A packed example's positions start at 0 because each example's are computed alone, from its own
    tokens and grids (never from where positions restart in a row).

    >>> rope_index(np.array([0, 1, 1, 1, 1, 1, 1, 0], bool), [(1, 4, 6)], 2).tolist()
    [[0, 1, 1, 1, 1, 1, 1, 4], [0, 1, 1, 1, 2, 2, 2, 4], [0, 1, 2, 3, 1, 2, 3, 4]]
    """
    n = len(image_token)
    out = np.zeros((3, n), np.int64)
    image_token = np.asarray(image_token, bool)
    edges = np.flatnonzero(np.diff(np.r_[False, image_token, False].astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(grids):
        raise ValueError(f"{len(starts)} runs of image tokens, expected one per image ({len(grids)})")
    position, at = 0, 0
    for (s, e), (t, h, w) in zip(zip(starts, ends), grids):
        out[:, at:s] = position + np.arange(s - at)
        position += s - at
        rows, columns = h // merge_size, w // merge_size
        if e - s != t * rows * columns:
            raise ValueError(f"an image of grid {(t, h, w)} takes {t * rows * columns} tokens, got {e - s}")
        k = np.arange(e - s)
        out[0, s:e] = position + k // (rows * columns)
        out[1, s:e] = position + (k // columns) % rows
        out[2, s:e] = position + k % columns
        position += max(h, w) // merge_size
        at = e
    out[:, at:] = position + np.arange(n - at)
    return out


def patch_inputs(grids: list[tuple[int, int, int]], merge_size: int,
                 budget: int | None = None) -> dict[str, np.ndarray]:
    """What a vision encoder reads besides the pixels, for images of ``grids`` packed in one patch stream (in
    the processor's order: each ``m x m`` group of neighbouring patches consecutive), padded to
    ``budget`` patches: ``segment_ids`` (image 1, 2, ...; 0 on padding), each patch's ``rows`` and
    ``columns`` in its image's grid, and that grid's ``heights`` and ``widths`` (which the tower's
    learned positions are resampled to: :class:`seqjax.model.vision.VisionTower`).

    >>> patch_inputs([(1, 2, 4)], 2)["columns"].tolist()
    [0, 1, 0, 1, 2, 3, 2, 3]
    """
    parts = {"segment_ids": [], "rows": [], "columns": [], "heights": [], "widths": []}
    for image, (t, h, w) in enumerate(grids, start=1):
        if h % merge_size or w % merge_size:
            raise ValueError(f"image grid {(t, h, w)}: sides must be multiples of the merge size {merge_size}")
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        parts["rows"].append(np.tile(r.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t))
        parts["columns"].append(np.tile(c.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1), t))
        for name, value in (("segment_ids", image), ("heights", h), ("widths", w)):
            parts[name].append(np.full(t * h * w, value))
    out = {name: np.concatenate(values).astype(np.int32) if values else np.zeros(0, np.int32)
           for name, values in parts.items()}
    if budget is not None:
        n = len(out["rows"])
        if n > budget:
            raise ValueError(f"{n} patches, more than the budget of {budget}")
        out = {k: np.concatenate([v, np.zeros(budget - n, v.dtype)]) for k, v in out.items()}
    return out
