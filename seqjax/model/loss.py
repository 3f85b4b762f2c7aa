"""The LM loss (docs/design.md, contract 3): weights-weighted next-token cross-entropy in float32.

    loss = sum(weights * nll) / sum(weights)

The sums come back too, because perplexity and gradient accumulation need
them un-divided: exp(total nll_sum / total weight_sum), never a mean of means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_loss(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of ``targets`` [B, T] under ``logits`` [B, T, V], weighted by ``weights`` [B, T].

    Returns (loss, aux) with aux = {nll_sum, weight_sum, z_loss_sum}, float32
    scalars. ``z_loss`` adds z_loss * sum(weights * log(Z)^2) / sum(weights)
    (PaLM's auxiliary term that keeps the softmax normalizer near 1). A batch
    with sum(weights) == 0 gives loss 0 and zero gradients, not NaN.
    Targets with weight 0 are never read (padding may hold any id); a target
    outside [0, V) with non-zero weight gives NaN, never a silent wrong loss.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2] or weights.shape != targets.shape:
        raise ValueError(
            f"lm_loss: logits {logits.shape}, targets {targets.shape}, weights {weights.shape}; "
            "expected [B, T, V], [B, T], [B, T]"
        )
    logits = logits.astype(jnp.float32)
    weights = weights.astype(jnp.float32)
    scored = weights != 0
    log_z = jax.nn.logsumexp(logits, axis=-1)
    ids = jnp.where(scored, targets, 0)
    ids = jnp.where((ids >= 0) & (ids < logits.shape[-1]), ids, logits.shape[-1])  # out of range -> NaN below
    target_logit = jnp.take_along_axis(logits, ids[..., None], axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]
    nll_sum = jnp.sum(jnp.where(scored, weights * (log_z - target_logit), 0.0))
    z_loss_sum = jnp.sum(jnp.where(scored, weights * jnp.square(log_z), 0.0))
    weight_sum = jnp.sum(weights)
    denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
    loss = (nll_sum + z_loss * z_loss_sum) / denom
    return loss, {"nll_sum": nll_sum, "weight_sum": weight_sum, "z_loss_sum": z_loss_sum}
