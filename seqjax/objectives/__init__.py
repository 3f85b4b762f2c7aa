"""Training objectives: what the train step's loss is, chosen by ``train.objective``.

============  ==============================================================  ==========================
objective     loss                                                            reads
============  ==============================================================  ==========================
lm            next-token cross-entropy on the scored targets (contract 3)    the contract's five
dpo           DPO's sigmoid loss (cDPO with label_smoothing), per pair       pair_ids, reference
ipo           IPO's squared loss on length-normalized log-ratios             pair_ids, reference
hinge         SLiC's hinge on beta * the log-ratio difference                 pair_ids, reference
robust        robust DPO under label_smoothing flips                          pair_ids, reference
simpo         TRL's CPO with loss_type=simpo: SimPO's loss + cpo_alpha * sft  pair_ids
sft           NLL of the chosen completions, per chosen token                 pair_ids
sft_sequence  NLL of the chosen sequences, prompt included, per token         pair_ids
odds_ratio    ORPO's odds-ratio term alone                                    pair_ids
orpo          TRL's ORPO: sft_sequence + odds_ratio                           pair_ids
grpo, bnpo,   TRL's GRPOTrainer's loss types on an RL run's rollouts          advantages, old_logps, ...
dr_grpo,      (seqjax.objectives.rl; dapo is TRL's default)
dapo, cispo,
sapo, luspo,
vespo
============  ==============================================================  ==========================

The preference rows and their formulas: :mod:`seqjax.objectives.preference`. The papers' forms where
TRL departs from them: SimPO is ``simpo`` with ``train.cpo_alpha=0``, ORPO's paper ``[sft,
odds_ratio]``.

Each is a row (:class:`~seqjax.objectives.base.Objective`): a function from the
policy and a micro-batch to sums (:class:`~seqjax.objectives.base.Terms`),
what those sums are divided by, the batch fields and ``train.*`` keys it reads.
The train step (:mod:`seqjax.train.step`) and evaluation look objectives up
here and never by name.

**Adding an objective**: write ``loss(inputs, micro) -> Terms`` returning sums,
give it a row, and add the row to :data:`OBJECTIVES` (or :func:`register` it at
run time, as the tests' toy objective does). Metrics it reports in
``Terms.reported`` reach metrics.jsonl and the trackers with no change to the
loop. A new batch field it reads goes in the contract's table
(:data:`seqjax.data.contract.OPTIONAL_FIELDS`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

from seqjax.core.errors import ConfigError
from seqjax.data.contract import Batch
from seqjax.objectives.base import Inputs, Objective, Terms
from seqjax.objectives.lm import LM
from seqjax.objectives.preference import DPO, HINGE, IPO, ODDS_RATIO, ROBUST, SFT, SFT_SEQUENCE, SIMPO
from seqjax.objectives.rl import ROWS as RL_ROWS

OBJECTIVES: dict[str, Objective] = {
    row.name: row for row in (LM, DPO, IPO, HINGE, ROBUST, SFT, SFT_SEQUENCE, ODDS_RATIO, *RL_ROWS)}
# The names TRL logs a part's loss under (its CPO and ORPO trainers' nll_loss), besides <part>/loss.
TRL_NAMES = {"sft": "nll_loss", "sft_sequence": "nll_loss"}
# train.objective's default: the first entry, what every run computed before objectives were rows
DEFAULT = LM


def settings_of(config, objective: Objective) -> dict[str, Any]:
    """The values of the keys ``objective`` reads (``Objective.settings``): ``beta`` is ``train.beta``,
    ``rl.epsilon`` is ``rl.epsilon``."""
    out = {}
    for key in objective.settings:
        section, _, name = key.rpartition(".")
        out[key] = getattr(getattr(config, section or "train"), name)
    return out


def register(objective: Objective) -> Objective:
    """Add ``objective`` to the table under its name (a name already taken is refused)."""
    if objective.name in OBJECTIVES:
        raise ValueError(f"objective {objective.name!r} is already registered; expected a new name")
    OBJECTIVES[objective.name] = objective
    return objective


def resolve(names: Sequence[str], weights: Sequence[float] = ()) -> Objective:
    """The objective ``train.objective`` names: one row, or several added with
    ``train.objective_weights``.

    A sum of objectives divides each one's sum by its own denominator over the global batch
    (``Inputs.totals``), so ``[a, b]`` with weights ``[1, w]`` is exactly ``loss_a + w * loss_b``,
    as TRL's ``loss_type=[...]`` with ``loss_weights`` computes it, however the batch is cut into
    micro-batches.
    """
    names = list(names)
    for i, name in enumerate(names):
        if name not in OBJECTIVES:
            raise ConfigError(
                f"train.objective[{i}]: got {name!r}, expected one of {', '.join(OBJECTIVES)}")
    if not names:
        raise ConfigError(
            "train.objective: got [], expected at least one objective (lm is the default)")
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"train.objective_weights: got {list(weights)}, expected one weight per objective "
            f"({names}) or []")
    if len(set(names)) != len(names):
        raise ConfigError(f"train.objective: got {names}, expected each objective once")
    rows = [OBJECTIVES[name] for name in names]
    if len(rows) == 1 and not weights:
        return rows[0]
    return _weighted(rows, list(weights) or [1.0] * len(rows))


def _weighted(rows: list[Objective], weights: list[float | str], name: str | None = None,
              doc: str | None = None) -> Objective:
    """Several objectives as one: each row's sum scaled to the first's denominator, so dividing the
    summed value by the first's summed denominator gives ``sum_i w_i * value_i / denominator_i``
    over the global batch. A weight may be a ``train.*`` key's name (``cpo_alpha``), read as the
    objective's other settings are."""
    first = rows[0].name

    def loss(inputs: Inputs, micro: Batch) -> Terms:
        value = loss_sum = jnp.zeros((), jnp.float32)
        reported, denominator = {}, None
        for row, w in zip(rows, weights):
            w = inputs.settings[w] if isinstance(w, str) else w
            terms = row.loss(inputs, micro)
            scale = w * inputs.totals[first] / jnp.where(inputs.totals[row.name] > 0,
                                                         inputs.totals[row.name], 1.0)
            value, loss_sum = value + scale * terms.value, loss_sum + scale * terms.loss
            denominator = terms.denominator if denominator is None else denominator
            reported |= terms.reported
            reported[f"{row.name}/loss"] = (terms.loss, terms.denominator)
            if row.name in TRL_NAMES:
                reported[TRL_NAMES[row.name]] = (terms.loss, terms.denominator)
        return Terms(value, denominator, loss_sum, reported)

    return Objective(
        name=name or "+".join(row.name for row in rows), loss=loss, denominator=rows[0].denominator,
        reads=tuple(dict.fromkeys(f for row in rows for f in row.reads)),
        settings=tuple(dict.fromkeys([*(s for row in rows for s in row.settings),
                                      *(w for w in weights if isinstance(w, str))])),
        reference=any(row.reference for row in rows), doc=doc or " + ".join(row.doc for row in rows),
        parts=tuple(rows), extremes=tuple(dict.fromkeys(e for row in rows for e in row.extremes)), reports=tuple(
            dict.fromkeys(
                [*(n for row in rows for n in row.reports),
                 *(f"{row.name}/loss" for row in rows),
                 *(TRL_NAMES[row.name] for row in rows if row.name in TRL_NAMES)])))


# SimPO as TRL 1.16's CPOTrainer computes it (loss_type=simpo): SimPO's loss plus cpo_alpha times
# the chosen completions' NLL (TRL's default 1; the paper's SimPO is cpo_alpha=0)
OBJECTIVES["simpo"] = _weighted([SIMPO, SFT], [1.0, "cpo_alpha"], name="simpo",
                                doc="SimPO as TRL's CPO computes it: SimPO's loss + cpo_alpha * sft")
# ORPO (Hong et al. 2024) as TRL 1.16's ORPOTrainer computes it: the chosen sequences' NLL, prompt
# included, plus the odds-ratio term (the paper's NLL is the completion's:
# train.objective=[sft,odds_ratio])
OBJECTIVES["orpo"] = _weighted([SFT_SEQUENCE, ODDS_RATIO], [1.0, 1.0], name="orpo",
                               doc="ORPO as TRL's ORPOTrainer computes it: sft_sequence + odds_ratio")

__all__ = ["DEFAULT", "Inputs", "OBJECTIVES", "Objective", "Terms", "register", "resolve", "settings_of"]
