"""The token store's files: their names, dtypes and format version, and how a file is checksummed (the layout
itself is described in :mod:`seqjax.store.reader`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

MANIFEST = "manifest.json"
SHARD_RECORD = "shard.json"
FORMAT_VERSION = 2
TOKENS, DOC_OFFSETS, LINE_OFFSETS = "tokens.bin", "doc_offsets.bin", "line_offsets.bin"
WEIGHTS = "weights.bin"  # instruction data only: which targets are scored
FILES = (TOKENS, DOC_OFFSETS, LINE_OFFSETS)
# chats with images only (seqjax.store.stored_images): each image resized as the processor resizes
# it, 8-bit RGB
PIXELS, IMAGE_SHAPES, DOC_IMAGES = "pixels.bin", "image_shapes.bin", "doc_images.bin"
IMAGE_FILES = (PIXELS, IMAGE_SHAPES, DOC_IMAGES)
MASK_DTYPE = np.dtype(np.uint8)
OFFSET_DTYPE = np.dtype("<i8")
READ_BLOCK = 1 << 24  # bytes per read when checksumming a file
REBUILD_HINT = "delete it and run python -m seqjax.prepare to rebuild it (inside its cache prepare does this itself)"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the memory and bandwidth whenever the ids fit."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def file_checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes, read in blocks (several GB/s, memory flat)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()
