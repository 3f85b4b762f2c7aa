"""Evaluation on preference pairs (``data.format=preference``): the run's objective over a split,
and TRL's metrics.

Every pair of the split is scored once, in order (the pairs packed as training packs them,
unshuffled): the objective's loss (a mean over pairs; ``sft``: over chosen tokens) and, averaged
over pairs, ``rewards/accuracies`` (the fraction whose chosen reward is above the rejected one),
``rewards/margins``, ``rewards/chosen``, ``rewards/rejected``, ``logps/chosen`` and
``logps/rejected``, as TRL's evaluation reports them. The reference model is the training run's
(:func:`seqjax.train.inference.reference_for`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from seqjax.config.tree import Config
from seqjax.data.epochs import window_dataset
from seqjax.data.pairs import with_reference
from seqjax.data.plan import EpochPlanner
from seqjax.objectives import Inputs, resolve
from seqjax.objectives.base import target_logprobs
from seqjax.store.reader import TokenStore


def evaluate_pairs(model: nnx.Module, reference: nnx.Module | np.ndarray, store: TokenStore, config: Config, *,
                   max_batches: int | None = None, split: str | None = None) -> dict[str, Any]:
    """The objective ``train.objective`` and TRL's metrics over the pairs of ``store`` (the first
    ``max_batches`` batches only, when given: ``complete`` is then false). ``reference``: the
    reference model, or its precomputed table of the split (``train.reference=precompute``)."""
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, shuffle=False))
    planner = EpochPlanner(config, store)
    tc = config.train
    objective = resolve(tc.objective, tc.objective_weights)
    settings = {key: getattr(tc, key) for key in objective.settings}
    graphdef, state = nnx.split(model)
    table = reference if isinstance(reference, np.ndarray) else None
    reference_graphdef, reference_state = nnx.split(model if table is not None else reference)

    @jax.jit
    def terms(state, reference_state, batch):
        policy, ref = nnx.merge(graphdef, state), nnx.merge(reference_graphdef, reference_state)
        inputs = Inputs(policy, None, settings, objective.totals(batch),
                        (lambda micro: micro["reference_logps"]) if table is not None else
                        (lambda micro: target_logprobs(ref, micro, None, micro["weights"] > 0)))
        out = objective.loss(inputs, batch)
        return out.loss, out.denominator, out.reported

    start, loss, count, reported, batches = time.perf_counter(), 0.0, 0.0, {}, 0
    total = sum(planner.window_batches(0, w) for w in range(len(planner.windows(0))))
    for position in range(len(planner.windows(0))):
        batches_here = window_dataset(planner, 0, position, 0, 1)
        for k in range(len(batches_here)):
            if max_batches is not None and batches >= max_batches:
                break
            batch = batches_here[k] if table is None else with_reference(batches_here[k], table)
            value, denominator, metrics = terms(state, reference_state, batch)
            loss, count, batches = loss + float(value), count + float(denominator), batches + 1
            for name, (s, n) in metrics.items():
                a, b = reported.get(name, (0.0, 0.0))
                reported[name] = (a + float(s), b + float(n))
    return {
        "split": split or store.manifest.get("split") or config.eval.split,
        "objective": "+".join(tc.objective), "complete": batches >= total, "batches": batches,
        "loss": loss / count if count else None, "weight": count,
        **{name: (s / n if n else None) for name, (s, n) in sorted(reported.items())},
        "pairs": int(np.round(reported.get("rewards/accuracies", (0, 0))[1])),
        "seconds": round(time.perf_counter() - start, 3),
    }
