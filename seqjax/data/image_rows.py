"""Packing with two budgets: image-and-text examples into batches of ``rows`` rows of ``seq_len``
tokens whose images together take at most ``patch_budget`` patches, both static shapes for XLA.

An example is ``(tokens, patches)``: its text with one image-pad token per merged patch group, and
the patches of its images. A batch is full when either budget is; the packer fills both:

1. examples by decreasing tokens, then decreasing patches (the large first, as best-fit decreasing);
2. each into the tightest place among the open batches' rows with room for its tokens and patches:
   the one leaving the least of both budgets free, each counted as a fraction of its own (best fit
   in two dimensions);
3. none fits: a new batch opens. At most ``open_batches`` stay open; the fullest is closed when a
   new one would exceed that (a stream's memory stays bounded).

For example, rows=2, seq_len=10, patch_budget=8 and examples (tokens, patches) (6, 8), (5, 0),
(4, 4), (4, 0): (6, 8) opens batch 0; (5, 0) joins it in row 1; (4, 4) needs 4 patches, batch 0 has
none left: batch 1; (4, 0) fits row 0 of batch 0 (6 + 4 = 10 tokens, no patches). Batch 0 then
holds 20 of 20 tokens and 8 of 8 patches.

lmms-engine packs by text length alone, so the patches a batch holds vary and a static budget must
be the largest any batch reaches (scripts/bench_vision.py measures the padding both leave).

**Rows carry their own patches.** :func:`image_batch` lays a batch out as the model reads it: the
five contract fields from the one builder (:func:`seqjax.data.contract.contract_batch`), and each
row's images in that row's own patch stream of ``patches_per_row``, every image field with the rows
as its leading axis. Micro-batches, process slices and a mesh's data shards then cut images with the
rows that read them. The packer for that layout is :func:`pack_two_budgets` with ``rows=1``: each
bin one row, with a row's tokens and a row's patches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqjax.data.contract import FIELDS, Batch, contract_batch
from seqjax.data.ragged import exclusive_cumsum
from seqjax.store.images import patch_inputs, patchify, rope_index


def pack_two_budgets(tokens: np.ndarray, patches: np.ndarray, rows: int, seq_len: int, patch_budget: int,
                     open_batches: int = 64, max_segments: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(batch, row)`` of each example (batches numbered in the order they close or end open); at most
    ``max_segments`` examples a row (``data.max_segments_per_row``), when given.

    >>> pack_two_budgets(np.array([6, 5, 4, 4]), np.array([8, 0, 4, 0]), 2, 10, 8)
    (array([0, 0, 1, 0]), array([0, 1, 0, 0]))
    """
    tokens, patches = np.asarray(tokens, np.int64), np.asarray(patches, np.int64)
    over = np.flatnonzero((tokens > seq_len) | (patches > patch_budget))
    if len(over):
        i = int(over[0])
        raise ValueError(f"example {i}: {tokens[i]} tokens and {patches[i]} patches, more than a row's {seq_len} "
                         f"tokens or a batch's {patch_budget} patches")
    order = np.lexsort((-patches, -tokens))
    free_tokens = np.zeros((0, rows), np.int64)  # [open, rows]
    free_slots = np.zeros((0, rows), np.int64)  # examples a row may still take
    slots = len(tokens) + 1 if max_segments is None else max_segments
    free_patches = np.zeros(0, np.int64)
    ids = np.zeros(0, np.int64)  # each open batch's provisional id
    batch_of, row_of = np.empty(len(tokens), np.int64), np.empty(len(tokens), np.int64)
    opened, closed, final = 0, [], {}
    for i in order:
        t, p = tokens[i], patches[i]
        fits = (free_tokens >= t) & (free_patches >= p)[:, None] & (free_slots > 0)
        # the tightest place: the least left of both budgets, each as a fraction of its own
        if fits.any():
            key = (free_tokens - t) * patch_budget + (free_patches - p)[:, None] * seq_len
            b, r = np.unravel_index(np.argmin(np.where(fits, key, np.iinfo(np.int64).max)), key.shape)
        else:
            if len(free_patches) >= open_batches:  # close the fullest open batch
                full = int(np.argmin(free_tokens.sum(1) * (patch_budget + 1) + free_patches))
                closed.append(ids[full])
                keep = np.arange(len(ids)) != full
                free_tokens, free_patches, ids = free_tokens[keep], free_patches[keep], ids[keep]
                free_slots = free_slots[keep]
            free_tokens = np.vstack([free_tokens, np.full((1, rows), seq_len)])
            free_slots = np.vstack([free_slots, np.full((1, rows), slots)])
            free_patches = np.append(free_patches, patch_budget)
            ids = np.append(ids, opened)
            opened += 1
            b, r = len(ids) - 1, 0
        free_tokens[b, r] -= t
        free_slots[b, r] -= 1
        free_patches[b] -= p
        batch_of[i], row_of[i] = ids[b], r
    # number the batches in the order they closed, then the open ones
    for provisional in [*closed, *ids]:
        final[int(provisional)] = len(final)
    return np.asarray([final[int(b)] for b in batch_of]), row_of


@dataclass(frozen=True)
class ImageExample:
    """One image-and-text example as a batch reads it: ``ids`` [n] with one image-pad token per
    merged patch group of each image, in the images' order; ``weights`` [n]: the weight of
    ``ids[i]`` as a target (0 on prompts and on image tokens); ``pixels`` [patches, patch_dim]
    float32: its images' patches in order (:func:`seqjax.store.images.pixel_values`), ``grids``:
    each image's (t, h, w) in patches."""

    ids: np.ndarray
    weights: np.ndarray
    pixels: np.ndarray
    grids: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class ImageLayout:
    """What laying images into rows needs: the image-pad token's id, the processor's merge size and
    the size of one patch's values (:class:`seqjax.store.images.ImageSpec`)."""

    image_token_id: int
    merge_size: int
    patch_dim: int


# the fields with a patch axis, not a token axis (a batch's width never cuts them)
PATCH_FIELDS = ("patches", "patch_segment_ids", "patch_rows", "patch_columns", "patch_heights", "patch_widths")


def image_batch(examples: list[ImageExample], row_of: np.ndarray, n_rows: int, seq_len: int,
                patches_per_row: int, layout: ImageLayout) -> Batch:
    """A batch of ``n_rows`` rows of ``seq_len`` from ``examples`` (example i in row ``row_of[i]``,
    in the order given within a row): the contract's five fields (:func:`contract_batch`, an example
    of n ids one sequence: inputs ``ids[:-1]``, targets ``ids[1:]``) and :func:`image_fields`'."""
    row_of = np.asarray(row_of, np.int64)
    order = np.argsort(row_of, kind="stable")
    lengths = np.asarray([len(examples[i].ids) for i in order], np.int64)
    stream = np.concatenate([examples[i].ids for i in order]).astype(np.int32)
    scores = np.concatenate([np.asarray(examples[i].weights, np.float32) for i in order])
    batch = contract_batch(stream, exclusive_cumsum(lengths)[:-1], lengths, row_of[order], n_rows, seq_len,
                           scores=scores)
    placed = [(examples[i].ids, examples[i].pixels, examples[i].grids) for i in order]
    return {**batch, **image_fields(placed, row_of[order], n_rows, seq_len, patches_per_row, layout)}


def image_fields(pieces: list[tuple[np.ndarray, np.ndarray, tuple]], row_of_piece: np.ndarray, n_rows: int,
                 seq_len: int, patches_per_row: int, layout: ImageLayout) -> dict[str, np.ndarray]:
    """The image fields of rows of ``pieces`` ``(ids, pixels, grids)``, given in row order as
    :func:`contract_batch` takes them (each piece a sequence: its inputs are ``ids[:-1]``):

    - ``positions_3d`` [B, T, 3]: each example's 3-D rope index from 0 (:func:`rope_index` of its
      ids alone);
    - ``image_index`` [B, T]: the row's i-th image token takes the row's i-th merged patch group, -1
      on text;
    - ``patches`` [B, P, patch_dim] and ``patch_segment_ids``, ``patch_rows``, ``patch_columns``,
      ``patch_heights``, ``patch_widths`` [B, P]: each row's images, one segment each
      (:func:`seqjax.store.images.patch_inputs`), right-padded to P = ``patches_per_row``.
    """
    positions_3d = np.zeros((n_rows, seq_len, 3), np.int32)
    image_index = np.full((n_rows, seq_len), -1, np.int32)
    fields = {"patches": np.zeros((n_rows, patches_per_row, layout.patch_dim), np.float32)}
    at, images_before = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int64)
    in_row: list[list[tuple[np.ndarray, tuple]]] = [[] for _ in range(n_rows)]
    for (ids, pixels, grids), r in zip(pieces, np.asarray(row_of_piece, np.int64).tolist()):
        n = len(ids) - 1  # its inputs
        is_image = np.asarray(ids) == layout.image_token_id
        place = slice(at[r], at[r] + n)
        positions_3d[r, place] = rope_index(is_image, list(grids), layout.merge_size).T[:n]
        image_index[r, place] = np.where(is_image, images_before[r] + np.cumsum(is_image) - 1, -1)[:n]
        images_before[r] += int(is_image.sum())
        at[r] += n
        in_row[r].append((pixels, grids))
    for r, placed in enumerate(in_row):
        pixels = [values for values, _ in placed if len(values)]
        if pixels:
            stream = np.concatenate(pixels)
            if len(stream) > patches_per_row:
                raise ValueError(f"row {r}: {len(stream)} patches, more than data.patches_per_row={patches_per_row}")
            fields["patches"][r, :len(stream)] = stream
        grids = [g for _, piece_grids in placed for g in piece_grids]
        for name, values in patch_inputs(grids, layout.merge_size, patches_per_row).items():
            fields.setdefault(f"patch_{name}", np.zeros((n_rows, *values.shape), values.dtype))[r] = values
    return {"positions_3d": positions_3d, "image_index": image_index, **fields}


def stored_image_fields(store, spec, starts: np.ndarray, lengths: np.ndarray, row_of_piece: np.ndarray, n_rows: int,
                        width: int, patches_per_row: int) -> dict[str, np.ndarray]:
    """:func:`image_fields` of rows of a token store's pieces (``starts``, ``lengths``, each a whole
    example with images, in row order): their ids read from the store, their images from its memory
    map."""
    docs = store.documents_at(starts)
    pieces = []
    for start, length, doc in zip(starts.tolist(), lengths.tolist(), docs.tolist()):
        pixels, grids = store.images.patches(doc, spec)
        pieces.append((np.asarray(store.tokens[start:start + length]), pixels, grids))
    layout = ImageLayout(store.images.image_token_id, spec.merge_size, spec.patch_dim)
    return image_fields(pieces, row_of_piece, n_rows, width, patches_per_row, layout)


def image_example(ids: np.ndarray, images: list[np.ndarray], spec) -> ImageExample:
    """A prompt of ``ids`` (image tokens expanded) with its resized images as a row reads it: its
    inputs are all of ``ids`` (one id more is appended, a row's inputs leaving out the last), none
    scored."""
    pieces = [patchify(image, spec) for image in images]
    pixels = np.concatenate([p for p, _ in pieces]) if pieces else np.zeros((0, spec.patch_dim), np.float32)
    ids = np.append(np.asarray(ids, np.int64), 0)
    return ImageExample(ids, np.zeros(len(ids), np.float32), pixels, tuple(tuple(g) for _, g in pieces))


def prompt_image_fields(examples: list[ImageExample], layout: ImageLayout) -> dict[str, np.ndarray]:
    """The image fields of prompts (:func:`image_example`), one a row, right-padded as
    seqjax.engine pads their ids (one prompt a row): what ``generate(images=...)`` takes."""
    width = max(len(e.ids) - 1 for e in examples)
    # (a whole merged group at least)
    patches = max(layout.merge_size**2, max(len(e.pixels) for e in examples))
    batch = image_batch(examples, np.arange(len(examples)), len(examples), width, patches, layout)
    return {k: v for k, v in batch.items() if k not in FIELDS}
