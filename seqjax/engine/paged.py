"""The paged KV cache: every layer's keys and values in fixed-size pages (stacked as the blocks
are: [1, pages, Hkv, page_size, D] a layer unrolled, [layers, ...] for stacked blocks), and each
decode row's page table. A row (a decode slot) holds one sequence: its place j in the sequence lives at page
``page_table[row, j // page_size]``, offset ``j % page_size``. A GRPO group's completions point at
the same prompt pages (a prompt is stored once); a completion writes only its own pages.

    pages:       [P0 P1 P2] [P3]      a prompt of 2.5 pages, prefilled once
    slot 0:      P0 P1 P4 P7 ...      completion 0: P4 is P2 copied on first write, then its own
    slot 1:      P0 P1 P5 P8 ...      completion 1 of the same prompt
    slot 2:      P3 P6 ...            another prompt's completion

:class:`PagedKV` is a cache in seqjax.model.cache's sense: the model's decode writes each layer's
new keys and values through :class:`PagedLayer` and attends over the row's pages under
:func:`seqjax.model.mask.page_mask`. Attention runs one of two ways (``engine.attention``): the
XLA path gathers each row's pages and runs the dense masked softmax (every backend); ``pallas``
reads the pages in place, seqjax.model.kernels.paged's kernel (a decode step's one token a row).
A call of more tokens a row (a prompt's later piece, seqjax.engine.engine) reads the pages a block
at a time with a running softmax (:func:`blockwise_attention`), on every backend. A model with
stacked blocks (``model.scan_layers``) decodes as one ``lax.scan`` over its layers, the cache in
the scan's carry: a layer's pages are found by a traced index into the stacked pool and written in
place. A Gated DeltaNet layer holds no pages: its row of the cache is each decode slot's
convolution window and recurrent state, which a sequence copies from its prompt's when it starts
(``with_states``)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from seqjax.config.model import ModelConfig
from seqjax.model.attention import masked_attention, with_sinks
from seqjax.model.cache import RecurrentView
from seqjax.model.kernels.paged import paged_attention
from seqjax.model.mask import page_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedLayer:
    """One layer's view of :class:`PagedKV` for one call: the stack of pages it is in [n, pages,
    Hkv, page_size, D] (its own, or every layer's for stacked blocks) and its place ``layer`` in it
    (an int, or traced in a scanned decode), the rows' page tables [B, P] and lengths [B] (places
    written before the call), the call's tokens' segment ids (0: the row writes nothing)."""

    keys: jax.Array
    values: jax.Array
    layer: jax.Array | int
    page_table: jax.Array
    lengths: jax.Array
    segment_ids: jax.Array
    attention: str = dataclasses.field(default="xla", metadata={"static": True})  # (engine.attention)

    def attend(self, q, k, v, *, segment_ids, window, scale, sinks):
        """Write the call's keys and values at places ``lengths..`` of each row, then attend over
        the row's pages (the XLA path: pages gathered, :func:`page_mask`, a float32 softmax)."""
        pages, size = self.keys.shape[1], self.keys.shape[3]
        b, t = segment_ids.shape
        real = segment_ids > 0
        place = self.lengths[:, None] + jnp.cumsum(real, axis=1) - 1  # (a row's real tokens, in order)
        column = jnp.clip(place // size, 0, self.page_table.shape[1] - 1)
        page = jnp.take_along_axis(self.page_table, column, axis=1)
        slot = jnp.where(real & (page < pages), page * size + place % size, pages * size)  # (else dropped)
        keys = write_pages(self.keys, self.layer, slot, k)
        values = write_pages(self.values, self.layer, slot, v)
        written = dataclasses.replace(self, keys=keys, values=values)
        if self.attention == "pallas" and t == 1:
            return self._kernel(q, keys, values, real, scale, window, sinks), written
        total = self.lengths + jnp.sum(real, axis=1)
        if t > 1:  # (a prompt's later piece: its queries over the pages a block at a time)
            return blockwise_attention(q, keys, values, self.layer, self.page_table, place, real, total,
                                       window=window, scale=scale, sinks=sinks), written
        capacity = self.page_table.shape[1] * size
        gathered_k = _gather(keys, self.layer, self.page_table)
        gathered_v = _gather(values, self.layer, self.page_table)
        mask = page_mask(place, real, total, capacity, window)
        out = masked_attention(q, gathered_k.astype(q.dtype), gathered_v.astype(q.dtype), mask, scale=scale,
                               sinks=sinks, heads_first=True)
        return out, written

    def _kernel(self, q, keys, values, real, scale, window, sinks):
        """One token a row through the Pallas kernel: the row's places up to its new one (an idle
        row: none, zeros, as the XLA path gives), the sinks through the log-sum-exp."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        length = jnp.where(real[:, 0], self.lengths + 1, 0)
        out, lse = paged_attention(q[:, 0], keys, values, self.page_table, length, scale=scale,
                                   window=window, layer=self.layer)
        out = out[:, None]
        return out if sinks is None else with_sinks(out, lse[:, :, None], sinks)


# Keys a block of blockwise_attention reads at once (a piece's scores are [heads, piece, this]).
BLOCK_KEYS = 1024


def blockwise_attention(q, keys, values, layer, page_table, place, real, total, *, window, scale, sinks,
                        block_pages: int | None = None) -> jax.Array:
    """Queries of many tokens a row (q [B, T, H, D], at places ``place`` [B, T], real where
    ``real``) over the row's pages of layer ``layer`` (``total`` [B] places written), under
    :func:`page_mask`, ``block_pages`` pages at a time with a running softmax (float32): the same
    attention as the gathered path's, its scores [B, H, T, block] instead of [B, H, T, capacity],
    so a prompt's later piece holds a block's scores whatever the prompt's length; ``sinks``
    through the log-sum-exp."""
    b, t, h, d = q.shape
    size, hkv = keys.shape[3], keys.shape[2]
    per = block_pages or max(1, BLOCK_KEYS // size)
    blocks = -(-page_table.shape[1] // per)
    table = jnp.pad(page_table, ((0, 0), (0, blocks * per - page_table.shape[1])), constant_values=keys.shape[1])
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]

    def block(carry, j):
        top, total_weight, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * per, per, axis=1)
        k, v = (_gather(a, layer, pages).astype(q.dtype) for a in (keys, values))
        mask = page_mask(place, real, total, per * size, window, kv_start=j * per * size)
        logits = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.exp(logits - shift[..., None])
        keep = jnp.exp(top - shift)
        acc = acc * keep[..., None] + jnp.einsum("bkgts,bksd->bkgtd", weights, v.astype(jnp.float32))
        return (new_top, total_weight * keep + jnp.sum(weights, axis=-1), acc), None

    start = (jnp.full((b, hkv, h // hkv, t), -jnp.inf), jnp.zeros((b, hkv, h // hkv, t)),
             jnp.zeros((b, hkv, h // hkv, t, d)))
    (top, total_weight, acc), _ = jax.lax.scan(block, start, jnp.arange(blocks))
    out = (acc / jnp.where(total_weight > 0, total_weight, 1.0)[..., None]).astype(q.dtype)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    if sinks is None:
        return out
    return with_sinks(out, (top + jnp.log(total_weight)).reshape(b, h, t), sinks)


def write_pages(pages: jax.Array, layer, slot: jax.Array, new: jax.Array) -> jax.Array:
    """``new`` [..., Hkv, D] written at each place ``slot`` [...] (page x page_size + offset; the
    pool's size or more: dropped) of layer ``layer``'s pages in the stack ``pages`` [n, pages,
    Hkv, page_size, D] (in place: one scatter into the stack)."""
    size, slot = pages.shape[3], slot.reshape(-1)
    return pages.at[layer, slot // size, :, slot % size].set(
        new.reshape(-1, *new.shape[-2:]).astype(pages.dtype), mode="drop")


def _gather(pages: jax.Array, layer, page_table: jax.Array) -> jax.Array:
    """[B, Hkv, P x page_size, D]: each row's pages of layer ``layer`` in order, heads first (a
    table's unused entries read the last page: masked), in one gather from the stacked pool. Pages
    hold their heads apart, so the gathered keys come out in the order the attention's products take
    them (on a CPU the products and the gather both run faster so)."""
    b, width = page_table.shape
    table = jnp.minimum(page_table, pages.shape[1] - 1)
    gathered = jnp.swapaxes(pages[layer, table], 1, 2)  # [B, Hkv, P, S, D]
    return gathered.reshape(b, pages.shape[2], width * pages.shape[3], pages.shape[4])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """The attention layers' pages in stacks (keys, values: a tuple of [n, pages, Hkv, page_size, D]
    arrays, laid out as the blocks are: one stack per layer for unrolled blocks, one of every layer
    for stacked ones), the decode rows' page tables [B, P] (an entry of ``pages`` or more: no page)
    and lengths [B] (places written); every Gated DeltaNet layer's state row (``recurrent``: each
    decode row's convolution window and state, seqjax.model.cache.RecurrentView; None for an
    attention layer); and ``places``, each layer's (stack, place in it), None for a state row. A
    scanned decode carries its one stack through its ``lax.scan`` and writes each layer's pages in
    place; unrolled, each layer writes its own stack (one stack for all unrolled layers decoded
    1,080 new tokens/s where per-layer arrays decoded 1,348, bench_engine's small CPU shape; one
    stack a layer, as here, 1,328 to 1,459)."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    recurrent: tuple[RecurrentView | None, ...]
    attention: str = dataclasses.field(default="xla", metadata={"static": True})
    places: tuple[tuple[int, int] | None, ...] = dataclasses.field(default=(), metadata={"static": True})

    @classmethod
    def empty(cls, cfg: ModelConfig, pages: int, page_size: int, rows: int, table: int,
              attention: str = "xla") -> "PagedKV":
        linear = [cfg.mixer_of(i) == "deltanet" for i in range(cfg.n_layers)]
        if cfg.scan_layers:  # (one kind of block: every layer attends)
            places = tuple((0, i) for i in range(cfg.n_layers))
        else:
            stacks = itertools.accumulate(not lin for lin in linear)
            places = tuple(None if lin else (n - 1, 0) for lin, n in zip(linear, stacks))
        count = 1 + max(p[0] for p in places if p is not None)
        depth = cfg.n_layers if cfg.scan_layers else 1
        dtype = jnp.dtype(cfg.compute_dtype)
        shape = (depth, pages, cfg.kv_heads, page_size, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(count))
        states = tuple(recurrent_rows(cfg, rows) if lin else None for lin in linear)
        tables = jnp.full((rows, table), pages, jnp.int32)
        return cls(zeros, zeros, tables, jnp.zeros((rows,), jnp.int32), states, attention, places)

    @property
    def pages(self) -> int:
        return self.keys[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.keys[0].shape[3]

    @property
    def scannable(self) -> bool:
        """One stack of every layer, in order: a traced layer index is its place in it."""
        return self.places == tuple((0, i) for i in range(len(self.places)))

    def where(self, i) -> tuple[int, jax.Array | int]:
        """Attention layer ``i``'s (stack, place in it); a traced ``i`` (scannable) is its place in
        the one stack."""
        return (0, i) if not isinstance(i, int) else self.places[i]

    def with_stack(self, i, keys: jax.Array, values: jax.Array) -> "PagedKV":
        """The cache with attention layer ``i``'s stack replaced by ``keys`` and ``values``."""
        stack = self.where(i)[0]

        def replaced(stacks, new):
            return stacks[:stack] + (new,) + stacks[stack + 1:]
        return dataclasses.replace(self, keys=replaced(self.keys, keys), values=replaced(self.values, values))

    def view(self, i, segment_ids: jax.Array):
        """Layer ``i``'s :class:`PagedLayer`, or its state row continuing each row's sequence."""
        if isinstance(i, int) and self.places[i] is None:  # (a decode token continues its sequence)
            carry = jnp.ones(segment_ids.shape[:1], segment_ids.dtype)
            return dataclasses.replace(self.recurrent[i], carry=carry)
        stack, place = self.where(i)
        return PagedLayer(self.keys[stack], self.values[stack], place, self.page_table, self.lengths,
                          segment_ids, self.attention)

    def put(self, i, view) -> "PagedKV":
        if isinstance(view, PagedLayer):
            return self.with_stack(i, view.keys, view.values)
        states = list(self.recurrent)
        states[i] = dataclasses.replace(view, carry=None)
        return dataclasses.replace(self, recurrent=tuple(states))

    def advanced(self, segment_ids: jax.Array) -> "PagedKV":
        lengths = self.lengths + jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)
        return dataclasses.replace(self, lengths=lengths)

    def copy_pages(self, source: jax.Array, target: jax.Array) -> "PagedKV":
        """Page ``source[i]`` copied to ``target[i]`` in every layer (a target of ``pages``:
        none)."""
        def copy(pool):
            return pool.at[:, target].set(jnp.take(pool, source, axis=1, mode="clip"), mode="drop")

        return dataclasses.replace(self, keys=tuple(map(copy, self.keys)), values=tuple(map(copy, self.values)))

    def with_states(self, rows: jax.Array, states: tuple, which: jax.Array) -> "PagedKV":
        """Each decode row in ``rows`` [B] (bool) starts from ``states`` (per layer, a view of
        [prompts, ...] or None) at prompt ``which`` [B]: a prompt's state is kept once, and each of
        its sequences takes a copy when it starts."""
        def take(mine: RecurrentView | None, theirs: RecurrentView | None):
            if mine is None:
                return None
            pick = [jnp.where(rows.reshape(-1, *[1] * (a.ndim - 1)), jnp.take(b, which, axis=0), a)
                    for a, b in ((mine.conv, theirs.conv), (mine.state, theirs.state))]
            return RecurrentView(*pick, None)

        return dataclasses.replace(self, recurrent=tuple(map(take, self.recurrent, states)))


def recurrent_rows(cfg: ModelConfig, rows: int) -> RecurrentView:
    """A Gated DeltaNet layer's state row for ``rows`` sequences, zeros: the convolution window
    [rows, K - 1, C] (compute dtype) and the state [rows, H, Dk, Dv] (float32)."""
    net = cfg.deltanet
    conv = jnp.zeros((rows, net.conv_width - 1, net.qkv_width), jnp.dtype(cfg.compute_dtype))
    state = jnp.zeros((rows, net.value_heads, net.key_dim, net.value_dim), jnp.float32)
    return RecurrentView(conv, state, None)
