"""Which way of cutting the text trains the best model? Every strategy, the same model, optimizer and token budget.

    python scripts/study_strategies.py --out runs/study                    # CPU scale: wikitext2_cpu, 3 seeds
    python scripts/study_strategies.py --gpu --out runs/study_gpu          # GPU scale: wikitext2_gpu, 3 seeds
    python scripts/study_strategies.py --quick --out /tmp/study_quick      # every strategy at toy size (CI)
    python scripts/study_strategies.py --report runs/study/results.json    # the tables and the plot, from the JSON

**Held fixed.** The model, AdamW and the shape of its schedule (warmup the same
fraction of each run, cosine to the same floor), rows per batch, the seeds, and
the budget of *target tokens*: tokens with a non-zero loss weight. Only the
strategy changes (``STRATEGIES``). ``key=value`` overrides apply to every run;
``train.steps``, ``warmup_steps``, ``eval_every`` and ``checkpoint_every`` are
set per run from the budget. The GPU scale adds ``model.dropout=0.1``: its
budget is several epochs.

**The budget.** For each strategy and seed, the number of steps is the first
at which that strategy's own batches reach ``--target-tokens``. They are read
from the pipeline training reads, which is a pure function of (config, seed,
step) (docs/design.md, contract 4). So a strategy that pads runs more steps,
and spends more compute, for the same target tokens; the table says how much.
A strategy whose windows overlap (``window`` at stride seq_len/2) sees each
token about twice for the same budget.

**Evaluation.** Every model is scored under the same protocols: valid and
test, ``sliding`` and ``documents``, in token perplexity, word perplexity and
bits per byte, with documents kept apart (``data.cross_document_attention=false``
at evaluation, whatever the model trained with). ``--eval-docs N`` scores N
evenly spaced articles of each split, with their own word and byte counts,
so that 24 models fit the CPU scale's time; 0 scores the whole splits (the
GPU scale's default). Periodic validation during training (``points`` per
run, the valid articles under ``documents``, through ``train(validate=...)``)
draws the plot: validation word perplexity against target tokens. The last
one also scores the final model under every protocol.

**Spread.** Each strategy runs once per seed; the tables give mean ± standard
deviation, and a difference counts as larger than the spread only when the
two strategies' ranges over the seeds (min to max) do not overlap.

Outputs under ``--out``: ``study.json`` (the settings; rerunning with other
settings is refused), ``runs/<strategy>/seed<k>/`` (an ordinary training run
folder each, plus ``run.json`` once the model is scored), ``results.json``,
``results.md`` and ``valid_word_perplexity.png``. Rerunning the same command
reuses every scored run and resumes an interrupted one from its checkpoint.
Models train in this process, one after another, with JAX's persistent
compilation cache (``<data.cache_dir>/jax``), so runs of the same shape
compile once. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from seqjax.config.load import load_config
from seqjax.config.tree import Config
from seqjax.core.errors import UsageError
from seqjax.core.files import write_text_atomic
from seqjax.data.pipeline import build_pipeline
from seqjax.eval.evaluate import evaluate
from seqjax.main import cli
from seqjax.store.build import prepare
from seqjax.store.corpus import count_words
from seqjax.store.reader import TokenStore
from seqjax.store.tokenizer import Tokenizer
from seqjax.train.flops import flops_per_token
from seqjax.train.loop import train
from seqjax.train.metrics import read_metrics
from seqjax.weights.inference import load_for_inference

log = logging.getLogger("seqjax.study")

# name -> (overrides, what it is). "{half}" is data.seq_len // 2.
STRATEGIES: dict[str, tuple[tuple[str, ...], str]] = {
    "concat_chunk-cross": (("data.strategy=concat_chunk", "data.cross_document_attention=true"),
                           "HF run_clm / fairseq: concatenate and chunk, attention across documents"),
    "concat_chunk": (("data.strategy=concat_chunk", "data.cross_document_attention=false"),
                     "the same rows, each document its own segment"),
    "pack-best_fit": (("data.strategy=pack", "data.packer=best_fit"), "whole documents packed best-fit, padded"),
    "pack-fill": (("data.strategy=pack", "data.packer=fill"), "documents packed, split to fill every row"),
    "random_offset": (("data.strategy=random_offset",), "non-overlapping chunks after a fresh offset each epoch"),
    "window-half": (("data.strategy=window", "data.stride={half}"), "windows at stride seq_len/2 (overlapping)"),
    "block-complete_doc": (("data.strategy=block", "data.break_mode=complete_doc"),
                           "fairseq complete_doc: whole lines, never across a document"),
    "length_grouped": (("data.strategy=length_grouped",), "one document per row, length-grouped, bucket padding"),
    "sequential": (("data.strategy=sequential",), "contiguous streams, row b continuing row b"),
    "random_window": (("data.strategy=random_window",), "CS336: window starts drawn with replacement"),
    "pack-greedy": (("data.strategy=pack", "data.packer=greedy"), "next-fit packing"),
}
DEFAULT_STRATEGIES = tuple(list(STRATEGIES)[:8])


@dataclasses.dataclass(frozen=True)
class Scale:
    config: str
    seeds: int
    target_tokens: int
    eval_docs: int  # 0: whole splits
    points: int  # periodic validations per run
    overrides: tuple[str, ...] = ()


# The CPU scale: 8 strategies x 3 seeds on 2 cores, aiming at ~30 minutes. Per run, 300k target tokens (~147 steps
# of 16 x 128, 0.1 epoch: a short-budget comparison) and 8 of the 60 articles of each split. At the 5,107 tokens/s
# BENCHMARKS.md measured for wikitext2_cpu, training alone is ~59 s a run, ~24 min for 24; evaluation and
# compilation come on top. The whole study's time is not measured yet.
SCALES = {
    "cpu": Scale("configs/wikitext2_cpu.yaml", seeds=3, target_tokens=300_000, eval_docs=8, points=4),
    # wikitext2_gpu for 16M target tokens (~500 steps of 64 x 512, ~6 epochs): dropout 0.1 against overfitting.
    "gpu": Scale("configs/wikitext2_gpu.yaml", seeds=3, target_tokens=16_000_000, eval_docs=0, points=8,
                 overrides=("model.dropout=0.1",)),
    "quick": Scale("configs/wikitext2_cpu.yaml", seeds=2, target_tokens=1024, eval_docs=3, points=2,
                   overrides=("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
                              "data.seq_len=32", "data.batch_size=8", "eval.batch_size=16")),
}
SPLITS = ("valid", "test")
MODES = ("sliding", "documents")
PERIODIC = ("valid", "documents")  # the protocol of the validations during training (the plot)
UNITS = (("token_perplexity", "token ppl", 2), ("word_perplexity", "word ppl", 1), ("bits_per_byte", "bits/byte", 4))
# Settings that change what a run computes: a rerun into the same --out must agree on them.
SETTINGS_KEYS = ("config", "overrides", "target_tokens", "eval_docs", "points")


# ---------------------------------------------------------------------------
# Evaluation on a fixed subset of articles


@dataclasses.dataclass
class Subset:
    """Some articles of a split as a store of their own, with the words and bytes of exactly their text."""

    store: TokenStore
    words: int
    bytes: int
    docs: list[int]


def article_subset(store: TokenStore, tokenizer: Tokenizer, n: int) -> Subset:
    """``n`` evenly spaced articles of ``store`` (all of them when ``n`` is 0 or too large).

    For example, n=8 of WikiText-2's 60 valid articles takes articles 0, 8, 17,
    25, 34, 42, 51, 59. Their words and bytes come from decoding their tokens
    (an exact round trip), counted as prepare counts a whole split, so word
    perplexity and bits per byte mean the same on the subset.
    """
    count = store.num_docs if n <= 0 or n >= store.num_docs else n
    docs = sorted(set(np.linspace(0, store.num_docs - 1, count).round().astype(int).tolist()))
    texts, lines = [], []
    for i in docs:
        start, end = int(store.doc_offsets[i]), int(store.doc_offsets[i + 1])
        texts.append(np.asarray(store.tokens[start : end - 1]))  # without the closing EOT
        cuts = store.line_offsets[(store.line_offsets >= start) & (store.line_offsets <= end)]
        lengths = np.diff(cuts)
        lengths[-1] -= 1  # the closing EOT belongs to the last line
        lines.append(lengths.tolist())
    subset = TokenStore.from_documents(texts, store.eot_id, store.vocab_size, lines)
    decoded = [tokenizer.decode(t) for t in texts]
    return Subset(subset, sum(count_words(t) for t in decoded), sum(len(t.encode("utf-8")) for t in decoded), docs)


def score(model, subset: Subset, config: Config, split: str, mode: str) -> dict[str, Any]:
    """One protocol on one split's articles, documents kept apart, as evaluate() reports it."""
    cfg = dataclasses.replace(config, eval=dataclasses.replace(config.eval, split=split, mode=mode),
                              data=dataclasses.replace(config.data, cross_document_attention=False))
    result = evaluate(model, subset.store, cfg, split=split, word_count=subset.words, byte_count=subset.bytes,
                      progress=False)
    keep = ("tokens", "words", "bytes", "nll_sum", "token_perplexity", "word_perplexity", "bits_per_byte", "context",
            "stride")
    return {k: result[k] for k in keep}


# ---------------------------------------------------------------------------
# One run


@dataclasses.dataclass
class Budget:
    """What reaching the target-token budget costs one strategy and seed, read from its own batches."""

    steps: int
    cumulative: list[int]  # target tokens after each step
    tokens: int  # non-padding input tokens
    slots: dict[int, int]  # row width -> token slots (rows x width), padding included

    @property
    def target_tokens(self) -> int:
        return self.cumulative[-1]


def budget(config: Config, store: TokenStore, target_tokens: int) -> Budget:
    """Steps until the batches training will read hold ``target_tokens`` tokens of non-zero weight.

    For example, pack-best_fit at 16 x 128 with a 300,000 budget: each batch
    holds about 2,040 target tokens, so about 147 steps.
    """
    batches = iter(build_pipeline(config, store))
    cumulative, tokens, slots = [], 0, {}
    while not cumulative or cumulative[-1] < target_tokens:
        batch = next(batches)
        cumulative.append((cumulative[-1] if cumulative else 0) + int(np.count_nonzero(batch["weights"])))
        tokens += int(np.count_nonzero(batch["segment_ids"]))
        rows, width = batch["inputs"].shape
        slots[width] = slots.get(width, 0) + rows * width
    return Budget(len(cumulative), cumulative, tokens, slots)


def strategy_overrides(name: str, seq_len: int) -> list[str]:
    return [o.format(half=seq_len // 2) for o in STRATEGIES[name][0]]


def run_one(settings: dict, name: str, seed: int, run_dir: Path, prepared, subsets: dict[str, Subset]) -> dict:
    """Train one strategy with one seed to the budget, score it, and write run.json; its result."""
    base = load_config(settings["config"], settings["overrides"])
    overrides = [*settings["overrides"], *strategy_overrides(name, base.data.seq_len),
                 f"run.seed={seed}", f"run.dir={run_dir}", "eval.split=valid"]
    config = load_config(settings["config"], overrides)
    plan = budget(config, prepared.stores["train"], settings["target_tokens"])
    warmup = round(plan.steps * base.train.warmup_steps / base.train.steps)  # the base config's fraction
    every = max(1, math.ceil(plan.steps / settings["points"]))
    config = load_config(settings["config"], [
        *overrides, f"train.steps={plan.steps}", f"train.warmup_steps={warmup}", f"train.eval_every={every}",
        f"train.checkpoint_every={plan.steps}", "train.keep_checkpoints=1"])

    seconds = {"validation": 0.0, "final": 0.0}
    final: dict[str, dict] = {}

    def score_all(model, periodic: dict | None = None) -> None:
        """Every protocol on both splits (the periodic one reused when given) into ``final``."""
        start = time.perf_counter()
        for split in SPLITS:
            for mode in MODES:
                reuse = periodic is not None and (split, mode) == PERIODIC
                final[f"{split}/{mode}"] = periodic if reuse else score(model, subsets[split], config, split, mode)
        seconds["final"] += time.perf_counter() - start

    def validate(model, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        r = score(model, subsets[PERIODIC[0]], config, *PERIODIC)
        seconds["validation"] += time.perf_counter() - start
        if step == config.train.steps:  # the final model, still in memory: score it under every protocol now
            score_all(model, periodic=r)
        return {"val_loss": r["nll_sum"] / r["tokens"], "val_perplexity": r["token_perplexity"],
                "val_word_perplexity": r["word_perplexity"], "val_bits_per_byte": r["bits_per_byte"],
                "val_target_tokens": plan.cumulative[step - 1]}

    # (train() writes nothing to stdout; the redirect keeps the study's stdout its results alone, whatever a
    # library below prints)
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(config, validate=validate)
    if not final:  # a rerun after the last step was trained but not scored: the final checkpoint is the model
        score_all(load_for_inference(run_dir)[1])
    curve = [{"step": r["step"], "target_tokens": r["val_target_tokens"], "word_perplexity": r["val_word_perplexity"],
              "token_perplexity": r["val_perplexity"], "bits_per_byte": r["val_bits_per_byte"]}
             for r in read_metrics(run_dir) if "val_target_tokens" in r]
    params, vocab = summary["parameters"], config.model.vocab_size or prepared.tokenizer.vocab_size
    flops = sum(n * flops_per_token(config.model, width, params, vocab) for width, n in plan.slots.items())
    slots = sum(plan.slots.values())
    result = {
        "strategy": name,
        "seed": seed,
        "overrides": strategy_overrides(name, base.data.seq_len),
        "steps": plan.steps,
        "warmup_steps": warmup,
        "target_tokens": plan.target_tokens,
        "tokens": plan.tokens,
        "slots": slots,
        "padding_fraction": 1.0 - plan.tokens / slots,
        "train_flops": flops,
        "parameters": params,
        "wall_seconds": summary["wall_seconds"] - seconds["validation"] - seconds["final"],
        "step_seconds": summary["step_time_s"],
        "validation_seconds": seconds["validation"],
        "final_eval_seconds": seconds["final"],
        "resumed_from": summary["resumed_from"],
        "final_train_loss": summary["final_train_loss"],
        "curve": curve,
        "final": final,
    }
    write_text_atomic(run_dir / "run.json", json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------
# The study


def settings_for(args: argparse.Namespace) -> dict[str, Any]:
    """The study's settings: the scale's, with the flags and key=value overrides on top."""
    scale_name = "gpu" if args.gpu else "quick" if args.quick else "cpu"
    scale = SCALES[scale_name]
    strategies = args.strategies.split(",") if args.strategies else list(DEFAULT_STRATEGIES)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UsageError(f"--strategies: got {unknown[0]!r}, expected some of {', '.join(STRATEGIES)}")
    for flag in ("seeds", "target_tokens", "points"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: got {value}, expected at least 1")
    if args.eval_docs is not None and args.eval_docs < 0:
        raise UsageError(f"--eval-docs: got {args.eval_docs}, expected 0 (whole splits) or a number of articles")
    return {
        "scale": scale_name,
        "config": args.config or scale.config,
        "overrides": [*scale.overrides, *args.overrides],
        "seeds": args.seeds or scale.seeds,
        "target_tokens": args.target_tokens or scale.target_tokens,
        "eval_docs": scale.eval_docs if args.eval_docs is None else args.eval_docs,
        "points": args.points or scale.points,
        "strategies": strategies,
    }


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse an --out whose runs were made with other settings (their results would not compare); record ours."""
    path = out / "study.json"
    if path.is_file():
        old = json.loads(path.read_text())
        for key in SETTINGS_KEYS:
            if old.get(key) != settings[key]:
                raise UsageError(f"--out {out}: its runs were made with {key}={old.get(key)!r}, not "
                                 f"{settings[key]!r}; keep the settings to continue it, or pick another --out")
    write_text_atomic(path, json.dumps(settings, indent=1))


def use_compile_cache(path: Path) -> None:
    """JAX's persistent compilation cache, so the study's runs of one shape compile once (unless the user chose one)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    jax.config.update("jax_compilation_cache_dir", str(path.absolute()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def machine() -> str:
    device = jax.devices()[0]
    return (f"{platform.machine()} {os.cpu_count()} CPU cores, {jax.device_count()} x {device.device_kind}, "
            f"jax {jax.__version__}")


def run_study(args: argparse.Namespace) -> None:
    if not args.out:
        raise UsageError("--out: expected the folder the study writes (or --report RESULTS.json)")
    settings = settings_for(args)
    out = Path(args.out)
    config = load_config(settings["config"], settings["overrides"])  # a bad key or value stops here, before any work
    check_settings(out, settings)
    use_compile_cache(Path(config.data.cache_dir).expanduser() / "jax")
    prepared = prepare(config, splits=("train", *SPLITS))
    subsets = {split: article_subset(prepared.stores[split], prepared.tokenizer, settings["eval_docs"])
               for split in SPLITS}
    for split, subset in subsets.items():
        log.info("%s: scoring %d of %d articles (%s tokens, %s words)", split, len(subset.docs),
                 prepared.stores[split].num_docs, f"{subset.store.predicted_tokens:,}", f"{subset.words:,}")

    jobs = [(name, seed) for seed in range(settings["seeds"]) for name in settings["strategies"]]
    trained_seconds, trained = 0.0, 0
    for index, (name, seed) in enumerate(jobs, start=1):
        run_dir = out / "runs" / name / f"seed{seed}"
        if (run_dir / "run.json").is_file():
            log.info("run %d/%d %s seed %d: scored before, reused", index, len(jobs), name, seed)
            continue
        start = time.perf_counter()
        result = run_one(settings, name, seed, run_dir, prepared, subsets)
        trained_seconds += time.perf_counter() - start
        trained += 1
        log.info("run %d/%d %s seed %d: %d steps, test word ppl %.1f (sliding), %.0f s; about %.0f s left",
                 index, len(jobs), name, seed, result["steps"], result["final"]["test/sliding"]["word_perplexity"],
                 time.perf_counter() - start, trained_seconds / trained * (len(jobs) - index))

    # Every run scored in --out, this invocation's and earlier ones' (study.json guarantees their settings agree).
    runs = [json.loads(path.read_text()) for path in sorted((out / "runs").glob("*/seed*/run.json"))]
    names = [name for name in STRATEGIES if any(r["strategy"] == name for r in runs)]
    runs.sort(key=lambda r: (names.index(r["strategy"]), r["seed"]))
    document = {
        "settings": {**settings, "strategies": names, "seeds": max(r["seed"] for r in runs) + 1},
        "command": " ".join(["python", "scripts/study_strategies.py", *sys.argv[1:]]),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "strategies": {name: STRATEGIES[name][1] for name in names},
        "eval_articles": {split: {"articles": s.docs, "of": prepared.stores[split].num_docs, "words": s.words,
                                  "tokens": s.store.predicted_tokens} for split, s in subsets.items()},
        "runs": runs,
    }
    results = write_text_atomic(out / "results.json", json.dumps(document, indent=1))
    markdown = report(document)
    write_text_atomic(out / "results.md", markdown + "\n")
    figure = plot(document, out / "valid_word_perplexity.png")
    print(markdown)
    print(json.dumps({"results": str(results), "markdown": str(out / "results.md"), "plot": str(figure),
                      "runs": len(runs), "trained": trained}))


def show_report(args: argparse.Namespace) -> None:
    path = Path(args.report)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--report {path}: cannot read it as JSON ({type(err).__name__}: {err})") from None
    if not isinstance(document, dict) or "settings" not in document or not document.get("runs"):
        raise UsageError(f"--report {path}: expected the results.json a study wrote, with its settings and runs")
    figure = plot(document, Path(args.plot) if args.plot else path.with_name("valid_word_perplexity.png"))
    print(report(document))
    print(json.dumps({"results": str(path), "plot": str(figure), "runs": len(document["runs"])}))


# ---------------------------------------------------------------------------
# Tables and the plot, from results.json alone


def spread(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, np.float64)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max()), "n": len(a)}


COSTS = ("steps", "target_tokens", "padding_fraction", "slots", "train_flops", "wall_seconds", "step_seconds")


def aggregate(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """strategy -> figure -> mean, sd, min, max, n over its seeds; figures are COSTS and 'split/mode/unit'."""
    by_strategy: dict[str, list[dict]] = {}
    for run in runs:
        by_strategy.setdefault(run["strategy"], []).append(run)
    table = {}
    for name, group in by_strategy.items():
        figures = {key: spread([r[key] for r in group]) for key in COSTS}
        for protocol in group[0]["final"]:
            for unit, _, _ in UNITS:
                figures[f"{protocol}/{unit}"] = spread([r["final"][protocol][unit] for r in group])
        table[name] = figures
    return table


def cell(s: dict[str, float], digits: int, scale: float = 1.0) -> str:
    mean = f"{s['mean'] * scale:,.{digits}f}"
    return mean if s["n"] < 2 or s["sd"] == 0 else f"{mean} ± {s['sd'] * scale:,.{digits}f}"


def separation(table: dict, key: str, digits: int) -> list[str]:
    """For each strategy, best first, the strategies it beats by more than the spread (seed ranges apart)."""
    ranked = sorted(table, key=lambda n: table[n][key]["mean"])
    lines = []
    for name in ranked:
        beats = [other for other in ranked if table[name][key]["max"] < table[other][key]["min"]]
        verdict = f"lower than {', '.join(beats)}" if beats else "not apart from any strategy ranked below it"
        lines.append(f"- {name} ({cell(table[name][key], digits)}): {verdict}")
    return lines


def report(document: dict) -> str:
    """The markdown: how it was run, the full table, a compact one, and which differences exceed the spread."""
    settings, runs = document["settings"], document["runs"]
    table = aggregate(runs)
    names = [n for n in settings["strategies"] if n in table] + [n for n in table if n not in settings["strategies"]]
    seeds = max(t["steps"]["n"] for t in table.values())
    protocols = list(runs[0]["final"])
    articles = document.get("eval_articles", {})
    scored = ", ".join(f"{split}: {a['tokens']:,} tokens, {a['words']:,} words in {len(a['articles'])} of "
                       f"{a['of']} articles" for split, a in articles.items())
    lines = [
        f"{len(names)} strategies x {seeds} seeds, {settings['target_tokens']:,} target tokens per run; "
        f"`{settings['config']}` {' '.join(settings['overrides'])}".rstrip(),
        f"Machine: {document['machine']}. Date: {document['date']}. Scored: {scored}. Mean ± standard deviation "
        "over the seeds; compute counts every token slot, padding included (6N + attention FLOPs per slot); wall "
        "time is training's, compilation included (the first run of a shape compiles, later ones hit the cache), "
        "validation excluded; step ms is the median step.",
        "",
        "```bash",
        document["command"],
        "```",
        "",
    ]
    header = ["strategy", "steps", "target tokens", "padding", "token slots (M)", "TFLOP", "wall s", "step ms"]
    header += [f"{p.replace('/', ' ')} {label}" for p in protocols for _, label, _ in UNITS]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name in names:
        t = table[name]
        row = [name, cell(t["steps"], 0), cell(t["target_tokens"], 0), cell(t["padding_fraction"], 2, 100) + "%",
               cell(t["slots"], 3, 1e-6), cell(t["train_flops"], 2, 1e-12), cell(t["wall_seconds"], 0),
               cell(t["step_seconds"], 0, 1e3)]
        row += [cell(t[f"{p}/{unit}"], digits) for p in protocols for unit, _, digits in UNITS]
        lines.append("| " + " | ".join(row) + " |")
    compact = ["strategy", "padding", "TFLOP", "valid word ppl (documents)", "test word ppl (sliding)",
               "test word ppl (documents)", "test bits/byte (sliding)"]
    lines += ["", "| " + " | ".join(compact) + " |", "|---|" + "---:|" * (len(compact) - 1)]
    for name in names:
        t = table[name]
        lines.append("| " + " | ".join([
            name, cell(t["padding_fraction"], 2, 100) + "%", cell(t["train_flops"], 2, 1e-12),
            cell(t["valid/documents/word_perplexity"], 1), cell(t["test/sliding/word_perplexity"], 1),
            cell(t["test/documents/word_perplexity"], 1), cell(t["test/sliding/bits_per_byte"], 4)]) + " |")
    for protocol in ("test/sliding", "test/documents"):
        lines += ["", f"Larger than the spread (seed ranges do not overlap), test word perplexity, "
                      f"{protocol.split('/')[1]}, lowest first:"]
        lines += separation(table, f"{protocol}/word_perplexity", 1)
    resumed = sorted({r["strategy"] for r in runs if r.get("resumed_from")})
    if resumed:
        lines += ["", f"Resumed runs (their wall time covers only the part after the resume): {', '.join(resumed)}."]
    return "\n".join(lines)


def plot(document: dict, path: Path) -> Path:
    """Validation word perplexity against target tokens: one line per strategy (seed mean), its seed range shaded."""
    # matplotlib takes over half a second to import; only the plot needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display needed

    fig, ax = plt.subplots(figsize=(8, 5))
    names = list(dict.fromkeys(r["strategy"] for r in document["runs"]))
    for name in names:
        curves = [r["curve"] for r in document["runs"] if r["strategy"] == name and r["curve"]]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        x = np.mean([[p["target_tokens"] for p in c[:n]] for c in curves], axis=0)
        y = np.array([[p["word_perplexity"] for p in c[:n]] for c in curves])
        (line,) = ax.plot(x, y.mean(axis=0), "o-", markersize=3, label=name)
        if len(curves) > 1:
            ax.fill_between(x, y.min(axis=0), y.max(axis=0), color=line.get_color(), alpha=0.15, linewidth=0)
    valid = document.get("eval_articles", {}).get("valid")
    where = f"{len(valid['articles'])} of {valid['of']} valid articles" if valid else "valid"
    ax.set_xlabel("target tokens trained")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.set_ylabel(f"word perplexity ({where}, documents)")
    ax.set_yscale("log")
    ax.set_title(f"Validation word perplexity by strategy ({document['settings']['target_tokens']:,}-token budget)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = cli.parser("python scripts/study_strategies.py",
                   "train every sequence strategy to one target-token budget, evaluate them alike, report")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--gpu", action="store_true", help="the GPU scale: configs/wikitext2_gpu.yaml, whole splits")
    scale.add_argument("--quick", action="store_true", help="toy size: a tiny model, a tiny budget (CI)")
    p.add_argument("--out", metavar="DIR", help="where the runs and results go (rerun to continue)")
    p.add_argument("--strategies", metavar="A,B", help=f"default: {','.join(DEFAULT_STRATEGIES)}")
    p.add_argument("--seeds", type=int, help="seeds per strategy (run.seed 0..N-1)")
    p.add_argument("--target-tokens", type=int, help="tokens with non-zero loss weight per run")
    p.add_argument("--eval-docs", type=int, help="evenly spaced articles scored per split (0: every article)")
    p.add_argument("--points", type=int, help="validations during each run (the plot's points)")
    p.add_argument("--report", metavar="RESULTS.json", help="print the tables and draw the plot from a study's JSON")
    p.add_argument("--plot", metavar="PNG", help="with --report: where the plot goes (default: beside the JSON)")
    return cli.run(p, argv, lambda args: show_report(args) if args.report else run_study(args)) or 0


if __name__ == "__main__":
    sys.exit(main())
