"""The KV cache of incremental decoding: typed, a pytree, with the segment ids of every slot
(contract 2 masks the slots not written yet)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from seqjax.config.model import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerCache:
    """One layer's view of the KV cache: what :meth:`Attention.decode` reads, and returns with its
    new keys and values.

    keys/values: [B, S, K, Dh]; segment_ids: [B, S] for every slot, the ones
    this call writes included (0 on slots not written yet, which contract 2
    then masks); start: int32 scalar, the slot the call's first token goes to.
    """

    keys: jax.Array
    values: jax.Array
    segment_ids: jax.Array
    start: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer for incremental decoding (see seqjax.model.decode).

    keys/values: one [B, S, K, Dh] array per layer; segment_ids: [B, S], 0 on
    slots not written yet (contract 2 then masks them); length: int32 scalar,
    the slot the next call writes first. Queries at slot i attend to slots
    j <= i with their own segment id, by :func:`segment_mask` with row indices.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    segment_ids: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int) -> "KVCache":
        dtype = jnp.dtype(cfg.compute_dtype)
        shape = (batch, max_len, cfg.kv_heads, cfg.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
        return cls(zeros, zeros, jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((), jnp.int32))
