"""Evaluation by the run's objective over a split's batches as training builds them: preference
pairs (``data.format=preference``), with TRL's metrics, and chats with images
(``data.image_processor``), whose batches only the training pipeline builds.

Every pair (example) of the split is scored once, in order (packed as training packs them,
unshuffled): the objective's loss (a mean over pairs; ``sft``: over chosen tokens; ``lm``: the
mean nll per scored token) and, on pairs, averaged over them, ``rewards/accuracies`` (the
fraction whose chosen reward is above the rejected one), ``rewards/margins``,
``rewards/chosen``, ``rewards/rejected``, ``logps/chosen`` and ``logps/rejected``, as TRL's
evaluation reports them. The reference model is the training run's
(:func:`seqjax.train.inference.reference_for`).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from seqjax.config.tree import Config
from seqjax.data.epochs import epoch_in_order
from seqjax.data.pairs import with_reference
from seqjax.objectives import Inputs, resolve
from seqjax.objectives.base import target_logprobs
from seqjax.store.reader import TokenStore


def evaluate_objective(model: nnx.Module, reference: nnx.Module | np.ndarray | None, store: TokenStore,
                       config: Config, *, max_batches: int | None = None,
                       split: str | None = None) -> dict[str, Any]:
    """The objective ``train.objective`` (and, on pairs, TRL's metrics) over the batches of ``store``
    (the first ``max_batches`` batches only, when given: ``complete`` is then false).
    ``reference``: the reference model, or its precomputed table of the split
    (``train.reference=precompute``), or None for an objective without one."""
    tc = config.train
    objective = resolve(tc.objective, tc.objective_weights)
    settings = {key: getattr(tc, key) for key in objective.settings}
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

    start, loss, count, reported, batches = time.perf_counter(), 0.0, 0.0, {}, 0
    total, in_order = epoch_in_order(config, store)
    for batch in in_order:
        if max_batches is not None and batches >= max_batches:
            break
        batch = batch if table is None else with_reference(batch, table)
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
        **({"pairs": int(np.round(reported["rewards/accuracies"][1]))} if "rewards/accuracies" in reported else {}),
        "seconds": round(time.perf_counter() - start, 3),
    }
