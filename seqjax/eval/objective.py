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
import numpy as np
from flax import nnx

from seqjax.config.tree import Config
from seqjax.core.progress import progress_bar
from seqjax.data.epochs import epoch_in_order
from seqjax.data.pairs import add_to_table, with_reference
from seqjax.objectives import Inputs, resolve, settings_of
from seqjax.objectives.base import target_logprobs
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
    def terms(state, reference_state, batch):
        inputs = Inputs(nnx.merge(graphdef, state), None, settings, objective.totals(batch),
                        lambda micro: reference_logprobs(reference_state, micro))
        out = objective.loss(inputs, batch)
        return out.loss, out.denominator, out.reported

    @jax.jit
    def logprobs(state, reference_state, batch):  # (per pair: the policy's and the reference's sums)
        scored = batch["weights"] > 0
        ours = target_logprobs(nnx.merge(graphdef, state), batch, None, scored)
        theirs = None if reference is None else reference_logprobs(reference_state, batch)
        return ours, theirs

    pairs = store.num_docs // 2
    tables = {name: np.zeros((pairs, 2)) for name in ("policy", "reference", "tokens")} if per_example else None
    start, loss, count, reported, batches = time.perf_counter(), 0.0, 0.0, {}, 0
    total, in_order = epoch_in_order(config, store)
    bar = progress_bar(total=total if max_batches is None else min(total, max_batches), unit="batch",
                       desc=f"{objective.name} on {split or store.manifest.get('split') or config.eval.split}",
                       enabled=progress)
    for batch in in_order:
        if max_batches is not None and batches >= max_batches:
            break
        bar.update()
        batch = batch if table is None else with_reference(batch, table)
        if tables is not None:
            ours, theirs = logprobs(state, reference_state, batch)
            add_to_table(tables["policy"], batch, np.asarray(ours, np.float64))
            add_to_table(tables["tokens"], batch, np.ones(batch["weights"].shape))
            if theirs is not None:
                add_to_table(tables["reference"], batch, np.asarray(theirs, np.float64))
        value, denominator, metrics = terms(state, reference_state, batch)
        loss, count, batches = loss + float(value), count + float(denominator), batches + 1
        for name, (s, n) in metrics.items():
            a, b = reported.get(name, (0.0, 0.0))
            reported[name] = (a + float(s), b + float(n))
    bar.close()
    return {
        "split": split or store.manifest.get("split") or config.eval.split,
        "objective": "+".join(tc.objective), "complete": batches >= total, "batches": batches,
        "loss": loss / count if count else None, "weight": count,
        **{name: (s / n if n else None) for name, (s, n) in sorted(reported.items())},
        **({"pairs": int(np.round(reported["rewards/accuracies"][1]))} if "rewards/accuracies" in reported else {}),
        "seconds": round(time.perf_counter() - start, 3),
        **({"per_example": pair_rows(tables, reference is not None, tc.beta)} if tables is not None else {}),
    }


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
