"""What one epoch of the configured strategy gives: rows, padding, coverage, segments, and how fast
its batches build.

``python -m seqjax.data`` prints :func:`epoch_stats`; BENCHMARKS.md's sequence
tables come from it (scripts/bench_data.py).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from seqjax.config.tree import Config
from seqjax.data import pairs, strategies
from seqjax.data.document_rows import dropped_as_overlong, overlong_report
from seqjax.data.epochs import EpochsIterDataset
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner, RowPlan, coverage, per_document
from seqjax.data.ragged import ragged_arange
from seqjax.data.scored import scored_in
from seqjax.store.reader import TokenStore


def _filled(d, real: int, slots: int) -> dict[str, Any]:
    """The fields every report starts with: the strategy, the row length, real tokens and the
    padding they leave."""
    return {"strategy": strategies.label(d), "seq_len": d.seq_len, "real_tokens": real,
            "padding_fraction": 1.0 - real / slots if slots else 0.0}


def epoch_stats(config: Config, store: TokenStore, epoch: int = 0) -> dict[str, Any]:
    """What one epoch gives: rows, padding, coverage, segments, and how fast its batches are built
    (tokens/s)."""
    strategies.check(config, store)
    d = config.data
    t0 = time.perf_counter()
    if strategies.uses_grain_packer(d):
        batches = list(strategies.grain_packed(config, store, num_epochs=1))
        seconds = time.perf_counter() - t0
        segs = np.concatenate([b["segment_ids"].max(axis=1) for b in batches])
        real = int(sum((b["segment_ids"] > 0).sum() for b in batches))
        # the empty rows that complete the last batch are not padding
        slots = int(segs.astype(bool).sum()) * d.seq_len
        segs = segs[segs > 0]
        dropped = store.predicted_tokens - real
        # Grain's packers see documents after the overlong policy (document_rows.document_items)
        counts = {
            "documents_dropped": int(
                dropped_as_overlong(store.doc_predictions, d.seq_len, d.resolved_overlong).sum()),
            "documents_truncated": None, "documents_split": None
        }
        rows, n_batches = len(segs), len(batches)
    else:
        planner = EpochPlanner(config, store)
        plan = planner.plan(epoch)
        batches = iter(EpochsIterDataset(planner))
        batches.set_state({"epoch": epoch, "batch": 0})
        # the training path: sequential reads, one build per group
        for _ in range(plan.num_batches):
            next(batches)
        seconds = time.perf_counter() - t0
        segs = plan.segments_per_row
        row_width = np.repeat(plan.widths, d.batch_size)[: plan.num_rows]
        # the empty rows that complete the last batch are not padding of a row
        slots = int(row_width[segs > 0].sum())
        segs = segs[segs > 0]
        real = int((plan.lengths - 1).sum())
        counts, dropped = document_coverage(plan, store)
        rows, n_batches = int(len(segs)), plan.num_batches
        if planner.image_spec is not None:  # the second budget: each row's patches
            counts.update(patch_use(planner, plan, rows))
    return {
        **_filled(d, real, slots),
        **example_counts(config, store, batches if strategies.uses_grain_packer(d) else plan),
        "rows": rows,
        "tokens_dropped": int(dropped),
        **counts,
        "overlong": overlong_counts(config, store),
        "segments_per_row_mean": float(segs.mean()) if len(segs) else 0.0,
        "segments_per_row_max": int(segs.max()) if len(segs) else 0,
        "batches_per_epoch": n_batches,
        "tokens_per_s": real / seconds if seconds > 0 else float("inf"),
    }


def example_counts(config: Config, store: TokenStore, plan_or_batches: Any) -> dict[str, Any]:
    """Instruction data: the scored fraction of the epoch's targets, and the examples dropped on the
    way.

    ``examples_dropped_unscored``: dropped by prepare, nothing in them scored;
    ``scored_fraction``: scored targets over real (non-padding) targets.
    """
    if store.mask is None:
        return {}
    if isinstance(plan_or_batches, RowPlan):
        plan = plan_or_batches
        owner, j = ragged_arange(plan.lengths - 1)
        positions = plan.starts[owner] + 1 + j
        scored = int(np.count_nonzero(store.mask[positions])) if len(positions) else 0
        real = len(positions)
    else:
        scored = int(sum((b["weights"] > 0).sum() for b in plan_or_batches))
        real = int(sum((b["segment_ids"] > 0).sum() for b in plan_or_batches))
    stats = store.manifest.get("stats", {})
    return {
        "examples": store.num_docs, "scored_fraction": scored / real if real else 0.0,
        "scored_targets": scored, "examples_dropped_unscored": int(stats.get("dropped_unscored",
                                                                             0)),
        "loss_on": config.data.loss_on
    }


def mixture_stats(config: Config, store: TokenStore, steps: int) -> dict[str, Any]:
    """What ``steps`` batches of a mixture draw from each source: rows and real tokens, against the
    weights."""
    d = config.data
    iterator = iter(build_pipeline(config, store))
    schedule = iterator.schedule
    names = [name for name, *_ in store.sources]
    rows, tokens = np.zeros(len(names), np.int64), np.zeros(len(names), np.int64)
    real = slots = 0
    t0 = time.perf_counter()
    for step in range(steps):
        batch = next(iterator)
        per_row = batch["weights"].sum(axis=1).astype(np.int64)
        sources = schedule.sources(step)
        rows += np.bincount(sources, minlength=len(names))
        tokens += np.bincount(sources, weights=per_row, minlength=len(names)).astype(np.int64)
        real += int(per_row.sum())
        slots += batch["weights"].size
    seconds = time.perf_counter() - t0
    total_weight = sum(w for _, w, *_ in store.sources)
    return {
        **_filled(d, real, slots),
        "steps": steps,
        "tokens_per_s": real / seconds if seconds > 0 else float("inf"),
        "sources": {
            name: {
                "weight": round(w / total_weight, 6),
                "rows": int(rows[i]),
                "row_fraction": round(float(rows[i] / rows.sum()), 6),
                "tokens": int(tokens[i]),
                "token_fraction": round(float(tokens[i] / max(1, tokens.sum())), 6),
            }
            for i, (name, w, *_) in enumerate(store.sources)
        },
    }


def patch_use(planner: EpochPlanner, plan: RowPlan, rows: int) -> dict[str, Any]:
    """Chats with images: the patches an epoch's rows hold against their budget (data.patches_per_row each)."""
    real = int(planner.patch_counts[planner.store.documents_at(plan.starts)].sum())
    slots = rows * planner.data.patches_per_row
    return {"patches_per_row": planner.data.patches_per_row, "real_patches": real,
            "patch_padding_fraction": 1.0 - real / slots if slots else 0.0}


def document_coverage(plan: RowPlan, store: TokenStore) -> tuple[dict[str, int], int]:
    """Documents never predicted (dropped), cut across rows or left partly unpredicted, and the
    stream tokens never predicted this epoch."""
    starts, lengths = store.doc_spans()
    owner, j = ragged_arange(lengths - 1)
    # the stream positions some document's sequence predicts
    targets = np.zeros(store.num_tokens, bool)
    targets[starts[owner] + j + 1] = True
    covered = (coverage(plan, store.num_tokens) > 0)[targets]
    doc_of = np.searchsorted(store.doc_offsets, np.flatnonzero(targets), "right") - 1
    predicted = np.bincount(doc_of, weights=covered, minlength=store.num_docs)
    dropped = int(np.sum(predicted == 0))
    truncated = int(np.sum((predicted > 0) & (predicted < store.doc_predictions)))
    pieces = per_document(plan, store)
    piece_doc = np.searchsorted(store.doc_offsets, pieces.starts + 1, "right") - 1
    piece_row = np.repeat(np.arange(pieces.num_rows), pieces.segments_per_row)
    pairs = np.unique(np.stack([piece_doc, piece_row]), axis=1)
    split = int(np.sum(np.bincount(pairs[0], minlength=store.num_docs) > 1))
    return {"documents_dropped": dropped, "documents_truncated": truncated, "documents_split": split}, \
        int((~covered).sum())


def overlong_counts(config: Config, store: TokenStore) -> dict[str, Any] | None:
    """What ``data.overlong`` does to this store's documents longer than a row (None where no
    strategy applies it): how many, and how many are dropped, truncated or split; for instruction
    data, how many cut examples kept no answer and are left out. The train log says it at the start
    of a run; the data report includes it."""
    d = config.data
    if not strategies.STRATEGIES[d.strategy].documents:
        return None
    if d.format == "preference":
        return pairs.overlong_pairs(store, d.seq_len, d.resolved_overlong)
    report = overlong_report(store.doc_predictions, d.seq_len, d.resolved_overlong, store.doc_spans(),
                             scored_in(store))
    report["documents"] = store.num_docs
    return report


def overlong_line(report: dict[str, Any], what: str) -> str | None:
    """The train log's line for an :func:`overlong_counts` report, or None when nothing is longer
    than a row."""
    n = report["longer_than_a_row"]
    if not n:
        return None
    policy = report["policy"]
    if "pairs" in report:  # preference pairs: each sequence against half a row
        return (
            f"data.overlong={policy}: {n} of {report['pairs']} pairs have a sequence longer than data.seq_len / 2 "
            f"= {report['limit']}: {report['dropped']} dropped ({report['prompt_too_long']} whose prompt alone "
            f"reaches it), {report['truncated']} cut to it")
    split = f"split into {report.get('pieces')} pieces, each its own segment"
    if what == "examples":
        split += " (a piece after the first lacks the example's start: its answers lose their prompt)"
    done = {"drop": "dropped", "truncate": "truncated: their ends are not trained", "split": split,
            "error": "refused"}[policy]
    line = (f"data.overlong={policy}: {n} of {report['documents']} {what} are longer than a row of "
            f"data.seq_len={report['seq_len']}: {done}")
    if report.get("left_out_without_answer"):
        line += f"; {report['left_out_without_answer']} cut ones kept no scored token and are left out"
    return line
