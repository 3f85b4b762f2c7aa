"""The paged KV cache: every layer's keys and values in fixed-size pages, and each decode row's page
table. A row (a decode slot) holds one sequence: its place j in the sequence lives at page
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
reads the pages in place, seqjax.model.kernels.paged's kernel (a decode step's one token a row;
a call of more tokens takes the XLA path). A Gated
DeltaNet layer holds no pages: its row of the cache is each decode slot's convolution window and
recurrent state, which a sequence copies from its prompt's when it starts (``with_states``)."""

from __future__ import annotations

import dataclasses

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
    """One layer's view of :class:`PagedKV` for one call: its pages [pages, Hkv, page_size, D],
    the rows' page tables [B, P] and lengths [B] (places written before the call), the call's
    tokens' segment ids (0: the row writes nothing)."""

    keys: jax.Array
    values: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    segment_ids: jax.Array
    attention: str = dataclasses.field(default="xla", metadata={"static": True})  # (engine.attention)

    def attend(self, q, k, v, *, segment_ids, window, scale, sinks):
        """Write the call's keys and values at places ``lengths..`` of each row, then attend over
        the row's pages (the XLA path: pages gathered, :func:`page_mask`, a float32 softmax)."""
        pages, size = self.keys.shape[0], self.keys.shape[2]
        b, t = segment_ids.shape
        real = segment_ids > 0
        place = self.lengths[:, None] + jnp.cumsum(real, axis=1) - 1  # (a row's real tokens, in order)
        column = jnp.clip(place // size, 0, self.page_table.shape[1] - 1)
        page = jnp.take_along_axis(self.page_table, column, axis=1)
        slot = jnp.where(real & (page < pages), page * size + place % size, pages * size)  # (else dropped)
        keys = write_pages(self.keys, slot, k)
        values = write_pages(self.values, slot, v)
        if self.attention == "pallas" and t == 1:
            return self._kernel(q, keys, values, real, scale, window, sinks), dataclasses.replace(
                self, keys=keys, values=values)
        capacity = self.page_table.shape[1] * size
        gathered_k, gathered_v = _gather(keys, self.page_table), _gather(values, self.page_table)
        mask = page_mask(place, real, self.lengths + jnp.sum(real, axis=1), capacity, window)
        out = masked_attention(q, gathered_k.astype(q.dtype), gathered_v.astype(q.dtype), mask, scale=scale,
                               sinks=sinks, heads_first=True)
        return out, dataclasses.replace(self, keys=keys, values=values)

    def _kernel(self, q, keys, values, real, scale, window, sinks):
        """One token a row through the Pallas kernel: the row's places up to its new one (an idle
        row: none, zeros, as the XLA path gives), the sinks through the log-sum-exp."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        length = jnp.where(real[:, 0], self.lengths + 1, 0)
        out, lse = paged_attention(q[:, 0], keys, values, self.page_table, length, scale=scale, window=window)
        out = out[:, None]
        return out if sinks is None else with_sinks(out, lse[:, :, None], sinks)


def write_pages(pages: jax.Array, slot: jax.Array, new: jax.Array) -> jax.Array:
    """``new`` [..., Hkv, D] written at each place ``slot`` [...] (page x page_size + offset; the
    pool's size or more: dropped) of ``pages`` [pages, Hkv, page_size, D]."""
    size, slot = pages.shape[2], slot.reshape(-1)
    return pages.at[slot // size, :, slot % size].set(new.reshape(-1, *new.shape[-2:]).astype(pages.dtype),
                                                       mode="drop")


def _gather(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[B, Hkv, P x page_size, D]: each row's pages in order, heads first (a table's unused entries
    read page 0: masked). Pages hold their heads apart, so the gathered keys come out in the order
    the attention's products take them (on a CPU the products and the gather both run faster so)."""
    b, width = page_table.shape
    gathered = jnp.swapaxes(jnp.take(pages, page_table, axis=0, mode="clip"), 1, 2)  # [B, Hkv, P, S, D]
    return gathered.reshape(b, pages.shape[1], width * pages.shape[2], pages.shape[3])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """Every attention layer's pages (keys, values: one [pages, Hkv, page_size, D] array each), the
    decode rows' page tables [B, P] (an entry of ``pages`` or more: no page) and lengths [B] (places
    written); and every Gated DeltaNet layer's state row (``recurrent``: each decode row's
    convolution window and state, seqjax.model.cache.RecurrentView). A layer holds one or the other
    (None in the other tuple)."""

    keys: tuple[jax.Array | None, ...]
    values: tuple[jax.Array | None, ...]
    page_table: jax.Array
    lengths: jax.Array
    recurrent: tuple[RecurrentView | None, ...]
    attention: str = dataclasses.field(default="xla", metadata={"static": True})

    @classmethod
    def empty(cls, cfg: ModelConfig, pages: int, page_size: int, rows: int, table: int,
              attention: str = "xla") -> "PagedKV":
        shape = (pages, cfg.kv_heads, page_size, cfg.head_dim)
        dtype = jnp.dtype(cfg.compute_dtype)
        linear = [cfg.mixer_of(i) == "deltanet" for i in range(cfg.n_layers)]
        zeros = tuple(None if lin else jnp.zeros(shape, dtype) for lin in linear)
        states = tuple(recurrent_rows(cfg, rows) if lin else None for lin in linear)
        tables = jnp.full((rows, table), pages, jnp.int32)
        return cls(zeros, zeros, tables, jnp.zeros((rows,), jnp.int32), states, attention)

    @property
    def pages(self) -> int:
        return next(k for k in self.keys if k is not None).shape[0]

    @property
    def page_size(self) -> int:
        return next(k for k in self.keys if k is not None).shape[2]

    def views(self, segment_ids: jax.Array) -> tuple:
        """Per layer: a :class:`PagedLayer`, or its state row continuing each row's sequence."""
        # (a decode token continues its sequence)
        carry = jnp.ones(segment_ids.shape[:1], segment_ids.dtype)
        return tuple(dataclasses.replace(r, carry=carry) if r is not None else
                     PagedLayer(k, v, self.page_table, self.lengths, segment_ids, self.attention)
                     for k, v, r in zip(self.keys, self.values, self.recurrent))

    def advanced(self, views, segment_ids: jax.Array) -> "PagedKV":
        paged = [v if isinstance(v, PagedLayer) else None for v in views]
        states = tuple(dataclasses.replace(v, carry=None) if p is None else None
                       for v, p in zip(views, paged))
        lengths = self.lengths + jnp.sum(segment_ids > 0, axis=1).astype(jnp.int32)
        return PagedKV(tuple(p and p.keys for p in paged), tuple(p and p.values for p in paged),
                       self.page_table, lengths, states, self.attention)

    def copy_pages(self, source: jax.Array, target: jax.Array) -> "PagedKV":
        """Page ``source[i]`` copied to ``target[i]`` in every layer (a target of ``pages``:
        none)."""
        def copy(layer):
            if layer is None:
                return None
            return layer.at[target].set(jnp.take(layer, source, axis=0, mode="clip"), mode="drop")

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
