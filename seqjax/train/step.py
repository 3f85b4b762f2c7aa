"""One optimizer step: gradients summed over micro-batches, divided once by the global denominator.

The loss is ``train.objective``'s (:mod:`seqjax.objectives`); the step never names one. Each returns
sums and what they are divided by: for the default, docs/design.md's contract 3, ``loss =
sum(weights * nll) / sum(weights)`` over the *global* batch. With gradient accumulation the
micro-batches generally hold different numbers of scored tokens (packing, padding, eval-style
weights), so averaging per-micro-batch means (what ``optax.MultiSteps`` does) would weight tokens
unequally. Here each micro-batch contributes its *sums* (``loss_i * weight_sum_i``), a ``lax.scan``
adds them up inside the one jitted step, and the total is divided once: k micro-batches give the
update of one big batch (tested).

Micro-batch ``j`` takes rows ``j, j + k, j + 2k, ...`` of the global batch:
with rows sharded contiguously over ``data x fsdp`` every device keeps its
own rows in every micro-batch, so splitting needs no communication.

Dropout (``model.dropout``) needs random bits that exact resume, other meshes
and other process counts reproduce. Micro-batch ``j`` of step ``s`` uses the
key :func:`dropout_key` ``(run key, s, j)``, and the model draws each mask for
the whole global micro-batch inside this jitted step: XLA partitions the
generation (JAX's threefry is partitionable), so each device computes its
own rows' bits, the same bits on 1 device or 8, in 1 process or 2. No device
or process index enters, and a resumed run draws the steps' keys again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from seqjax.data.contract import Batch
from seqjax.objectives import DEFAULT, Inputs, Objective
from seqjax.objectives.base import STEP_FORWARD, target_logprobs, with_router
from seqjax.train.policy import reference_states

# The run key (from run.seed) also seeds parameter initialization, which folds in 0, 1, 2, ...;
# dropout keys come from a copy folded with this tag first, so no mask ever reuses an initializer's
# key.
DROPOUT_STREAM = 0x64726F70  # "drop"


def dropout_key(rng: jax.Array, step, micro) -> jax.Array:
    """The dropout key of micro-batch ``micro`` of step ``step``: a pure function of (run key, step,
    micro).

    ``rng`` is the run's key data (``jax.random.key_data(jax.random.key(run.seed))``, saved in
    checkpoints).
    """
    stream = jax.random.fold_in(jax.random.wrap_key_data(rng), DROPOUT_STREAM)
    return jax.random.fold_in(jax.random.fold_in(stream, step), micro)


def micro_batches(batch: Batch, k: int) -> Batch:
    """[B, ...] fields -> [k, B / k, ...]; micro-batch j holds rows j, j + k, ... (every field, the
    optional ones too, is cut by rows)."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return {name: split(x) for name, x in batch.items()}


def reference_model(objective: Objective, graphdef: nnx.GraphDef, reference_graphdef: nnx.GraphDef | None,
                    rest: Any, precomputed: bool = False) -> Callable:
    """``(params, frozen, reference) -> None or (micro-batch -> the reference model's per-target
    log-probabilities)`` (:mod:`seqjax.weights.reference` decides which): a frozen copy of what
    trains (``reference``, no ``reference_graphdef``); the same state under ``reference_graphdef``
    (the adapters off) on the run's base, or on another (``reference``: a named model's);
    ``precomputed``: the batch's ``reference_logps``, no model run. No dropout, no gradient."""

    def reference_logprobs(params, frozen, reference):
        if not objective.reference:
            return None
        if precomputed:
            return lambda micro: micro["reference_logps"]
        model = nnx.merge(*reference_states(graphdef, reference_graphdef, rest, params, frozen, reference))
        return lambda micro: jax.lax.stop_gradient(target_logprobs(model, micro, None, micro["weights"] > 0))

    return reference_logprobs


def make_train_step(
    graphdef: nnx.GraphDef,
    rest: Any,
    tx: optax.GradientTransformation,
    *,
    grad_accum: int,
    z_loss: float = 0.0,
    objective: Objective = DEFAULT,
    settings: Mapping[str, Any] | None = None,
    reference_graphdef: nnx.GraphDef | None = None,
    precomputed: bool = False,
    same_weights: Callable[[Any, Any, Any], jax.Array] | None = None,
    model_config: Any = None,
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """``step(params, opt_state, batch, rng=None, step=0, frozen=None, reference=None) -> (params,
    opt_state, metrics)``, pure and jittable.

    ``graphdef``/``rest``: from :func:`seqjax.model.split_params`; ``params``: the state that trains
    (every parameter, or the adapters), ``frozen`` the base under adapters (an argument, not a
    constant: no gradient, no optimizer state). ``rng`` (the run's key data) and ``step`` seed
    dropout; with ``rng=None`` nothing is dropped. ``objective`` (``train.objective``,
    :mod:`seqjax.objectives`) is what each micro-batch's loss computes,
    ``settings`` the ``train.*`` values it reads (``z_loss`` by default). ``metrics``: ``loss``
    (the objective's loss), ``objective`` (plus regularizers such as z-loss), ``grad_norm`` (before
    clipping), ``weight_sum`` (what the loss was divided by: scored tokens, pairs), ``tokens``
    (non-padding input tokens of the global batch), ``finite``, and ``reported``: the metrics the
    objective reports (TRL's rewards/*, ...), each already divided by its count.

    A reference (DPO, ...): ``reference``, ``reference_graphdef``, ``precomputed``
    (:func:`reference_model`); ``same_weights(params, reference, step)``: a boolean scalar, true
    when the reference's weights are the policy's, whose log-probabilities are then the reference's
    too (:meth:`Inputs.reference_logprobs`)."""
    settings = {"z_loss": z_loss, **(settings or {})}
    # a model with experts (model_config): the router's losses from the objective's own forward
    objective = objective if model_config is None else with_router(objective, model_config)
    reference_logprobs = reference_model(objective, graphdef, reference_graphdef, rest, precomputed)

    def merged(params, frozen):
        return nnx.merge(graphdef, params, *([] if frozen is None else [frozen]), rest)

    def summed_objective(params, micro: Batch, key, frozen, totals, reference, same):
        inputs = Inputs(merged(params, frozen), key, settings, totals,
                        reference_logprobs(params, frozen, reference), same, micro_batches=grad_accum)
        terms = objective.loss(inputs, micro)
        return terms.value, terms

    value_and_grad = jax.value_and_grad(summed_objective, has_aux=True)

    def step(params, opt_state, batch: Batch, rng=None, step=0, frozen=None, reference=None):
        micros, keys, totals = step_inputs(objective, batch, grad_accum, rng, step,
                                           functools.partial(merged, params, frozen))
        # once a step, before any micro-batch: is the reference the policy itself?
        same = False if same_weights is None or not objective.reference else same_weights(params, reference, step)

        def accumulate(carry, xs):
            micro, key = xs
            grads, sums = carry
            (_, terms), g = value_and_grad(params, micro, key, frozen, totals, reference, same)
            return (jax.tree.map(jnp.add, grads, g), objective.combine(sums, terms)), None

        init = (jax.tree.map(jnp.zeros_like, params), objective.zero_terms())
        (grads, sums), _ = jax.lax.scan(accumulate, init, (micros, keys))
        denom = jnp.where(sums.denominator > 0, sums.denominator, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, _metrics(objective, sums, denom, grad_norm, batch)

    return step


def step_inputs(objective: Objective, batch: Batch, grad_accum: int, rng, step, model: Callable[[], Any]):
    """(the micro-batches [G, ...], their dropout keys [G] or None, the totals the losses read):
    every denominator over the global batch (data only), and the statistics of the policy's forward
    its objective sums over the step first (``step_forward``), once, before any micro-batch."""
    totals = objective.totals(batch)
    micros = micro_batches(batch, grad_accum)
    keys = None if rng is None else jax.vmap(lambda i: dropout_key(rng, step, i))(jnp.arange(grad_accum))
    if objective.step_forward is not None and grad_accum > 1:
        totals = {**totals, STEP_FORWARD: forward_sums(objective, model, micros, keys)}
    return micros, keys, totals


def forward_sums(objective: Objective, model: Callable[[], Any], micros: Batch, keys) -> Any:
    """``objective.step_forward``'s statistics of the policy (``model()`` merges it) summed over the
    step's micro-batches ``micros`` [G, ...] under their dropout ``keys``: forward passes only, and no
    gradient flows through them."""
    def add(total, xs):
        part = objective.step_forward(model(), *xs)
        return (part if total is None else jax.tree.map(jnp.add, total, part)), None

    first = jax.tree.map(lambda a: a[0], (micros, keys))
    later = jax.tree.map(lambda a: a[1:], (micros, keys))
    total, _ = jax.lax.scan(add, add(None, first)[0], later)
    return jax.lax.stop_gradient(total)


def _metrics(objective: Objective, sums, denom: jax.Array, grad_norm: jax.Array, batch: Batch) -> dict[str, Any]:
    """The step's metrics (:func:`make_train_step`) from the summed terms."""
    loss = sums.loss / denom
    return {
        "loss": loss,
        "objective": sums.value / denom,
        "grad_norm": grad_norm,
        "weight_sum": sums.denominator,
        "tokens": jnp.sum(batch["segment_ids"] != 0),
        "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        "reported": objective.reported_values(sums.reported),
    }
