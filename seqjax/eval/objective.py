"""Evaluation by the run's objective over a split's batches as training builds them: preference
pairs (``data.format=preference``), with TRL's metrics, and chats with images
(``data.image_processor``), whose batches only the training pipeline builds.

Every pair (example) of the split is scored once, in order (packed as training packs them,
unshuffled): the objective's loss (a mean over pairs; ``sft``: over chosen tokens; ``lm``: the
mean nll per scored token) and, on pairs, averaged over them, ``rewards/accuracies`` (the
fraction whose chosen reward is above the rejected one), ``rewards/margins``,
``rewards/chosen``, ``rewards/rejected``, ``logps/chosen`` and ``logps/rejected``, as TRL's
evaluation reports them. The reference model is the training run's
(:func:`seqjax.weights.inference.reference_for`).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.tree import Config
from seqjax.core.progress import progress_bar
from seqjax.data.epochs import epoch_in_order
from seqjax.data.pairs import slot_pairs, with_reference
from seqjax.objectives import Inputs, resolve, settings_of
from seqjax.objectives.base import pair_sums, target_logprobs
from seqjax.store.reader import TokenStore


def evaluate_objective(model: nnx.Module, reference: nnx.Module | np.ndarray | None, store: TokenStore,
                       config: Config, *, max_batches: int | None = None, split: str | None = None,
                       per_example: bool = False, progress: bool = True) -> dict[str, Any]:
    """The objective ``train.objective`` (and, on pairs, TRL's metrics) over the batches of ``store``
    (the first ``max_batches`` batches only, when given: ``complete`` is then false).
    ``reference``: the reference model, or its precomputed table of the split
    (``train.precompute_reference``), or None for an objective without one. ``per_example`` (pairs):
    ``per_example`` in the result, one row per pair (:func:`pair_rows`)."""
    tc = config.train
    objective = resolve(tc.objective, tc.objective_weights)
    settings = settings_of(config, objective)
    graphdef, state = nnx.split(model)
    table = reference if isinstance(reference, np.ndarray) else None
    reference_graphdef, reference_state = (None, None) if table is not None or reference is None else nnx.split(
        reference)

    def reference_logprobs(reference_state, micro):
        if reference_graphdef is None:  # the precomputed table, in the batch
            return micro["reference_logps"]
        return target_logprobs(nnx.merge(reference_graphdef, reference_state), micro, None, micro["weights"] > 0)

    @jax.jit
    def terms(sums, state, reference_state, batch):
        inputs = Inputs(nnx.merge(graphdef, state), None, settings, objective.totals(batch),
                        lambda micro: reference_logprobs(reference_state, micro))
        return objective.combine(sums, objective.loss(inputs, batch))

    @jax.jit
    def pair_figures(state, reference_state, batch):  # (per pair slot: the policy's, the reference's, tokens)
        scored = batch["weights"] > 0
        ours = pair_sums(target_logprobs(nnx.merge(graphdef, state), batch, None, scored), batch)
        theirs = None if reference is None else pair_sums(reference_logprobs(reference_state, batch), batch)
        return {"policy": ours, "reference": theirs, "tokens": pair_sums(jnp.ones(scored.shape, jnp.float32), batch)}

    tables = {name: np.zeros((store.num_docs // 2, 2)) for name in ("policy", "reference", "tokens")} \
        if per_example else None
    start, sums, batches = time.perf_counter(), objective.zero_terms(), 0
    total, in_order = epoch_in_order(config, store)
    bar = progress_bar(total=total if max_batches is None else min(total, max_batches), unit="batch",
                       desc=f"{objective.name} on "
                            f"{split or store.manifest.get('split') or config.eval.split}",
                       enabled=progress)
    for batch in in_order:
        if max_batches is not None and batches >= max_batches:
            break
        bar.update()
        batch = batch if table is None else with_reference(batch, table)
        if tables is not None:  # the sums the objective takes, each pair's row of the tables
            _fill(tables, pair_figures(state, reference_state, batch), slot_pairs(batch))
        sums, batches = terms(sums, state, reference_state, batch), batches + 1
    bar.close()
    count = float(sums.denominator)
    return {
        "split": split or store.manifest.get("split") or config.eval.split,
        "objective": "+".join(tc.objective), "complete": batches >= total, "batches": batches,
        "loss": float(sums.loss) / count if count else None, "weight": count,
        **{name: (float(value) if float(sums.reported[name][1]) else None)
           for name, value in sorted(objective.reported_values(sums.reported).items())},
        **({"pairs": int(np.round(float(sums.reported["rewards/accuracies"][1])))}
           if "rewards/accuracies" in sums.reported else {}),
        "seconds": round(time.perf_counter() - start, 3),
        **({"per_example": pair_rows(tables, reference is not None, tc.beta)} if tables is not None else {}),
    }


def _fill(tables: dict[str, np.ndarray], figures: dict[str, Any], slots: np.ndarray) -> None:
    """Each pair slot's (chosen, rejected) figures into its pair's row of the tables."""
    row, slot = np.nonzero(slots >= 0)
    for name, pair in figures.items():
        if pair is not None:
            tables[name][slots[row, slot]] = np.stack([np.asarray(side)[row, slot] for side in pair], axis=1)


def pair_rows(tables: dict[str, np.ndarray], reference: bool, beta: float) -> list[dict[str, Any]]:
    """One row per pair scored: its number in the store, its completions' scored tokens, the policy's and the
    reference's log-probabilities (sums), and TRL's rewards: beta times the log-ratio to the
    reference, or without one beta times the per-token mean (CPO's and ORPO's)."""
    rows = []
    for k in np.flatnonzero(tables["tokens"][:, 0] > 0):
        tokens, ours = tables["tokens"][k], tables["policy"][k]
        row = {"pair": int(k), "tokens_chosen": int(tokens[0]), "tokens_rejected": int(tokens[1]),
               "logp_chosen": float(ours[0]), "logp_rejected": float(ours[1])}
        if reference:
            theirs = tables["reference"][k]
            row |= {"ref_logp_chosen": float(theirs[0]), "ref_logp_rejected": float(theirs[1])}
            rewards = beta * (ours - theirs)
        else:
            rewards = beta * ours / np.maximum(tokens, 1)
        row |= {"reward_chosen": float(rewards[0]), "reward_rejected": float(rewards[1]),
                "margin": float(rewards[0] - rewards[1])}
        rows.append(row)
    return rows
