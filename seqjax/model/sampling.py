"""Choosing the next token from logits: temperature, top-k and nucleus (top-p) filtering, greedy at
temperature 0.

The settings are traced arrays, not static arguments, so one compiled decode
step serves every temperature, top-k and top-p. Filters only ever remove
tokens ranked below the most likely one, so the argmax always survives:
``top_p -> 0`` or ``top_k = 1`` leaves only it, which is exactly greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from seqjax.core.errors import UsageError


@dataclass(frozen=True)
class SamplingConfig:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # NaN fails no comparison, so each range is written as what is allowed (a NaN temperature
        # samples garbage).
        if not (0 <= self.temperature < math.inf):
            raise UsageError(
                f"--temperature: got {self.temperature}, expected a finite number, 0 (greedy) or "
                "more"
            )
        if self.top_k < 0:
            raise UsageError(f"--top-k: got {self.top_k}, expected 0 (off) or a positive count")
        if not 0.0 <= self.top_p <= 1.0:
            raise UsageError(f"--top-p: got {self.top_p}, expected a probability in [0, 1]")

    def arrays(self) -> dict[str, jax.Array]:
        return {
            "temperature": jnp.float32(self.temperature),
            "top_k": jnp.int32(self.top_k),
            "top_p": jnp.float32(self.top_p),
        }


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set to -inf every logit outside the top ``top_k`` (0: all) and outside the nucleus of mass
    ``top_p``.

    The nucleus is the smallest set of most likely tokens whose probability
    reaches ``top_p``; the most likely token is always in it.
    """
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(vocab)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    k = jnp.where(top_k > 0, top_k, vocab)
    keep_sorted = (rank < k) & ((mass_before < top_p) | (rank == 0))
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample(
    logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Next token ids [B] from logits [B, V] (float32)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        # Temperature first, then the filters on the tempered distribution (as HF generate orders them);
        # the filters' sort only when one is on (a decode step's largest cost on a CPU otherwise).
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
        scaled = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda s: filter_logits(s, top_k, top_p),
                              lambda s: s, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, lambda logits: greedy, logits)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """Next token ids [B] from logits [B, V], row i drawn with its own key ``keys[i]``: a row's
    token depends on its logits and its key alone, never on the other rows of the batch
    (seqjax.engine draws each sequence's token at place n with a key of (seed, prompt,
    completion, n))."""
    def one(row, key):
        return sample(row[None], key, temperature, top_k, top_p)[0]

    return jax.vmap(one)(logits, keys)
