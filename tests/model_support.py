"""Compiled forwards for the tests: a model's log-probabilities through one jitted program, as the train
step computes them, instead of op by op (each eager op compiles a program of its own: a tiny model's forward
run eagerly costs seconds of compiling where one jit costs a fraction)."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from seqjax.objectives.base import target_logprobs


def compiled_logits(model: nnx.Module, ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``model(ids, positions=..., segment_ids=...)`` in one compiled program (one a model structure and shape)."""
    graphdef, state = nnx.split(model)
    return _logits(graphdef, state, ids, positions, segment_ids)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, ids, positions, segment_ids):
    return nnx.merge(graphdef, state)(ids, positions=positions, segment_ids=segment_ids)


def compiled_logprobs(model: nnx.Module, batch: dict, scored: jax.Array) -> jax.Array:
    """``target_logprobs(model, batch, None, scored)`` in one compiled program (one a model structure)."""
    graphdef, state = nnx.split(model)
    return _logprobs(graphdef, state, batch, scored)


@functools.partial(jax.jit, static_argnums=0)
def _logprobs(graphdef, state, batch, scored):
    return target_logprobs(nnx.merge(graphdef, state), batch, None, scored)
