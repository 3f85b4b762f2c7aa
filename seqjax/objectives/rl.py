"""RL loss types on an RL run's rollouts (docs/rl.md), as TRL 1.16 computes them, each a row of the
objectives table (``train.objective=dapo``) built from three registered pieces: a **surrogate** (the
per-token loss and its own metrics), a **reduction** (how a step's per-token losses become one
number, and the one denominator that serves a micro-batch and the global step alike) and, on the
host, an **advantage estimator** (:data:`seqjax.train.rewards.ADVANTAGES`). A new algorithm is a row
of :data:`LOSS_TYPES`.

Per scored completion token, with ``A`` its completion's advantage, ``r`` the ratio to the policy
that sampled it and ``e``/``E`` = ``rl.epsilon``/``rl.epsilon_high``:

===========  =======================================================================================
surrogate    per token
===========  =======================================================================================
clipped      ``-min(r A, clip(r, 1 - e, 1 + E) A)`` (``rl.delta``: ``r`` capped at delta first)
cispo        ``-stop_gradient(min(r, E)) A logp``
sapo         ``-(4 / t) sigmoid(t (r - 1)) A``, ``t`` = ``rl.sapo_temperature_pos`` or ``_neg``
vespo        ``-stop_gradient(phi(w)) A logp``, ``phi(w) = exp(l + k log w - l w)`` of the completion's ratio
             ``w`` (TRL's defaults: k, l = 2, 3 for A >= 0, 3, 2 below)
===========  =======================================================================================

The ratio ``r = exp(logp - old)`` is per token, or one per completion: the exp of the mean of its
tokens' log-ratios (``rl.importance_sampling_level=sequence``, GSPO), or of their sum (RLOO's).
``rl.beta`` adds the k3 KL to the reference, ``exp(ref - logp) - (ref - logp) - 1`` per token (times
``r`` under ``rl.use_bias_correction_kl``, TRL's default), except where the loss type puts its KL in
the reward (RLOO: ``beta`` times the completion's summed ``old - ref``, taken from its reward before
the advantages).

==================  =============================================  ===============================================
reduction           the step's loss                                 loss types (TRL 1.16's ``_compute_loss``)
==================  =============================================  ===============================================
completion_mean     mean over completions of each one's token mean  grpo, sapo, rloo (its per-completion loss)
token_mean          mean over the step's scored tokens              bnpo
max_length          sum / (completions x rl.max_completion_length)  dr_grpo
generation_tokens   sum / (the generation batch's scored tokens /   dapo, cispo, vespo (TRL's
                    rl.steps_per_generation)                        ``num_items_in_batch``)
completion_sum      mean over completions of each one's token sum   luspo
==================  =============================================  ===============================================

Every sum is over the global step (:class:`~seqjax.objectives.base.Terms`), so packing and
micro-batches leave the numbers as one padded batch gives them (TRL averages per micro-batch:
equal with one). The reported metrics are TRL's: ``entropy``, ``kl``, the clipped surrogate's
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``, ``/low_min`` and ``/high_max`` (the
least and the most any one completion was clipped), ``cispo_clip_ratio``, ``vespo/phi_seq_mean``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from seqjax.data.contract import Batch
from seqjax.model.loss import segment_sums
from seqjax.objectives.base import Inputs, Objective, Terms

READS = ("completion", "advantages", "token_share", "old_logps", "fresh", "rollout_reference_logps",
         "reference_is_policy")
SETTINGS = ("rl.epsilon", "rl.epsilon_upper", "rl.delta", "rl.importance_sampling_level", "rl.beta",
            "rl.use_bias_correction_kl", "rl.sapo_temperature_pos", "rl.sapo_temperature_neg",
            "rl.max_completion_length")
# VESPO's gamma weighting, TRL 1.16's defaults (vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
# vespo_lambda_neg)
VESPO = (2.0, 3.0, 3.0, 2.0)


class Completions:
    """A micro-batch's completions: the scored mask, per-token sums over each completion (a
    segment of its row) spread back over its tokens, and how many completions the micro-batch
    holds."""

    def __init__(self, micro: Batch):
        self.mask = (micro["weights"] > 0).astype(jnp.float32)
        self.segments = micro["segment_ids"]
        self.width = self.segments.shape[1]
        owned = ((micro["completion"] > 0) & (self.segments > 0)).astype(jnp.float32)
        # a completion counts once, its tokens all masked (rl.mask_truncated_completions) or not, as
        # TRL's per-row mean counts it
        self.owned = segment_sums(owned, self.segments, self.width) > 0  # [B, S]
        self.count = jnp.sum(self.owned).astype(jnp.float32)
        self.tokens = self.per_sequence(jnp.ones_like(self.mask))  # [B, S]

    def per_sequence(self, values: jax.Array) -> jax.Array:
        """[B, S]: each completion's sum of ``values`` over its scored tokens."""
        return segment_sums(values * self.mask, self.segments, self.width)

    def spread(self, per_sequence: jax.Array) -> jax.Array:
        """[B, T]: each token's completion's value."""
        index = jnp.clip(self.segments - 1, 0, self.width - 1)
        return jnp.take_along_axis(per_sequence, index, axis=1) * (self.segments > 0)

    def means(self, values: jax.Array) -> jax.Array:
        """[B, S]: each completion's mean of ``values`` over its scored tokens (0 for none)."""
        return self.per_sequence(values) / jnp.maximum(self.tokens, 1.0)

    def mean(self, values: jax.Array) -> jax.Array:
        """[B, T]: each token's completion's mean of ``values`` over its scored tokens."""
        return self.spread(self.means(values))


@dataclass
class Policy:
    """What a surrogate sees of one micro-batch: the policy's log-probabilities, the completions,
    the ratio ``coef`` to the sampling policy (per token), the advantages (per token), and the
    settings."""

    logp: jax.Array
    seqs: Completions
    coef: jax.Array
    log_ratio: jax.Array
    advantages: jax.Array
    settings: Mapping[str, Any]
    per_completion: bool  # one ratio per completion (its metrics then count completions, not tokens)


# -- ratios: how a token's log-ratio becomes its ratio

RATIOS: dict[str, Callable[[Completions, jax.Array], jax.Array]] = {
    "token": lambda seqs, log_ratio: jnp.exp(log_ratio),
    "sequence": lambda seqs, log_ratio: jnp.exp(seqs.mean(log_ratio)),  # GSPO: the mean's exp
    "sum": lambda seqs, log_ratio: jnp.exp(seqs.spread(seqs.per_sequence(log_ratio))),  # RLOO: the sum's
}


# -- surrogates: the per-token loss and its own metrics


@dataclass(frozen=True)
class Surrogate:
    """``loss(policy) -> [B, T]`` per-token loss; ``metrics(policy, reduce) -> {name: (sum,
    count)}`` its TRL metrics, ``reduce`` the helpers of :func:`_metric_helpers`; ``names`` them,
    ``extremes`` the ones that are a min or a max."""

    name: str
    loss: Callable[[Policy], jax.Array]
    metrics: Callable[[Policy, Any], dict] = lambda policy, reduce: {}
    names: tuple[str, ...] = ()
    extremes: tuple[tuple[str, str], ...] = ()


def _clipped(p: Policy) -> jax.Array:
    s = p.settings
    coef_2 = jnp.clip(p.coef, 1 - s["rl.epsilon"], 1 + s["rl.epsilon_upper"])
    capped = p.coef if s["rl.delta"] is None else jnp.minimum(p.coef, s["rl.delta"])
    return -jnp.minimum(capped * p.advantages, coef_2 * p.advantages)


def _clipped_metrics(p: Policy, reduce) -> dict:
    s = p.settings
    low = ((p.coef < 1 - s["rl.epsilon"]) & (p.advantages < 0)).astype(jnp.float32)
    high = ((p.coef > 1 + s["rl.epsilon_upper"]) & (p.advantages > 0)).astype(jnp.float32)
    return {"clip_ratio/low_mean": reduce.mean(low), "clip_ratio/high_mean": reduce.mean(high),
            "clip_ratio/region_mean": reduce.mean(jnp.maximum(low, high)),
            "clip_ratio/low_min": reduce.extreme(low, "min"), "clip_ratio/high_max": reduce.extreme(high, "max")}


def _cispo(p: Policy) -> jax.Array:
    return -jax.lax.stop_gradient(jnp.minimum(p.coef, p.settings["rl.epsilon_upper"])) * p.advantages * p.logp


def _sapo(p: Policy) -> jax.Array:
    s = p.settings
    t = jnp.where(p.advantages > 0, s["rl.sapo_temperature_pos"], s["rl.sapo_temperature_neg"])
    return -jax.nn.sigmoid(t * (p.coef - 1)) * 4 / t * p.advantages


def _vespo_phi(p: Policy) -> jax.Array:
    """VESPO's gamma weight of each token's completion (TRL's ``get_gamma_weights``, no vLLM
    correction)."""
    k_pos, l_pos, k_neg, l_neg = VESPO
    seqs = p.seqs
    log_w = jnp.clip(seqs.spread(seqs.per_sequence(jnp.clip(p.log_ratio, -20.0, 20.0))), jnp.log(1e-8), 20.0)
    positive = p.advantages >= 0
    k, lam = jnp.where(positive, k_pos, k_neg), jnp.maximum(jnp.where(positive, l_pos, l_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


SURROGATES: dict[str, Surrogate] = {s.name: s for s in (
    Surrogate("clipped", _clipped, _clipped_metrics,
              ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
               "clip_ratio/high_max"), (("clip_ratio/low_min", "min"), ("clip_ratio/high_max", "max"))),
    Surrogate("cispo", _cispo, lambda p, reduce: {"cispo_clip_ratio": reduce.mean(
        ((p.coef > p.settings["rl.epsilon_upper"]) & (p.advantages > 0)).astype(jnp.float32))},
              ("cispo_clip_ratio",)),
    Surrogate("sapo", _sapo),
    Surrogate("vespo", lambda p: -_vespo_phi(p) * p.advantages * p.logp,
              lambda p, reduce: {"vespo/phi_seq_mean": reduce.per_completion(_vespo_phi(p))},
              ("vespo/phi_seq_mean",)),
)}


# -- reductions: the step's number from the per-token losses, and its one denominator


@dataclass(frozen=True)
class Reduction:
    """``value(per_token, seqs, settings)``: a micro-batch's sum; ``denominator(batch, seqs)``:
    its share of what the step divides by, the same function over one micro-batch or the global
    batch."""

    name: str
    value: Callable[[jax.Array, Completions, Mapping[str, Any]], jax.Array]
    denominator: Callable[[Batch, Completions], jax.Array]


REDUCTIONS: dict[str, Reduction] = {r.name: r for r in (
    Reduction("completion_mean", lambda loss, seqs, s: jnp.sum(seqs.per_sequence(loss) / jnp.maximum(seqs.tokens, 1.0)),
              lambda batch, seqs: seqs.count),
    Reduction("token_mean", lambda loss, seqs, s: jnp.sum(loss), lambda batch, seqs: jnp.sum(seqs.mask)),
    Reduction("max_length", lambda loss, seqs, s: jnp.sum(loss) / s["rl.max_completion_length"],
              lambda batch, seqs: seqs.count),
    Reduction("generation_tokens", lambda loss, seqs, s: jnp.sum(loss),
              lambda batch, seqs: jnp.sum(batch["token_share"])),
    Reduction("completion_sum", lambda loss, seqs, s: jnp.sum(loss), lambda batch, seqs: seqs.count),
)}


# -- loss types: the rows


@dataclass(frozen=True)
class LossType:
    """One RL loss type: its surrogate, reduction and ratio (None:
    ``rl.importance_sampling_level``), the advantage estimator its rollouts take
    (:data:`seqjax.train.rewards.ADVANTAGES`; None: ``rl.scale_rewards``'s) and where its KL to
    the reference goes (``loss``: k3 per token; ``reward``: the completion's summed first-order
    estimate, taken from its reward)."""

    name: str
    surrogate: str
    reduction: str
    doc: str
    ratio: str | None = None
    advantage: str | None = None
    kl: str = "loss"


LOSS_TYPES: tuple[LossType, ...] = (
    LossType("grpo", "clipped", "completion_mean",
             "GRPO: the clipped surrogate, each completion's token mean, averaged over "
             "completions"),
    LossType("bnpo", "clipped", "token_mean", "BNPO: the clipped surrogate averaged over the "
                                              "step's tokens"),
    LossType("dr_grpo", "clipped", "max_length",
             "Dr. GRPO: the clipped surrogate summed, over completions x rl.max_completion_length"),
    LossType("dapo", "clipped", "generation_tokens",
             "DAPO (TRL's default): the clipped surrogate summed, over the generation batch's "
             "tokens a step"),
    LossType("cispo", "cispo", "generation_tokens",
             "CISPO: the capped, stopped ratio times the advantage times logp, DAPO's normalizer"),
    LossType("sapo", "sapo", "completion_mean",
             "SAPO: a soft sigmoid gate on the ratio instead of the clip, each completion's token "
             "mean"),
    LossType("luspo", "clipped", "completion_sum",
             "LUSPO: the clipped surrogate summed over each completion, averaged over completions"),
    LossType("vespo", "vespo", "generation_tokens", "VESPO: gamma-weighted logp by the completion's ratio, DAPO's "
             "normalizer"),
    LossType("rloo", "clipped", "completion_mean",
             "RLOO (TRL's RLOOTrainer): leave-one-out advantages, the clipped surrogate on each "
             "completion's summed ratio, averaged over completions; the KL in the "
             "reward", ratio="sum",
             advantage="leave_one_out", kl="reward"),
)


class _Reduce:
    """A micro-batch's metric helpers: a mean over its scored tokens, or, with one ratio per
    completion, over its completions (TRL's ``global_masked_mean``); a completion's value's min
    or max over its completions (TRL's ``nanmin``/``nanmax`` of ``masked_seq_mean``)."""

    def __init__(self, policy: Policy):
        self.p = policy
        seqs = policy.seqs
        # the completions a per-completion figure counts: every one with one ratio per completion (a
        # masked one's ratio is 1), those with a scored token otherwise
        self.counted = seqs.owned if policy.per_completion else seqs.owned & (seqs.tokens > 0)

    def mean(self, values: jax.Array):
        values = jax.lax.stop_gradient(values)
        if self.p.per_completion:
            return self.per_completion(values)
        return jnp.sum(values * self.p.seqs.mask), jnp.sum(self.p.seqs.mask)

    def per_completion(self, values: jax.Array):
        """(the sum over completions of each one's mean, completions)."""
        means = self.p.seqs.means(jax.lax.stop_gradient(values))
        return jnp.sum(jnp.where(self.counted, means, 0.0)), jnp.sum(self.counted).astype(jnp.float32)

    def extreme(self, values: jax.Array, kind: str):
        means = self.p.seqs.means(jax.lax.stop_gradient(values))
        pick, start = (jnp.min, jnp.inf) if kind == "min" else (jnp.max, -jnp.inf)
        return pick(jnp.where(self.counted, means, start)), jnp.sum(self.counted).astype(jnp.float32)


def _policy(inputs: Inputs, micro: Batch, loss_type: LossType) -> tuple[Policy, dict]:
    s = inputs.settings
    scored = micro["weights"] > 0
    logp, stats = inputs.logprobs(micro, scored, stats=True)
    seqs = Completions(micro)
    fresh = micro["fresh"] > 0  # ([B, 1])
    old = jnp.where(fresh, jax.lax.stop_gradient(logp), micro["old_logps"])
    log_ratio = (logp - old) * seqs.mask
    level = loss_type.ratio or s["rl.importance_sampling_level"]
    coef = RATIOS[level](seqs, log_ratio)
    return Policy(logp, seqs, coef, log_ratio, micro["advantages"], s, level != "token"), stats


def _kl(p: Policy, micro: Batch) -> jax.Array:
    """The k3 KL to the reference per token (times the ratio under rl.use_bias_correction_kl)."""
    # (the reference's weights were the policy's when the batch was sampled: its log-probabilities
    # are the policy's own on the batch's first pass, and the sampling policy's, kept as the
    # reference's, after)
    same = (micro["reference_is_policy"] > 0) & (micro["fresh"] > 0)  # ([B, 1])
    ref = jnp.where(same, jax.lax.stop_gradient(p.logp), micro["rollout_reference_logps"])
    kl = jnp.exp(ref - p.logp) - (ref - p.logp) - 1
    return kl * p.coef if p.settings["rl.use_bias_correction_kl"] else kl


def _loss(loss_type: LossType) -> Callable[[Inputs, Batch], Terms]:
    surrogate, reduction = SURROGATES[loss_type.surrogate], REDUCTIONS[loss_type.reduction]

    def loss(inputs: Inputs, micro: Batch) -> Terms:
        policy, stats = _policy(inputs, micro, loss_type)
        seqs = policy.seqs
        per_token = surrogate.loss(policy)
        reduce = _Reduce(policy)
        reported = {"entropy": (jnp.sum(jax.lax.stop_gradient(stats["entropy"]) * seqs.mask), jnp.sum(seqs.mask))}
        if loss_type.kl == "loss":
            # (with rl.beta 0 there is no KL term: it reports 0, where TRL logs nothing)
            kl = _kl(policy, micro) if inputs.settings["rl.beta"] else jnp.zeros_like(per_token)
            per_token = per_token + inputs.settings["rl.beta"] * kl
            reported["kl"] = (jnp.sum(jax.lax.stop_gradient(kl) * seqs.mask), jnp.sum(seqs.mask))
        reported |= surrogate.metrics(policy, reduce)
        value = reduction.value(per_token * seqs.mask, seqs, inputs.settings)
        return Terms(value, reduction.denominator(micro, seqs), value, reported)

    return loss


def _row(loss_type: LossType) -> Objective:
    surrogate, reduction = SURROGATES[loss_type.surrogate], REDUCTIONS[loss_type.reduction]
    return Objective(loss_type.name, _loss(loss_type),
                     denominator=lambda batch: reduction.denominator(batch, Completions(batch)), reads=READS,
                     settings=SETTINGS, doc=loss_type.doc,
                     reports=("entropy", *(("kl",) if loss_type.kl == "loss" else ()), *surrogate.names),
                     extremes=surrogate.extremes, rl=loss_type)


ROWS = tuple(_row(loss_type) for loss_type in LOSS_TYPES)
