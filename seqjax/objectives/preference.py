"""Preference objectives on packed pairs: DPO, IPO, hinge, robust DPO, SimPO, ORPO and the SFT term.

Each pair's log-probabilities are one reduction shared by every objective: the scored targets'
log p summed by the batch's ``pair_ids`` (2p - 1: pair p's chosen sequence in its row, 2p: its
rejected one; :mod:`seqjax.data.pairs`), which gives the same per-pair sums from a packed row as
from one pair per row. With ``c`` and ``r`` the policy's sums, ``c0`` and ``r0`` the reference's,
``|c|`` the scored tokens, ``d = (c - c0) - (r - r0)`` and ``b = train.beta``, per pair:

=======  =======================================================================  ===========================
name     loss                                                                     TRL 1.16
=======  =======================================================================  ===========================
dpo      -(1 - e) log s(b d) - e log s(-b d)           (e: label_smoothing)       sigmoid (which ignores e)
ipo      ((c - c0) / |c| - (r - r0) / |r| - 1 / (2 b))^2                          ipo
hinge    max(0, 1 - b d)                                                          hinge
robust   ((1 - e) (-log s(b d)) - e (-log s(-b d))) / (1 - 2 e)                   robust
simpo    -(1 - e) log s(b (c/|c| - r/|r|) - g) - e log s(-(...))   (g: gamma)     CPO's simpo, cpo_alpha=0
orpo     sft + odds: -b log s(log odds(c/|c|) - log odds(r/|r|))                  ORPO
sft      -sum of the chosen tokens' log p / chosen tokens                         sft
=======  =======================================================================  ===========================

(s is the sigmoid, log odds(x) = x - log(1 - exp(x)).) Where TRL departs from the published
formula the paper is followed: TRL's sigmoid loss ignores ``label_smoothing``, and ``dpo`` here is
the conservative DPO (cDPO) the DPO authors define with it (equal to TRL's at the default 0). IPO
is TRL's length-normalized form, which the IPO authors confirmed is what their paper's results
used.

Each objective returns the sum of its per-pair losses over the micro-batch and the pairs it holds
(``sft``: the chosen tokens), so the train step's one division gives a mean over the global batch's
pairs however it is packed or cut into micro-batches. Each reports TRL's metrics, averaged over
pairs: ``rewards/chosen`` (b (c - c0); reference-free objectives: b c / |c|, as TRL's CPO and ORPO
log), ``rewards/rejected``, ``rewards/accuracies`` (chosen reward above rejected),
``rewards/margins``, ``logps/chosen`` and ``logps/rejected`` (c and r).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from seqjax.data.contract import Batch
from seqjax.objectives.base import Inputs, Objective, Terms, pair_sums

REPORTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def pair_count(batch: Batch) -> jax.Array:
    """Pairs in a batch: the chosen sequences with a scored target."""
    chosen, _ = pair_sums(jnp.ones(batch["weights"].shape, jnp.float32), batch)
    return jnp.sum(chosen > 0).astype(jnp.float32)


def chosen_tokens(batch: Batch) -> jax.Array:
    """Scored targets of the chosen sequences (the SFT term's denominator)."""
    chosen, _ = pair_sums(jnp.ones(batch["weights"].shape, jnp.float32), batch)
    return jnp.sum(chosen)


class Pairs:
    """What a micro-batch's pairs give an objective: the policy's per-pair sums ``c``, ``r``, their
    scored token counts, the reference's ``c0``, ``r0`` (when asked for), and which slots hold a
    pair."""

    def __init__(self, inputs: Inputs, micro: Batch, reference: bool):
        scored = micro["weights"] > 0
        self.logp, self.stats = inputs.logprobs(micro, scored, stats=True)
        self.c, self.r = pair_sums(self.logp, micro)
        self.nc, self.nr = pair_sums(jnp.ones_like(self.logp), micro)
        self.valid = self.nc > 0
        chosen = scored & (micro["pair_ids"] % 2 == 1)
        self.masks = {"chosen": chosen, "rejected": scored & ~chosen}
        self.c0 = self.r0 = None
        if reference:
            ref = inputs.reference_logprobs(micro, self.logp)
            self.c0, self.r0 = pair_sums(ref, micro)

    def mean(self, per_pair: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(self.valid, per_pair, 0.0))

    def report(self, chosen_reward: jax.Array, rejected_reward: jax.Array,
               per_token: bool = False) -> dict[str, tuple[jax.Array, jax.Array]]:
        """TRL's metrics, each a (sum, count): the rewards and log-probabilities over pairs (``per_token``: each
        sequence's log-probability as a mean per token, as TRL's CPO and ORPO log it; else a sum, as
        its DPO does), the rest over completion tokens, as TRL 1.16's DPOTrainer counts them:
        ``logits/*`` the mean logit, ``entropy`` over both completions, ``mean_token_accuracy`` over
        the chosen one."""
        count = jnp.sum(self.valid).astype(jnp.float32)
        chosen_reward, rejected_reward = jax.lax.stop_gradient((chosen_reward, rejected_reward))
        c, r = jax.lax.stop_gradient(self.average if per_token else (self.c, self.r))
        values = {
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/accuracies": (chosen_reward > rejected_reward).astype(jnp.float32),
            "rewards/margins": chosen_reward - rejected_reward,
            "logps/chosen": c,
            "logps/rejected": r,
        }
        out = {name: (self.mean(value), count) for name, value in values.items()}
        chosen, rejected = self.masks["chosen"], self.masks["rejected"]

        def over(value, mask):
            return jnp.sum(jnp.where(mask, value, 0.0)), jnp.sum(mask).astype(jnp.float32)

        out["logits/chosen"] = over(self.stats["mean_logit"], chosen)
        out["logits/rejected"] = over(self.stats["mean_logit"], rejected)
        out["entropy"] = over(self.stats["entropy"], chosen | rejected)
        out["mean_token_accuracy"] = over(self.stats["top1"], chosen)
        return out

    @property
    def average(self) -> tuple[jax.Array, jax.Array]:
        """Length-normalized log-probabilities c / |c|, r / |r|."""
        return self.c / jnp.maximum(self.nc, 1.0), self.r / jnp.maximum(self.nr, 1.0)


def _logsigmoid(x):
    return jax.nn.log_sigmoid(x)


def _smoothed(x: jax.Array, eps) -> jax.Array:
    """-(1 - e) log s(x) - e log s(-x): the loss of a preference flipped with chance e."""
    return -(1 - eps) * _logsigmoid(x) - eps * _logsigmoid(-x)


def _with_reference(per_pair: Callable[[Pairs, dict], jax.Array]):
    """An objective's loss from its per-pair formula on (policy - reference) log-ratios."""

    def loss(inputs: Inputs, micro: Batch) -> Terms:
        pairs, s = Pairs(inputs, micro, reference=True), inputs.settings
        total = pairs.mean(per_pair(pairs, s))
        beta = s["beta"]
        reported = pairs.report(beta * (pairs.c - pairs.c0), beta * (pairs.r - pairs.r0))
        return Terms(total, pair_count(micro), total, reported)

    return loss


def _delta(p: Pairs) -> jax.Array:
    return (p.c - p.c0) - (p.r - p.r0)


def _dpo(p: Pairs, s) -> jax.Array:
    return _smoothed(s["beta"] * _delta(p), s["label_smoothing"])


def _ipo(p: Pairs, s) -> jax.Array:
    chosen = (p.c - p.c0) / jnp.maximum(p.nc, 1.0)
    rejected = (p.r - p.r0) / jnp.maximum(p.nr, 1.0)
    return (chosen - rejected - 1 / (2 * s["beta"]))**2


def _hinge(p: Pairs, s) -> jax.Array:
    return jax.nn.relu(1 - s["beta"] * _delta(p))


def _robust(p: Pairs, s) -> jax.Array:
    eps, x = s["label_smoothing"], s["beta"] * _delta(p)
    return (-(1 - eps) * _logsigmoid(x) + eps * _logsigmoid(-x)) / (1 - 2 * eps)


def _simpo(inputs: Inputs, micro: Batch) -> Terms:
    pairs, s = Pairs(inputs, micro, reference=False), inputs.settings
    c, r = pairs.average
    beta = s["beta"]
    total = pairs.mean(_smoothed(beta * (c - r) - s["simpo_gamma"], s["label_smoothing"]))
    return Terms(total, pair_count(micro), total, pairs.report(beta * c, beta * r, per_token=True))


def _log_odds(avg: jax.Array) -> jax.Array:
    """log(p / (1 - p)) of a length-normalized log-probability avg = log p (< 0)."""
    return avg - jnp.log1p(-jnp.exp(jnp.minimum(avg, -1e-7)))


def _odds_ratio(inputs: Inputs, micro: Batch) -> Terms:
    pairs, beta = Pairs(inputs, micro, reference=False), inputs.settings["beta"]
    c, r = pairs.average
    log_odds = _log_odds(c) - _log_odds(r)
    total = pairs.mean(-beta * _logsigmoid(log_odds))
    reported = pairs.report(beta * c, beta * r, per_token=True)
    count = jnp.sum(pairs.valid).astype(jnp.float32)
    reported["log_odds_ratio"] = (jax.lax.stop_gradient(pairs.mean(_logsigmoid(log_odds))), count)
    reported["log_odds_chosen"] = (jax.lax.stop_gradient(pairs.mean(log_odds)), count)
    return Terms(total, pair_count(micro), total, reported)


def _sft(inputs: Inputs, micro: Batch) -> Terms:
    logp = inputs.logprobs(micro, micro["weights"] > 0)
    chosen, _ = pair_sums(logp, micro)
    return Terms(-jnp.sum(chosen), chosen_tokens(micro), -jnp.sum(chosen))


def chosen_sequence(batch: Batch) -> jax.Array:
    """Every target of the chosen sequences, prompt and completion [B, T]: their tokens, and a shared
    prompt's (whose pair_ids are 0 on real tokens)."""
    pair_ids = batch["pair_ids"]
    return (batch["segment_ids"] != 0) & ((pair_ids % 2 == 1) | (pair_ids == 0))


def chosen_sequence_tokens(batch: Batch) -> jax.Array:
    """Targets of the chosen sequences, prompt and completion (the ``sft_sequence`` denominator)."""
    return jnp.sum(chosen_sequence(batch)).astype(jnp.float32)


def _sft_sequence(inputs: Inputs, micro: Batch) -> Terms:
    mask = chosen_sequence(micro)
    nll = -jnp.sum(inputs.logprobs(micro, mask))
    return Terms(nll, chosen_sequence_tokens(micro), nll)


SETTINGS = ("beta", "label_smoothing")
READS = ("pair_ids", )


def _row(name: str, loss, doc: str, settings=SETTINGS, reference: bool = True,
         denominator=pair_count, reports=REPORTS) -> Objective:
    return Objective(name, loss, denominator=denominator, reads=READS, settings=settings,
                     reference=reference, doc=doc, reports=reports if denominator is pair_count else ())


DPO = _row("dpo", _with_reference(_dpo), "DPO's sigmoid loss on beta * (chosen - rejected log-ratio), "
           "conservative with label_smoothing")
IPO = _row("ipo", _with_reference(_ipo), "IPO's squared loss on the length-normalized log-ratios")
HINGE = _row("hinge", _with_reference(_hinge), "SLiC's hinge on beta * the log-ratio difference")
ROBUST = _row("robust", _with_reference(_robust), "robust DPO, unbiased under label_smoothing flips")
SIMPO = _row("simpo_loss", _simpo, "SimPO's loss alone: reference-free, length-normalized, margin simpo_gamma",
             settings=("beta", "label_smoothing", "simpo_gamma"), reference=False)
ODDS_RATIO = _row("odds_ratio", _odds_ratio, "ORPO's odds-ratio term, -beta log s(log odds ratio)",
                  settings=("beta", ), reference=False, reports=(*REPORTS, "log_odds_ratio", "log_odds_chosen"))
SFT = _row("sft", _sft, "negative log-likelihood of the chosen completions, per chosen token",
           settings=(), reference=False, denominator=chosen_tokens)
SFT_SEQUENCE = _row("sft_sequence", _sft_sequence, "negative log-likelihood of the chosen sequences, prompt and "
                    "completion, per token (TRL's ORPO)", settings=(), reference=False,
                    denominator=chosen_sequence_tokens)
