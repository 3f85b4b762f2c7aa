"""A store's images (chats with images, :mod:`seqjax.store.image_chats`): each image as the
processor resizes it, 8-bit RGB, flat on disk and memory-mapped, so a corpus of many images reads
with flat memory (the pages a batch touches) and every later step (rescale, normalize, patches) is
exact arithmetic on those bytes, 8 times smaller than the float patches.

Per shard, beside the tokens (:mod:`seqjax.store.reader`)::

    pixels.bin          uint8, every image's H * W * 3 bytes in order
    image_shapes.bin    int32 [n_images, 2]: each image's (H, W)
    doc_images.bin      int64 [n_docs + 1]: document i's images are doc_images[i] .. doc_images[i + 1] - 1

For example two documents, the first with images of 32 x 64 and 64 x 32 pixels and the second with
none, give ``image_shapes [[32, 64], [64, 32]]``, ``doc_images [0, 2, 2]`` and 12,288 bytes of
pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seqjax.store.images import ImageSpec, patchify
from seqjax.store.layout import DOC_IMAGES, IMAGE_SHAPES, OFFSET_DTYPE, PIXELS


class StoredImages:
    """The images of a store's shards, read as one list by document number."""

    def __init__(self, shards: list[Path], image_token_id: int):
        self.image_token_id = image_token_id  # the token each merged patch group takes in the text
        self.pixels = [np.memmap(s / PIXELS, np.uint8, mode="r") if (s / PIXELS).stat().st_size else
                       np.zeros(0, np.uint8) for s in shards]
        self.shapes = [np.fromfile(s / IMAGE_SHAPES, np.int32).reshape(-1, 2) for s in shards]
        self.doc_images = [np.fromfile(s / DOC_IMAGES, OFFSET_DTYPE) for s in shards]
        self.starts = [np.concatenate([[0], np.cumsum(np.prod(sh, axis=1, dtype=np.int64) * 3)]) for sh in self.shapes]
        self.doc_bases = np.cumsum([0] + [len(d) - 1 for d in self.doc_images])

    def patch_counts(self, patch_size: int) -> np.ndarray:
        """Patches of each document's images [n_docs] (an image of H x W pixels has H W / p^2)."""
        out = []
        for shapes, offsets in zip(self.shapes, self.doc_images):
            per_image = np.prod(shapes, axis=1, dtype=np.int64) // (patch_size * patch_size)
            totals = np.concatenate([[0], np.cumsum(per_image)])
            out.append(totals[offsets[1:]] - totals[offsets[:-1]])
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _where(self, doc: int) -> tuple[int, int]:
        shard = int(np.searchsorted(self.doc_bases, doc, "right")) - 1
        return shard, doc - int(self.doc_bases[shard])

    def of(self, doc: int) -> list[np.ndarray]:
        """Document ``doc``'s images, uint8 [H, W, 3] each (views of the memory map)."""
        shard, i = self._where(doc)
        out = []
        for k in range(int(self.doc_images[shard][i]), int(self.doc_images[shard][i + 1])):
            h, w = (int(v) for v in self.shapes[shard][k])
            start = int(self.starts[shard][k])
            out.append(np.asarray(self.pixels[shard][start:start + h * w * 3]).reshape(h, w, 3))
        return out

    def patches(self, doc: int, spec: ImageSpec) -> tuple[np.ndarray, tuple[tuple[int, int, int], ...]]:
        """Document ``doc``'s images as a vision encoder reads them: (patches [n, patch_dim]
        float32, grids)."""
        pieces = [patchify(image, spec) for image in self.of(doc)]
        if not pieces:
            return np.zeros((0, spec.patch_dim), np.float32), ()
        return np.concatenate([values for values, _ in pieces]), tuple(grid for _, grid in pieces)
