"""One optimizer step: gradients summed over micro-batches, divided once by the global weight sum.

docs/design.md, contract 3: ``loss = sum(weights * nll) / sum(weights)`` over the
*global* batch. With gradient accumulation the micro-batches generally hold
different numbers of scored tokens (packing, padding, eval-style weights), so
averaging per-micro-batch means (what ``optax.MultiSteps`` does) would weight
tokens unequally. Here each micro-batch contributes its *sums*
(``loss_i * weight_sum_i``), a ``lax.scan`` adds them up inside the one jitted
step, and the total is divided once: k micro-batches give the update of one
big batch (tested).

Micro-batch ``j`` takes rows ``j, j + k, j + 2k, ...`` of the global batch:
with rows sharded contiguously over ``data x fsdp`` every device keeps its
own rows in every micro-batch, so splitting needs no communication.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from seqjax.model.loss import lm_loss

Batch = dict[str, jax.Array]


def micro_batches(batch: Batch, k: int) -> Batch:
    """[B, L] fields -> [k, B / k, L]; micro-batch j holds rows j, j + k, ..."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return {name: split(x) for name, x in batch.items()}


def make_train_step(
    graphdef: nnx.GraphDef, rest: Any, tx: optax.GradientTransformation, *, grad_accum: int, z_loss: float
) -> Callable[[Any, Any, Batch], tuple[Any, Any, dict[str, jax.Array]]]:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)``, pure and jittable.

    ``graphdef``/``rest`` come from ``nnx.split(model, nnx.Param, ...)``;
    ``params`` is the Param state as a pure dict. ``metrics`` holds ``loss``
    (the contract-3 cross-entropy), ``objective`` (plus z-loss), ``grad_norm``
    (before clipping), ``weight_sum``, ``tokens`` (non-padding
    input tokens of the global batch) and ``finite``.
    """

    def summed_objective(params, micro: Batch):
        model = nnx.merge(graphdef, params, rest)
        logits = model(micro["inputs"], positions=micro["positions"], segment_ids=micro["segment_ids"])
        loss, aux = lm_loss(logits, micro["targets"], micro["weights"], z_loss=z_loss)
        # lm_loss is a mean over this micro-batch's weights; times their sum it is a sum again.
        return loss * aux["weight_sum"], aux

    value_and_grad = jax.value_and_grad(summed_objective, has_aux=True)

    def step(params, opt_state, batch: Batch):
        def accumulate(carry, micro):
            grads, objective, nll, weights = carry
            (obj, aux), g = value_and_grad(params, micro)
            grads = jax.tree.map(jnp.add, grads, g)
            return (grads, objective + obj, nll + aux["nll_sum"], weights + aux["weight_sum"]), None

        zero = jnp.zeros((), jnp.float32)
        init = (jax.tree.map(jnp.zeros_like, params), zero, zero, zero)
        (grads, objective, nll_sum, weight_sum), _ = jax.lax.scan(accumulate, init, micro_batches(batch, grad_accum))
        denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = nll_sum / denom
        metrics = {
            "loss": loss,
            "objective": objective / denom,
            "grad_norm": grad_norm,
            "weight_sum": weight_sum,
            "tokens": jnp.sum(batch["segment_ids"] != 0),
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        }
        return params, opt_state, metrics

    return step
