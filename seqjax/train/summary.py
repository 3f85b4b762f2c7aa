"""summary.json: what a run did, its throughput and its final validation; and whether a run already
finished.

A run whose summary says it reached ``train.steps`` and completed its final validation is finished:
running the same command again changes nothing (a scheduler that requeues a finished job lands
there).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax

from seqjax.core.files import json_text, write_text_atomic
from seqjax.eval.windows import resolve_stride
from seqjax.train.metrics import StepLogger, peak_memory_bytes, read_metrics
from seqjax.train.plots import plot_losses, plot_router
from seqjax.weights.saved import Restored

SUMMARY_FILE = "summary.json"


def finished_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The summary of a run that reached ``steps`` and completed its final validation, else None.

    A summary without the final validation (a run killed while validating, or one written before the
    ``finished`` key existed with null losses) does not count: the run is resumed and the validation
    redone.
    """
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != steps:
        return None
    # (none asked for)
    validated = summary.get("val_loss") is not None or summary.get("validation") is False
    return summary if summary.get("finished") and validated else None


def write_summary(run, steps: StepLogger, restored: Restored | None, last_val: dict[str, Any] | None,
                  flops_per_tok: float, peak: float | None, wall_start: float) -> dict[str, Any]:
    """summary.json (written by the primary process, with loss.png) for the run ``run`` (a
    train.setup.Setup)."""
    config, window = run.config, steps.window
    # A run resumed at its last step took no step: its last train row is the checkpoint's.
    last_row = steps.last_row or (restored.meta.get("row") if restored else None) or {}
    val = last_val or {}
    summary = {
        "run_dir": str(run.run_dir),
        "steps": config.train.steps,
        "resumed_from": restored.step if restored else 0,
        "parameters": run.num_params,
        "model_parameters": run.model_params,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "tokens_seen": steps.tokens_seen,
        "tokens_per_s": window.tokens_per_s(),
        "step_time_s": window.median_step_seconds(),
        "mfu": window.mfu(flops_per_tok, jax.device_count(), peak),
        "peak_memory_bytes": peak_memory_bytes(),
        "wall_seconds": time.perf_counter() - wall_start,
        "final_train_loss": last_row.get("loss"),
        # what the objective reports (a preference objective's rewards/*, logps/*, entropy, ...):
        # the last step's
        **({"final_train_metrics": {k: last_row[k] for k in run.objective.reports if k in last_row}}
           if run.objective.reports else {}),
        **{
            key: last_val and val.get(key)
            for key in ("val_loss", "val_perplexity", "val_word_perplexity", "val_bits_per_byte", "val_sources")
        },
        **({"val_metrics": {k: v for k, v in val.items() if k.removeprefix("val_") in run.objective.reports}}
           if last_val and run.objective.reports else {}),
        "unigram_perplexity": run.unigram,
        "eval": dataclasses.asdict(config.eval),
        # What the final validation really used (the keys above may be null: their defaults resolved
        # here).
        "eval_context": config.eval_context,
        "eval_stride": resolve_stride(config.eval.mode, config.eval_context, config.eval.stride),
        # The final validation completed and is recorded above: a re-run of this command changes
        # nothing.
        "finished": (last_val is not None and bool(val.get("val_complete", True))) or (
            # (no validation data: reaching the last step is all)
            run.valid_store is None and last_val is None),
        "validation": run.valid_store is not None,
        "overlong": run.overlong,
        **({"reward": reward} if (reward := rewards_seen(run.run_dir)) else {}),
    }
    if run.primary:
        plot_losses(run.run_dir)
        if config.model.experts.enabled:
            plot_router(run.run_dir, config.model.experts.count, config.model.experts.top_k)
        write_text_atomic(run.run_dir / SUMMARY_FILE, json_text(summary, indent=2))
    return summary


def rewards_seen(run_dir: Path) -> dict[str, Any] | None:
    """An RL run's rewards over its metrics.jsonl (every generation, the resumed ones included):
    the last generation's mean and std, and the best mean with its step; None for a run without
    rewards."""
    rows = [r for r in read_metrics(run_dir) if r.get("reward") is not None and "event" not in r]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["reward"])
    return {"last": rows[-1]["reward"], "last_std": rows[-1].get("reward_std"), "last_step": rows[-1]["step"],
            "best": best["reward"], "best_step": best["step"], "generations": len(rows)}
