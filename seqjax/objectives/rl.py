"""GRPO and its variants on an RL run's rollouts (docs/rl.md), as TRL 1.16's ``GRPOTrainer._compute_loss``
computes them, each a row of the objectives table (``train.objective=dapo``).

Per scored completion token, with ``A`` its completion's advantage, ``r = exp(logp - old)`` the
ratio to the policy that sampled it (``rl.importance_sampling_level=sequence``, GSPO: one ratio per
completion, the exp of the mean of its tokens' log-ratios), ``e``/``E`` =
``rl.epsilon``/``rl.epsilon_high``:

=========================  =================================================================================
``grpo``, ``bnpo``,        ``-min(r A, clip(r, 1 - e, 1 + E) A)`` (``rl.delta``: ``r`` capped at delta first)
``dr_grpo``, ``dapo``,
``luspo``
``cispo``                  ``-stop_gradient(min(r, E)) A logp``
``sapo``                   ``-(4 / t) sigmoid(t (r - 1)) A``, ``t`` = ``rl.sapo_temperature_pos`` or ``_neg``
``vespo``                  ``-stop_gradient(phi(w)) A logp``, ``phi(w) = exp(l + k log w - l w)`` of the completion's
                           ratio ``w`` (TRL's defaults: k, l = 2, 3 for A >= 0, 3, 2 below)
=========================  =================================================================================

plus ``rl.beta`` times the k3 KL to the reference, ``exp(ref - logp) - (ref - logp) - 1`` (times
``r`` under ``rl.use_bias_correction_kl``, TRL's default). How each loss type reduces, with TRL's
code beside:

=============  ====================================================  ===========================================
loss type      the step's loss                                       TRL 1.16 (``_compute_loss``)
=============  ====================================================  ===========================================
grpo, sapo     mean over completions of each one's token mean       per micro-batch, then averaged over them
bnpo           mean over the step's scored tokens                    per micro-batch token mean, averaged over
                                                                     micro-batches (equal with one)
dr_grpo        sum / (completions x rl.max_completion_length)        the same per micro-batch, averaged
dapo, cispo,   sum / (the generation batch's scored tokens /         ``num_items_in_batch`` over the generation
vespo          rl.steps_per_generation)                              batch, scaled to one step
luspo          sum over completions of each one's token sum /         per micro-batch, averaged
               completions
=============  ====================================================  ===========================================

Every sum is over the global step (:class:`~seqjax.objectives.base.Terms`), so packing and
micro-batches leave the numbers as one padded batch gives them. The reported metrics are TRL's:
``kl``, ``entropy`` and the clip ratios (``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``;
``cispo_clip_ratio``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqjax.data.contract import Batch
from seqjax.model.loss import segment_sums
from seqjax.objectives.base import Inputs, Objective, Terms, target_logprobs

READS = ("completion", "advantages", "token_share", "old_logps", "fresh", "rollout_reference_logps",
         "reference_is_policy")
SETTINGS = ("rl.epsilon", "rl.epsilon_upper", "rl.delta", "rl.importance_sampling_level", "rl.beta",
            "rl.use_bias_correction_kl", "rl.sapo_temperature_pos", "rl.sapo_temperature_neg",
            "rl.max_completion_length")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# VESPO's gamma weighting, TRL 1.16's defaults (vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
# vespo_lambda_neg)
VESPO = (2.0, 3.0, 3.0, 2.0)


class Completions:
    """A micro-batch's completions: the scored mask, per-token sums over each completion (a segment of its row)
    spread back over its tokens, and how many completions the micro-batch holds."""

    def __init__(self, micro: Batch):
        self.mask = (micro["weights"] > 0).astype(jnp.float32)
        self.segments = micro["segment_ids"]
        self.width = self.segments.shape[1]
        owned = ((micro["completion"] > 0) & (self.segments > 0)).astype(jnp.float32)
        # a completion counts once, its tokens all masked (rl.mask_truncated_completions) or not, as
        # TRL's per-row mean counts it
        self.count = jnp.sum(segment_sums(owned, self.segments, self.width) > 0).astype(jnp.float32)

    def per_sequence(self, values: jax.Array) -> jax.Array:
        """[B, S]: each completion's sum of ``values`` over its scored tokens."""
        return segment_sums(values * self.mask, self.segments, self.width)

    def spread(self, per_sequence: jax.Array) -> jax.Array:
        """[B, T]: each token's completion's value."""
        index = jnp.clip(self.segments - 1, 0, self.width - 1)
        return jnp.take_along_axis(per_sequence, index, axis=1) * (self.segments > 0)

    def mean(self, values: jax.Array) -> jax.Array:
        """[B, T]: each token's completion's mean of ``values`` over its scored tokens."""
        tokens = self.per_sequence(jnp.ones_like(values))
        return self.spread(self.per_sequence(values) / jnp.maximum(tokens, 1.0))


def _policy_terms(inputs: Inputs, micro: Batch, loss_type: str):
    """(per-token loss [B, T], completions, the ratio and the advantages, per token; entropy) of one
    micro-batch."""
    s = inputs.settings
    scored = micro["weights"] > 0
    logp, stats = target_logprobs(inputs.model, micro, inputs.key, scored, stats=True)
    seqs = Completions(micro)
    fresh = micro["fresh"] > 0  # ([B, 1])
    old = jnp.where(fresh, jax.lax.stop_gradient(logp), micro["old_logps"])
    log_ratio = (logp - old) * seqs.mask
    sequence = s["rl.importance_sampling_level"] == "sequence"
    coef_1 = jnp.exp(seqs.mean(log_ratio) if sequence else log_ratio)
    phi = None
    advantages = micro["advantages"]
    eps_low, eps_high = s["rl.epsilon"], s["rl.epsilon_upper"]
    if loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(coef_1, eps_high)) * advantages * logp
    elif loss_type == "sapo":
        t = jnp.where(advantages > 0, s["rl.sapo_temperature_pos"], s["rl.sapo_temperature_neg"])
        loss = -jax.nn.sigmoid(t * (coef_1 - 1)) * 4 / t * advantages
    elif loss_type == "vespo":
        phi = jax.lax.stop_gradient(_vespo_phi(seqs, log_ratio, advantages))
        loss = -phi * advantages * logp
    else:
        coef_2 = jnp.clip(coef_1, 1 - eps_low, 1 + eps_high)
        capped = coef_1 if s["rl.delta"] is None else jnp.minimum(coef_1, s["rl.delta"])
        loss = -jnp.minimum(capped * advantages, coef_2 * advantages)
    kl = None
    if s["rl.beta"]:
        # (the reference's weights were the policy's when the batch was sampled: its
        # log-probabilities are the policy's own on the batch's first pass, and the sampling
        # policy's, kept as the reference's, after)
        same = (micro["reference_is_policy"] > 0) & fresh  # ([B, 1])
        ref = jnp.where(same, jax.lax.stop_gradient(logp), micro["rollout_reference_logps"])
        kl = jnp.exp(ref - logp) - (ref - logp) - 1
        if s["rl.use_bias_correction_kl"]:
            kl = kl * coef_1
        loss = loss + s["rl.beta"] * kl
    return loss * seqs.mask, seqs, coef_1, advantages, kl, stats["entropy"], phi


def _vespo_phi(seqs: Completions, log_ratio: jax.Array, advantages: jax.Array) -> jax.Array:
    """VESPO's gamma weight of each token's completion (TRL's ``get_gamma_weights``, no vLLM correction)."""
    k_pos, l_pos, k_neg, l_neg = VESPO
    lower = jnp.log(1e-8)
    log_w = jnp.clip(seqs.spread(seqs.per_sequence(jnp.clip(log_ratio, -20.0, 20.0))), lower, 20.0)
    positive = advantages >= 0
    k, lam = jnp.where(positive, k_pos, k_neg), jnp.maximum(jnp.where(positive, l_pos, l_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def _loss(loss_type: str):
    def loss(inputs: Inputs, micro: Batch) -> Terms:
        terms = _policy_terms(inputs, micro, loss_type)
        per_token, seqs, coef_1, advantages, kl, entropy, phi = terms
        s = inputs.settings
        tokens = jnp.sum(seqs.mask)
        if loss_type in ("grpo", "sapo"):  # each completion's token mean
            tokens_each = jnp.maximum(seqs.per_sequence(seqs.mask), 1.0)
            value = jnp.sum(seqs.per_sequence(per_token) / tokens_each)
        elif loss_type == "dr_grpo":  # (over completions x the length limit: it divides here)
            value = jnp.sum(per_token) / s["rl.max_completion_length"]
        else:  # bnpo, dapo, cispo, vespo, luspo: a sum of tokens
            value = jnp.sum(per_token)
        reported = _reports(loss_type, seqs, coef_1, advantages, kl, entropy, phi, s)
        return Terms(value, _denominator(loss_type, micro, s, seqs, tokens), value, reported)

    return loss


def _denominator(loss_type: str, micro: Batch, s, seqs: Completions, tokens: jax.Array) -> jax.Array:
    """What the step divides the summed loss by, as this micro-batch's share of it."""
    if loss_type == "bnpo":
        return tokens
    if loss_type in ("dapo", "cispo", "vespo"):
        return jnp.sum(micro["token_share"])
    return seqs.count  # grpo, sapo, luspo, dr_grpo


def _reports(loss_type, seqs: Completions, coef_1, advantages, kl, entropy, phi, s) -> dict:
    """TRL's metrics, each (sum, count) over the step: token-level means over scored tokens (one value per
    completion when the ratio is per completion, as TRL's ``global_masked_mean``)."""
    mask = seqs.mask
    tokens = jnp.sum(mask)
    sequence = s["rl.importance_sampling_level"] == "sequence"

    def masked(values):
        values = jax.lax.stop_gradient(values)
        if sequence:  # (one value per completion: its tokens' mean is that value)
            first = _first_tokens(seqs)
            return jnp.sum(seqs.mean(values * mask) * first), jnp.sum(first)
        return jnp.sum(values * mask), tokens

    out = {"entropy": (jnp.sum(jax.lax.stop_gradient(entropy) * mask), tokens)}
    # (with rl.beta 0 there is no KL term: it reports 0, where TRL logs nothing)
    out["kl"] = ((jnp.sum(jax.lax.stop_gradient(kl) * mask), tokens) if kl is not None
                 else (0.0 * tokens, tokens))
    if loss_type in CLIPPED:
        low = ((coef_1 < 1 - s["rl.epsilon"]) & (advantages < 0)).astype(jnp.float32)
        high = ((coef_1 > 1 + s["rl.epsilon_upper"]) & (advantages > 0)).astype(jnp.float32)
        out["clip_ratio/low_mean"], out["clip_ratio/high_mean"] = masked(low), masked(high)
        out["clip_ratio/region_mean"] = masked(jnp.maximum(low, high))
    elif loss_type == "cispo":
        capped = (coef_1 > s["rl.epsilon_upper"]) & (advantages > 0)
        out["cispo_clip_ratio"] = masked(capped.astype(jnp.float32))
    elif loss_type == "vespo":  # (one weight per completion: its mean over completions)
        first = _first_tokens(seqs)
        out["vespo/phi_seq_mean"] = (jnp.sum(phi * first), jnp.sum(first))
    return out


def _first_tokens(seqs: Completions) -> jax.Array:
    """[B, T]: 1 on each completion's first scored token (a completion's scored tokens are contiguous)."""
    mask = seqs.mask
    before = jnp.concatenate([jnp.zeros_like(mask[:, :1]), mask[:, :-1]], axis=1)
    previous = jnp.concatenate([jnp.zeros_like(seqs.segments[:, :1]), seqs.segments[:, :-1]], axis=1)
    same = previous == seqs.segments
    return mask * (1 - before * same)


def _row(loss_type: str, doc: str) -> Objective:
    return Objective(loss_type, _loss(loss_type), denominator=_global_denominator(loss_type), reads=READS,
                     settings=SETTINGS, doc=doc,
                     reports=("entropy", "kl", *(("clip_ratio/low_mean", "clip_ratio/high_mean",
                                                  "clip_ratio/region_mean") if loss_type in CLIPPED else ()),
                              *(("cispo_clip_ratio", ) if loss_type == "cispo" else ()),
                              *(("vespo/phi_seq_mean", ) if loss_type == "vespo" else ())))


def _global_denominator(loss_type: str):
    """The loss type's denominator over the global batch (Inputs.totals), from the batch alone."""

    def denominator(batch: Batch) -> jax.Array:
        seqs = Completions(batch)
        if loss_type == "bnpo":
            return jnp.sum(seqs.mask)
        if loss_type in ("dapo", "cispo", "vespo"):
            return jnp.sum(batch["token_share"])
        return seqs.count  # grpo, sapo, luspo, dr_grpo

    return denominator


ROWS = tuple(_row(name, doc) for name, doc in (
    ("grpo", "GRPO: the clipped surrogate, each completion's token mean, averaged over completions"),
    ("bnpo", "BNPO: the clipped surrogate averaged over the step's tokens"),
    ("dr_grpo", "Dr. GRPO: the clipped surrogate summed, over completions x rl.max_completion_length"),
    ("dapo", "DAPO (TRL's default): the clipped surrogate summed, over the generation batch's tokens a step"),
    ("cispo", "CISPO: the capped, stopped ratio times the advantage times logp, DAPO's normalizer"),
    ("sapo", "SAPO: a soft sigmoid gate on the ratio instead of the clip, each completion's token mean"),
    ("luspo", "LUSPO: the clipped surrogate summed over each completion, averaged over completions"),
    ("vespo", "VESPO: gamma-weighted logp by the completion's ratio, DAPO's normalizer"),
))
