"""The optimizer: optax AdamW with a weight-decay mask, a learning-rate schedule and global-norm
clipping.

Step numbering: the update that produces optimizer step ``s`` (1-based, the
``step`` in metrics.jsonl) uses ``learning_rate(s)``. Warmup therefore reaches
the peak exactly at ``s == train.warmup_steps`` and the first update already
moves the weights (``lr / warmup_steps``) instead of spending a step at zero.
The decay ends at ``lr * min_lr_ratio`` at ``s == train.steps``.

Weight decay applies to matrices only: norms' scales and biases (vectors) are
never decayed, embeddings only when ``train.decay_embeddings`` is set (a
parameter whose path mentions "embed").

AdamW's moments are float32 whatever the parameters' dtype (:func:`moments_in_float32`): the
step divides the summed gradient by its float32 denominator, so the moments of bfloat16
parameters came out float32 after the first update anyway, and a state that changed dtype made
the second step compile the whole program again.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from seqjax.config.tree import TrainConfig


def learning_rate_schedule(train: TrainConfig) -> Callable[[Any], Any]:
    """``step -> learning rate`` for optimizer steps 1..train.steps (see the module docstring)."""
    peak, warmup = train.lr, train.warmup_steps
    floor = peak * train.min_lr_ratio
    if train.schedule == "cosine":
        body = optax.cosine_decay_schedule(peak, decay_steps=max(train.steps - warmup, 1),
                                           alpha=train.min_lr_ratio)
    elif train.schedule == "linear":
        body = optax.linear_schedule(peak, floor, transition_steps=max(train.steps - warmup, 1))
    else:
        body = optax.constant_schedule(peak)
    if warmup == 0:
        return body
    # The warmup covers steps 0..warmup; join_schedules hands the body (step - warmup) after it.
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), body], boundaries=[warmup])


def decay_mask(params: Any, decay_embeddings: bool = False) -> Any:
    """A pytree of bools like ``params``: True where AdamW's weight decay applies."""

    def decays(path, leaf) -> bool:
        if leaf.ndim < 2:  # norm scales and biases
            return False
        is_embedding = any("embed" in str(getattr(k, "key", getattr(k, "name", k))).lower()
                           for k in path)
        return decay_embeddings or not is_embedding

    return jax.tree_util.tree_map_with_path(decays, params)


def build_optimizer(train: TrainConfig) -> tuple[optax.GradientTransformation, Callable[[Any], Any]]:
    """(optimizer, schedule). Clipping runs before AdamW, on the full (accumulated) gradient.

    With ``train.nonfinite == "skip"`` the whole chain is wrapped in
    ``optax.apply_if_finite``: an update with a NaN/inf gradient leaves
    parameters and moments untouched.
    """
    schedule = learning_rate_schedule(train)
    # optax counts updates from 0; our step s is count + 1.
    by_count = lambda count: schedule(count + 1)  # noqa: E731
    chain = []
    # null or 0: off (HF's max_grad_norm=0 is no clipping; a 0 threshold zeroes every update)
    if train.grad_clip:
        chain.append(optax.clip_by_global_norm(train.grad_clip))
    chain.append(
        optax.adamw(
            by_count,
            b1=train.b1,
            b2=train.b2,
            eps=train.eps,
            weight_decay=train.weight_decay,
            mask=lambda params: decay_mask(params, train.decay_embeddings),
        )
    )
    tx = optax.chain(*chain)
    if train.nonfinite == "skip":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=train.steps)
    return moments_in_float32(tx), schedule


def moments_in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose state starts as it stays: created from the parameters cast to float32, so a
    bfloat16 parameter's moments are float32 from step 0, as every update after the first leaves
    them (the step's gradient is float32). The same updates up to float rounding (the first
    moments are zeros either way; the program that computes them is another), one compiled step
    instead of two, and a memory plan that counts the moments' real bytes. A float64 parameter
    keeps float64 moments."""

    def init(params):
        return tx.init(jax.tree.map(_as_float32, params))

    return optax.GradientTransformation(init, tx.update)


def _as_float32(leaf):
    dtype = getattr(leaf, "dtype", None)  # (optax.tree_map_params passes a placeholder: kept)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return leaf
    wide = jnp.promote_types(dtype, jnp.float32)
    return leaf if wide == dtype else leaf.astype(wide)  # (float32 itself is not copied)
