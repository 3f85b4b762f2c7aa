"""The block's cache seam: what a layer does with its new keys and values when it decodes. The model
never builds a cache; a caller's cache (seqjax.engine: the paged KV cache of decoding, the
prefill writing into it) hands each layer a view, and the layer's attention asks it to **write, then
attend**:

    o, view = view.attend(q, k, v, segment_ids=..., window=..., scale=..., sinks=...)

A cache is any pytree with ``view(i, segment_ids)`` (layer i's view for a call), ``put(i, view)``
(the cache with layer i's view after the call) and ``advanced(segment_ids)`` (the cache after the
whole call, its tokens counted); :meth:`seqjax.model.transformer.TransformerLM.decode` runs the
blocks over it, layer by layer. A cache whose ``scannable`` is true takes a traced layer index
too, so a model with stacked blocks (``model.scan_layers``) runs its decode as one ``lax.scan``
over the layers, the cache in the scan's carry (seqjax.engine.paged: every layer's pages in one
array). A recurrent layer's state (Qwen3.5's Gated DeltaNet) joins a cache the same way: a
:class:`RecurrentView`, which the layer reads and hands back advanced."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax


class LayerView(Protocol):
    """One layer's part of a cache."""

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array, window: Any,
               scale: float | None, sinks: jax.Array | None) -> tuple[jax.Array, "LayerView"]:
        """Write this call's keys and values (k, v [B, T, Hkv, D]; the tokens whose
        ``segment_ids`` are 0 write nothing), then attend with q [B, T, H, D] over what the layer
        holds; (out [B, T, H, D], the view after the write)."""


class Cache(Protocol):
    """A decoding cache over every layer."""

    def view(self, i: int | jax.Array, segment_ids: jax.Array) -> LayerView:
        """Layer ``i``'s view for a call whose tokens have ``segment_ids`` [B, T] (``i`` traced
        only where :attr:`scannable`)."""

    def put(self, i: int | jax.Array, view: LayerView) -> "Cache":
        """The cache with layer ``i``'s view after the call."""

    def advanced(self, segment_ids: jax.Array) -> "Cache":
        """The cache after the call: the tokens it wrote counted."""

    @property
    def scannable(self) -> bool:
        """Whether :meth:`view` and :meth:`put` take a traced layer index (every layer alike)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecurrentView:
    """A Gated DeltaNet layer's part of a cache (seqjax.model.deltanet.DeltaNet.decode): each row's
    convolution window, the last K - 1 inputs of its convolution [B, K - 1, C], its recurrent state
    [B, H, Dk, Dv] (float32), and ``carry`` [B], the segment id of the token before the call (0: the
    row starts fresh, as a prefill does). All None: a fresh start for every row. ``ends`` [E, 2]
    (row, place) pairs, a packed prefill's documents' last tokens: the view after the call holds
    the window and state after each of them ([E, ...], each its own document's) instead of the
    rows'."""

    conv: jax.Array | None = None
    state: jax.Array | None = None
    carry: jax.Array | None = None
    ends: jax.Array | None = None
