"""A run's policy, in one record: the model that trains, its reference (when its objective or
``rl.beta`` compares with one), their log-probabilities, and the model handed to the sampler (an RL
run's rollouts).

The state is split as training needs it: what trains (``params``: every weight, or ``model.lora``'s
adapters) is the step's first argument; what it reads but never trains travels beside it as
:class:`Frozen`, a record with named fields (never a tuple whose length says what it holds):

==============  ===================================================================================================
``base``        the frozen base under ``model.lora`` (as ``model.lora.quantize`` stores it), else None
``reference``   the reference's own weights where it has them: a frozen copy of what trains (``copy``), or a named
                model's (``model``; under adapters, in the base's place), else None
==============  ===================================================================================================

The reference model is assembled here and only here (:meth:`Policy.reference_model`), for the train
step, training's validation and an RL run's rollouts, as :mod:`seqjax.weights.reference` decides it:

=========================  ==========================================================================
reference                  the model
=========================  ==========================================================================
the base (LoRA, ``auto``)   the same state through the graph with the adapters off
a frozen copy               the policy's graph over the copy (and the base, under adapters)
a named model               full fine-tune: the policy's graph over its weights; under adapters: the
                            adapters-off graph over the policy's adapters and the named model's base
=========================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

from seqjax.data.contract import Batch
from seqjax.objectives.base import target_logprobs
from seqjax.weights.reference import Reference


class Frozen(NamedTuple):
    """What the step reads but never trains (a pytree: None fields are empty)."""

    base: Any = None
    reference: Any = None


def reference_states(graphdef, reference_graphdef, rest, params, frozen, reference) -> tuple:
    """``(graph, *states)`` of the reference model: what ``nnx.merge`` makes it from.
    ``reference_graphdef`` is the adapters-off graph (None: the policy's own graph over
    ``reference``'s weights); ``frozen`` the base under adapters; ``reference`` the reference's
    own weights, or None."""
    base = [] if frozen is None else [frozen]
    if reference_graphdef is None:
        return (graphdef, reference, *base, rest)
    if reference is None:
        return (reference_graphdef, params, *base, rest)
    return (reference_graphdef, params, reference, rest)


@dataclasses.dataclass
class Policy:
    """The policy and its reference, as graphs and the rule that tells when they are the same
    weights; the weights themselves are arguments (``params``, :class:`Frozen`), so the same record
    serves inside and outside ``jit``.

    ``reference``: the decision (:class:`~seqjax.weights.reference.Reference`; kind None: none);
    ``reference_graphdef``: the adapters-off graph where the reference is the base or a named
    model under adapters, else None; ``same_weights(params, frozen, step)``: a boolean scalar,
    true while the reference's weights are the policy's (None where they never can be)."""

    graphdef: nnx.GraphDef
    rest: nnx.State
    reference: Reference
    reference_graphdef: Any = None
    same_weights: Callable[[Any, Frozen, Any], jax.Array] | None = None

    def model(self, params, frozen: Frozen) -> nnx.Module:
        """The policy: what trains merged with the frozen base (the model the sampler runs)."""
        return nnx.merge(self.graphdef, params, *([] if frozen.base is None else [frozen.base]), self.rest)

    @property
    def has_reference(self) -> bool:
        return self.reference.kind is not None

    def reference_model(self, params, frozen: Frozen) -> nnx.Module | None:
        """The reference model (None: the run has none)."""
        if not self.has_reference:
            return None
        return nnx.merge(*reference_states(self.graphdef, self.reference_graphdef, self.rest, params, frozen.base,
                                           frozen.reference))

    def logprobs(self, model: nnx.Module, batch: Batch) -> jax.Array:
        """``model``'s per-target log-probabilities of ``batch``'s scored targets (no dropout, no
        gradient)."""
        return jax.lax.stop_gradient(target_logprobs(model, batch, None, batch["weights"] > 0))
