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

Dropout (``model.dropout``) needs random bits that exact resume, other meshes
and other process counts reproduce. Micro-batch ``j`` of step ``s`` uses the
key :func:`dropout_key` ``(run key, s, j)``, and the model draws each mask for
the whole global micro-batch inside this jitted step: XLA partitions the
generation (JAX's threefry is partitionable), so each device computes its
own rows' bits, the same bits on 1 device or 8, in 1 process or 2. No device
or process index enters, and a resumed run draws the steps' keys again.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from seqjax.data.contract import Batch
from seqjax.model.loss import chunked_lm_loss, lm_loss

# The run key (from run.seed) also seeds parameter initialization, which folds in 0, 1, 2, ...; dropout keys
# come from a copy folded with this tag first, so no mask ever reuses an initializer's key.
DROPOUT_STREAM = 0x64726F70  # "drop"


def dropout_key(rng: jax.Array, step, micro) -> jax.Array:
    """The dropout key of micro-batch ``micro`` of step ``step``: a pure function of (run key, step, micro).

    ``rng`` is the run's key data (``jax.random.key_data(jax.random.key(run.seed))``, saved in checkpoints).
    """
    stream = jax.random.fold_in(jax.random.wrap_key_data(rng), DROPOUT_STREAM)
    return jax.random.fold_in(jax.random.fold_in(stream, step), micro)


def micro_batches(batch: Batch, k: int) -> Batch:
    """[B, L] fields -> [k, B / k, L]; micro-batch j holds rows j, j + k, ..."""

    def split(x):
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    return {name: split(x) for name, x in batch.items()}


def micro_loss(model, micro: Batch, key, z_loss: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Contract 3's loss of one micro-batch; with ``model.loss_chunk_tokens`` the logits are never built whole."""
    chunk = model.cfg.loss_chunk_tokens
    if chunk:
        features, head = model.features_and_head(micro["inputs"], positions=micro["positions"],
                                                 segment_ids=micro["segment_ids"], dropout_key=key)
        return chunked_lm_loss(features, head, micro["targets"], micro["weights"], chunk_tokens=chunk, z_loss=z_loss)
    logits = model(micro["inputs"], positions=micro["positions"], segment_ids=micro["segment_ids"], dropout_key=key)
    return lm_loss(logits, micro["targets"], micro["weights"], z_loss=z_loss)


def make_train_step(
    graphdef: nnx.GraphDef, rest: Any, tx: optax.GradientTransformation, *, grad_accum: int, z_loss: float
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """``step(params, opt_state, batch, rng=None, step=0, frozen=None) -> (params, opt_state, metrics)``, pure and
    jittable.

    ``graphdef``/``rest`` come from :func:`seqjax.model.split_params`; ``params`` is the state that trains as a
    pure dict (every parameter, or ``model.lora``'s adapters alone), ``frozen`` the base under adapters (an
    argument, not a constant baked into the compiled step; it gets no gradient and no optimizer state).
    ``rng`` (the run's key data) and ``step`` (the step's number) seed dropout; with ``rng=None`` nothing is
    dropped, whatever ``model.dropout`` says. ``metrics`` holds ``loss``
    (the contract-3 cross-entropy), ``objective`` (plus z-loss), ``grad_norm``
    (before clipping), ``weight_sum``, ``tokens`` (non-padding
    input tokens of the global batch) and ``finite``.
    """

    def summed_objective(params, micro: Batch, key, frozen):
        model = nnx.merge(graphdef, params, *([] if frozen is None else [frozen]), rest)
        loss, aux = micro_loss(model, micro, key, z_loss)
        # lm_loss is a mean over this micro-batch's weights; times their sum it is a sum again.
        return loss * aux["weight_sum"], aux

    value_and_grad = jax.value_and_grad(summed_objective, has_aux=True)

    def step(params, opt_state, batch: Batch, rng=None, step=0, frozen=None):
        def accumulate(carry, xs):
            micro, index = xs
            grads, objective, nll, weights = carry
            key = None if rng is None else dropout_key(rng, step, index)
            (obj, aux), g = value_and_grad(params, micro, key, frozen)
            grads = jax.tree.map(jnp.add, grads, g)
            return (grads, objective + obj, nll + aux["nll_sum"], weights + aux["weight_sum"]), None

        zero = jnp.zeros((), jnp.float32)
        init = (jax.tree.map(jnp.zeros_like, params), zero, zero, zero)
        xs = (micro_batches(batch, grad_accum), jnp.arange(grad_accum))
        (grads, objective, nll_sum, weight_sum), _ = jax.lax.scan(accumulate, init, xs)
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
