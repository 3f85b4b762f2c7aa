"""Packed prefill: the prompts packed into rows with segment ids (no padding to the longest), run
through the training attention (the model's own backend: the flash kernel on a GPU), each layer
writing its keys and values straight into the prompts' pages (:class:`Prefill`, a cache in
seqjax.model.cache's sense); each prompt's next-token logits come from its last token.

    row 0: [p0 p0 p0 p0 p0 | p3 p3 p3 | .  .]      segment ids 1 1 1 1 1 2 2 2 0 0
    row 1: [p1 p1 p1 p1 | p2 p2 p2 p2 p2 p2 ]      positions restart at 0 in each prompt

A prompt with images is prefilled one to a row, as its image fields lay it out (the tower's patches
belong to their row). A model with Gated DeltaNet layers packs its prompts like any other: each
layer keeps the state and convolution window after each prompt's own last token
(seqjax.model.deltanet's chunked rule at those places), the segment reset keeping the prompts
apart."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import numpy as np

from seqjax.config.model import ModelConfig
from seqjax.engine.paged import PagedKV, write_pages
from seqjax.model.attention import attention
from seqjax.model.cache import RecurrentView


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillLayer:
    """One attention layer's view for a prefill: attention as training computes it over the packed
    rows (the segment mask, the model's backend), the call's keys and values written straight into
    the layer's pages at the rows' ``slots`` [R, T] (seqjax.engine.paged.write_pages: ``keys`` and
    ``values`` are the stack the layer is in, ``layer`` its place, an int or traced)."""

    keys: jax.Array
    values: jax.Array
    layer: jax.Array | int
    slots: jax.Array
    backend: str = dataclasses.field(metadata=dict(static=True))

    def attend(self, q, k, v, *, segment_ids, window, scale, sinks):
        out = attention(q, k, v, segment_ids, backend=self.backend, scale=scale, window=window,
                        sinks=sinks)
        keys = write_pages(self.keys, self.layer, self.slots, k)
        values = write_pages(self.values, self.layer, self.slots, v)
        return out, dataclasses.replace(self, keys=keys, values=values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefill:
    """The cache a prefill runs through: the paged cache ``kv`` whose pages it fills, and each Gated
    DeltaNet layer's fresh state row (a RecurrentView that keeps the state after each prompt's last
    token ``ends`` [prompts, 2] (row, place); None for an attention layer). Scannable as ``kv`` is
    (stacked blocks, every layer attending: a traced layer index is its place in the one stack), so
    a model with ``model.scan_layers`` prefills in one ``lax.scan`` over its layers, as it trains
    and decodes: one block compiled whatever the depth (36 unrolled layers of Qwen3-8B took 15.6 s
    of a CPU's compile, 2 layers 4 s; ``scripts/plan_memory.py``'s sampling program), and no layer's
    keys and values held beyond its own."""

    kv: PagedKV
    slots: jax.Array
    states: tuple[RecurrentView | None, ...]
    backend: str = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, cfg: ModelConfig, kv: PagedKV, slots, ends) -> "Prefill":
        states = tuple(RecurrentView(ends=ends) if cfg.mixer_of(i) == "deltanet" else None
                       for i in range(cfg.n_layers))
        return cls(kv, slots, states, cfg.attention)

    @property
    def scannable(self) -> bool:
        return self.kv.scannable

    def view(self, i, segment_ids):
        if isinstance(i, int) and self.kv.places[i] is None:
            return self.states[i]
        stack, place = self.kv.where(i)
        return PrefillLayer(self.kv.keys[stack], self.kv.values[stack], place, self.slots, self.backend)

    def put(self, i, view) -> "Prefill":
        if isinstance(view, PrefillLayer):
            return dataclasses.replace(self, kv=self.kv.with_stack(i, view.keys, view.values))
        return dataclasses.replace(self, states=self.states[:i] + (view,) + self.states[i + 1:])

    def advanced(self, segment_ids) -> "Prefill":
        return self


class Packing(NamedTuple):
    """Where each prompt's tokens sit: rows [R, T] of inputs, positions and segment ids; each
    prompt's (row, first column); and for every token of the rows its destination in the pages
    (flat place ``page * page_size + offset``, or ``pages * page_size``: none)."""

    inputs: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    starts: np.ndarray  # [prompts, 2]
    slots: np.ndarray  # [R, T]


def _bucket(n: int, floor: int) -> int:
    """n rounded up to a power of two (at least ``floor``): fewer distinct shapes, fewer
    compiles."""
    return max(floor, 1 << max(0, int(n - 1).bit_length()))


def pack(prompts: Sequence[Sequence[int]], page_tables: np.ndarray, page_size: int, pages: int) -> Packing:
    """First-fit decreasing of the prompts into rows as long as the longest (a power of two), each
    token's page place from its prompt's page table [prompts, P]."""
    width = _bucket(max(len(p) for p in prompts), 16)
    fill: list[int] = []
    where = [(0, 0)] * len(prompts)
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        row = next((r for r, used in enumerate(fill) if used + len(prompts[i]) <= width), len(fill))
        if row == len(fill):
            fill.append(0)
        where[i] = (row, fill[row])
        fill[row] += len(prompts[i])
    rows = _bucket(len(fill), 1)
    inputs = np.zeros((rows, width), np.int32)
    positions, segment_ids = np.zeros_like(inputs), np.zeros_like(inputs)
    slots = np.full((rows, width), pages * page_size, np.int64)
    for i, (row, start) in enumerate(where):
        n = len(prompts[i])
        place = np.arange(n)
        inputs[row, start:start + n] = prompts[i]
        positions[row, start:start + n] = place
        segment_ids[row, start:start + n] = 1 + int(segment_ids[row].max())
        slots[row, start:start + n] = page_tables[i, place // page_size] * page_size + place % page_size
    return Packing(inputs, positions, segment_ids, np.asarray(where, np.int64), slots)


def prefill(model, cache: PagedKV, inputs, positions, segment_ids, slots, last, images: dict | None = None):
    """Run the packed rows through ``model``, every layer's keys and values written into
    ``cache``'s pages at ``slots`` [R, T], and return (next-token logits [prompts, V] float32 from
    the rows' places ``last`` [prompts, 2], the cache, and each Gated DeltaNet layer's state after
    each prompt: a RecurrentView of [prompts, ...], None for attention layers; packed like the
    rest, each prompt's state is the one after its own last token, its segment's alone)."""
    images = images or {}
    x, filled = model.decode(inputs, positions=positions, segment_ids=segment_ids,
                             cache=Prefill.of(model.cfg, cache, slots, last), **images)
    states = tuple(None if view is None else RecurrentView(view.conv, view.state, None)
                   for view in filled.states)
    hidden = x[last[:, 0], last[:, 1]]  # [prompts, D]: each prompt's last token
    logits = model.logits(hidden[:, None])[:, 0]
    return logits, filled.kv, states


def one_a_row(prompts: Sequence[Sequence[int]], page_tables: np.ndarray, page_size: int, pages: int, *,
              width: int, rows: int) -> Packing:
    """One prompt a row of ``width`` (``rows`` rows), from the row's start: prompts with images, as
    their image fields lay them out."""
    inputs = np.zeros((rows, width), np.int32)
    positions, segment_ids = np.zeros_like(inputs), np.zeros_like(inputs)
    slots = np.full((rows, width), pages * page_size, np.int64)
    for i, prompt in enumerate(prompts):
        at, place = slice(0, len(prompt)), np.arange(len(prompt))
        inputs[i, at], positions[i, at], segment_ids[i, at] = prompt, place, 1
        slots[i, at] = page_tables[i, place // page_size] * page_size + place % page_size
    starts = np.asarray([[i, 0] for i in range(len(prompts))], np.int64)
    return Packing(inputs, positions, segment_ids, starts, slots)
