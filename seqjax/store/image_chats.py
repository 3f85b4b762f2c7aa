"""Chats with images, as TRL and transformers' processors take them: messages whose content is a
list of parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, the images in the
record's ``images`` column (in the order of the image parts), or named by a part itself (``image``,
``path`` or ``url``). A path is relative to the data file; parquet rows may hold the bytes
(``{"bytes": ...}``, as a Hugging Face dataset stores an image).

The chat template renders each image part as the image token (Qwen-VL's
``<|vision_start|><|image_pad|> <|vision_end|>``); the processor then repeats the image token once
per merged group of patches. Here the template's text is tokenized as any chat
(:mod:`seqjax.store.examples`) and each image token's one id becomes ``t * h * w / m^2`` copies,
never scored. For example an image of 100 x 60 pixels under patch 14, merge 2 resizes to 112 x 56, a
grid of (1, 8, 4): its one ``<|image_pad|>`` becomes 8.

A missing, unreadable or truncated image, or image parts that do not match the images given, is one
line naming the record; nothing is written for a store that fails (:mod:`seqjax.store.writer`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from seqjax.core.errors import ConfigError, CorpusError
from seqjax.store.images import ImageSpec, image_spec_from_hf, image_tokens, open_image, resized
from seqjax.store.spec import IMAGE_BASE, ExampleSpec

PREPROCESSOR = "preprocessor_config.json"
IMAGE_PARTS = ("image", "image_url")
OWN_SOURCE = ("image", "path", "url")  # what a part may name its own image by (transformers' keys)


def image_processor_file(path: str) -> Path:
    """The preprocessor_config.json ``data.image_processor`` names (the file, or the folder holding
    it)."""
    return Path(path) / PREPROCESSOR if Path(path).is_dir() else Path(path)


def read_image_spec(path: str | None) -> ImageSpec | None:
    """``data.image_processor`` (a preprocessor_config.json, or a folder holding one) as an
    ImageSpec."""
    if path is None:
        return None
    file = image_processor_file(path)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"data.image_processor: {file} is not a readable JSON file ({err}); expected a "
                          f"{PREPROCESSOR} or the model folder holding one") from None
    return image_spec_from_hf(config, str(file))


def without_nulls(messages: Any) -> Any:
    """Messages with each content part's null keys dropped: a Hugging Face dataset (parquet) gives
    every part every key of the column's struct, and a template asking ``'image' in content`` would
    take a text part with ``image: null`` for an image."""
    if not isinstance(messages, list):
        return messages
    return [{**m, "content": [{k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
                              for part in m["content"]]}
            if isinstance(m, dict) and isinstance(m.get("content"), list) else m for m in messages]


def image_parts(messages: Any) -> list[dict]:
    """The image parts of a chat's messages, in order."""
    return [part for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") in IMAGE_PARTS]


def image_sources(spec: ExampleSpec, record: dict, where: str) -> list[str | bytes]:
    """Each image part's image (a path made absolute, or bytes), in order; parts without their own
    take the ``images`` column's in turn, and both counts must agree."""
    messages = record.get(spec.messages_field) or []
    parts = image_parts(messages)
    if any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            isinstance(part, dict) and part.get("type") == "video" for part in m["content"]) for m in messages):
        raise CorpusError(f"{where}: a video part; expected images only (seqjax does not read video)")
    column = record.get(spec.images_field) or []
    if not isinstance(column, list):
        raise CorpusError(f"{where}: field {spec.images_field!r} is {type(column).__name__}; expected a list of "
                          "image paths or bytes")
    if parts and spec.image_spec is None:
        raise CorpusError(f"{where}: a chat with {len(parts)} image parts, but data.image_processor is null; "
                          "expected the model's preprocessor_config.json (or folder) there")
    base = Path(record.get(IMAGE_BASE, "."))
    given = iter(column)
    sources = []
    for part in parts:
        own = next((part[k] for k in OWN_SOURCE if part.get(k) is not None), None)
        if isinstance(part.get("image_url"), dict):
            own = part["image_url"].get("url")
        if own is None:
            own = next(given, None)
            if own is None:
                raise CorpusError(f"{where}: {len(parts)} image parts but {len(column)} images in "
                                  f"{spec.images_field!r}; expected one image for each part without its own")
        sources.append(_source(own, base, where))
    if next(given, None) is not None:
        raise CorpusError(f"{where}: {len(column)} images in {spec.images_field!r} for {len(parts)} image parts; "
                          "expected one image for each part without its own")
    return sources


def _source(value: Any, base: Path, where: str) -> str | bytes:
    if isinstance(value, dict):  # a Hugging Face dataset's Image: {"bytes": ..., "path": ...}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        if "://" in value:
            raise CorpusError(f"{where}: image {value!r} is a URL; expected a path relative to the data file or "
                              "the image's bytes (nothing is downloaded)")
        return str(base / value)
    raise CorpusError(f"{where}: an image given as {type(value).__name__}; expected a path or bytes")


def image_files(sources: list[str | bytes]) -> list[tuple[str, int, int]]:
    """(path, bytes, mtime_ns) of the images read from files: what a store's reuse compares (its
    data files name them, so their own identity does not cover them)."""
    out = []
    for source in sources:
        if isinstance(source, str):
            stat = os.stat(source)
            out.append((str(Path(source).resolve()), stat.st_size, stat.st_mtime_ns))
    return out


def changed_images(shard: dict[str, Any]) -> list[str]:
    """The images a shard was built from that changed since (size or time), or are gone, each as a
    line."""
    problems = []
    for path, size, mtime_ns in shard.get("image_files", []):
        try:
            stat = os.stat(path)
        except OSError:
            problems.append(f"image {path} is gone since the build")
            continue
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            problems.append(f"image {path} changed since the build ({size:,} bytes then, {stat.st_size:,} now)")
    return problems


def expand_images(ids: np.ndarray, mask: np.ndarray, sources: list[str | bytes], spec: ExampleSpec,
                  image_id: int, where: str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(ids with each image token repeated once per merged patch group, the mask 0 on them, the
    images resized as 8-bit RGB)."""
    at = np.flatnonzero(ids == image_id)
    if len(at) != len(sources):
        raise CorpusError(f"{where}: the chat template put {len(at)} {spec.image_token} tokens for {len(sources)} "
                          "images; expected one for each image part (data.image_token names the token)")
    images = [resized(open_image(source, where), spec.image_spec) for source in sources]
    counts = np.ones(len(ids), np.int64)
    for k, image in zip(at, images):
        p = spec.image_spec.patch_size
        counts[k] = image_tokens((1, image.shape[0] // p, image.shape[1] // p), spec.image_spec)
    out_mask = np.where(ids == image_id, 0, mask).astype(mask.dtype)
    return np.repeat(ids, counts), np.repeat(out_mask, counts), images
