"""The PNGs a run's folder gets at its end, drawn from its metrics.jsonl: loss.png (training and
validation loss; an RL run's reward too) and, for a model with experts, router.png (each layer's
busiest expert's share of its routes, between the even share and every token's)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from seqjax.train.metrics import read_metrics

PLOT_FILE = "loss.png"
ROUTER_PLOT_FILE = "router.png"
_SHARE = re.compile(r"^router/max_share/(\d+)$")


def _figure(**kwargs):
    """A matplotlib Figure of its own: no pyplot, so no global figure manager or backend to set or close (a PNG
    is all a run writes). (Not a speed-up: 0.01-0.02 s a run, measured idle; BENCHMARKS.md, the suite.)"""
    # matplotlib takes half a second to import and is needed once, at the end of a run
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def plot_losses(run_dir: str | Path) -> Path:
    """loss.png: training loss per step and validation loss at each evaluation; an RL run's (rows
    with a ``reward``) also its reward per generation, the std around it, in a second panel."""
    rows = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in rows
             if "loss" in r and r["loss"] is not None and math.isfinite(r["loss"])]
    valid = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    rewards = [(r["step"], r["reward"], r.get("reward_std") or 0.0) for r in rows
               if r.get("reward") is not None and "event" not in r]
    fig = _figure(figsize=(7, 6 if rewards else 4))
    axes = fig.subplots(2 if rewards else 1, 1, sharex=True, squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss")
    # (an RL loss is a surrogate's, not a cross-entropy)
    ax.set_ylabel("loss" if rewards else "loss (nats per token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if rewards:
        steps, mean, std = (np.asarray(v, np.float64) for v in zip(*rewards))
        ax = axes[1, 0]
        ax.plot(steps, mean, label="reward (mean over the generation)", linewidth=1, color="tab:green")
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, color="tab:green", label="± its "
                                                                                           "std")
        ax.set_ylabel("reward")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = Path(run_dir) / PLOT_FILE
    fig.savefig(path, dpi=100)
    return path


def plot_router(run_dir: str | Path, experts: int, top_k: int) -> Path | None:
    """router.png: each expert layer's ``router/max_share/<layer>`` per step (the share of its
    routes its busiest expert took: 1 / ``experts`` is a perfectly even router, 1 / ``top_k``,
    every token routed to it, a collapsed one), or None when the metrics hold none (a dense
    model)."""
    rows = [r for r in read_metrics(run_dir) if "event" not in r]
    layers = sorted({int(m.group(1)) for r in rows for key in r if (m := _SHARE.match(key))})
    if not layers:
        return None
    fig = _figure(figsize=(7, 4))
    ax = fig.subplots()
    for layer in layers:
        key = f"router/max_share/{layer}"
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot(*zip(*points), label=f"layer {layer}", linewidth=1)
    ax.axhline(1.0 / experts, color="grey", linestyle="--", linewidth=1, label="even (1 / experts)")
    ax.axhline(1.0 / top_k, color="black", linestyle=":", linewidth=1, label="every token (1 / "
                                                                             "top_k)")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's share of routes")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path = Path(run_dir) / ROUTER_PLOT_FILE
    fig.savefig(path, dpi=100)
    return path
