"""Packing instruction data: padding and examples/s of seqjax's packers against TRL, a greedy buffer and padding (JSON).

    python scripts/bench_sft.py                      # 20,000 examples, rows of 4,096 tokens
    python scripts/bench_sft.py --examples 2000 --step-batches 4

The examples are written here: lengths drawn from a lognormal with a median of
300 tokens (sigma 0.9, so a tail to about 4k; capped one below the row), the
first 30-70% of each a prompt (weight 0), random ids. Everyone packs the same
lengths into rows of ``--seq-len``, side by side in one run:

- seqjax's packers (``data.strategy=pack``, each ``data.packer``) and its
  ``length_grouped`` padding, through the real pipeline (plan + every batch of
  the epoch built as contract arrays: ``examples_per_s``), and the plan alone
  (which row each example goes to: ``plan_only_examples_per_s``, the figure
  to set beside the two baselines below, which only assign rows);
- TRL's own ``trl.data_utils.pack_dataset`` (``bfd`` and ``bfd_split``) on a
  ``datasets.Dataset``, when trl imports here (``pip install --no-deps trl``);
- lmms-engine's greedy buffer, written from its published description (fill a
  buffer in order up to ``packing_length``, start a new one when the next
  example does not fit, filter overlong ones);
- pad-to-longest with length grouping (HF Trainer's ``group_by_length``:
  mega-batches of 50 batches sorted by length, each batch padded to its longest).

Padding is ``1 - tokens / (rows * width)`` with rows padded to their batch's
width (``--seq-len`` for the packers: the fixed shape a jitted step wants).
Then, on the CPU, the real train step (a small Llama, ``--step-seq-len``) is
timed per example: packed rows (best_fit) against length-grouped padded rows.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import numpy as np


def example_lengths(n: int, cap: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Token counts (lognormal, median 300, at most ``cap``) and each one's prompt length (30-70%)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(300), 0.9, n)), 8, cap).astype(np.int64)
    prompts = np.maximum(1, (lengths * rng.uniform(0.3, 0.7, n)).astype(np.int64))
    return lengths, prompts


def store_of(lengths: np.ndarray, prompts: np.ndarray, vocab: int, seed: int):
    from seqjax.store.reader import TokenStore

    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, vocab, n) for n in lengths]
    weights = [np.concatenate([np.zeros(p, np.uint8), np.ones(n - p + 1, np.uint8)]) for n, p in zip(lengths, prompts)]
    return TokenStore.from_documents(ids, eot_id=0, vocab_size=vocab, weights=weights)


def seqjax_rows(store, seq_len: int, batch: int, packer: str | None) -> dict:
    """One epoch through the real pipeline (plan and every batch built), as python -m seqjax.data reports it."""
    from seqjax.config.load import load_config
    from seqjax.data.stats import epoch_stats

    strategy = ["data.strategy=pack", f"data.packer={packer}"] if packer else ["data.strategy=length_grouped"]
    config = load_config(None, ["data.corpus=jsonl", "data.train_files=[x.jsonl]", "data.format=tokenized",
                                f"data.seq_len={seq_len}", f"data.batch_size={batch}", "data.overlong=split",
                                *strategy])
    planned = None
    if packer is None or not packer.startswith("grain"):  # (Grain's packers have no plan: they pack as they go)
        from seqjax.data.plan import EpochPlanner

        start = time.perf_counter()
        EpochPlanner(config, store).plan(0)
        planned = store.num_docs / (time.perf_counter() - start)
    stats = epoch_stats(config, store)
    seconds = stats["real_tokens"] / stats["tokens_per_s"]
    return {"padding_fraction": stats["padding_fraction"], "rows": stats["rows"],
            "examples_per_row": stats["segments_per_row_mean"], "examples_per_s": store.num_docs / seconds,
            "plan_only_examples_per_s": planned, "tokens_dropped": stats["tokens_dropped"], "seconds": seconds}


def trl_rows(lengths: np.ndarray, seq_len: int, strategy: str) -> dict | None:
    try:
        # optional: TRL is not a dependency (pip install --no-deps trl psutil gives its pack_dataset)
        from datasets import Dataset
        from trl.data_utils import pack_dataset
    except ImportError:
        return None
    ids = [np.arange(n, dtype=np.int64).tolist() for n in lengths]
    dataset = Dataset.from_dict({"input_ids": ids})
    start = time.perf_counter()
    packed = pack_dataset(dataset, seq_len, strategy=strategy, map_kwargs={"load_from_cache_file": False})
    row_lengths = np.asarray([len(r) for r in packed["input_ids"]])
    seconds = time.perf_counter() - start
    return {"padding_fraction": 1 - row_lengths.sum() / (len(row_lengths) * seq_len), "rows": len(row_lengths),
            "examples_per_row": len(lengths) / len(row_lengths), "examples_per_s": len(lengths) / seconds,
            "tokens_dropped": int(lengths.sum() - row_lengths.sum()), "seconds": seconds}


def greedy_buffer_rows(lengths: np.ndarray, seq_len: int) -> dict:
    """lmms-engine's packing as its description states it: in order, a new buffer when the next does not fit."""
    start = time.perf_counter()
    rows, used, dropped, kept = [], 0, 0, 0
    for n in lengths.tolist():
        if n > seq_len:  # filter_overlong
            dropped += n
            continue
        if used + n > seq_len:
            rows.append(used)
            used = 0
        used += n
        kept += 1
    rows.append(used)
    seconds = time.perf_counter() - start
    return {"padding_fraction": 1 - sum(rows) / (len(rows) * seq_len), "rows": len(rows),
            "examples_per_row": kept / len(rows), "examples_per_s": len(lengths) / seconds, "tokens_dropped": dropped,
            "seconds": seconds}


def pad_to_longest_rows(lengths: np.ndarray, batch: int, seed: int, mega: int = 50) -> dict:
    """HF Trainer's group_by_length: shuffled mega-batches sorted by length, each batch padded to its longest."""
    start = time.perf_counter()
    order = np.random.default_rng(seed).permutation(len(lengths))
    slots = 0
    for m in range(0, len(order), mega * batch):
        chunk = order[m : m + mega * batch]
        chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
        for b in range(0, len(chunk), batch):
            rows = lengths[chunk[b : b + batch]]
            slots += batch * int(rows.max())
    seconds = time.perf_counter() - start
    return {"padding_fraction": 1 - lengths.sum() / slots, "rows": len(lengths), "examples_per_row": 1.0,
            "examples_per_s": len(lengths) / seconds, "tokens_dropped": 0, "seconds": seconds}


def step_time_per_example(store, seq_len: int, batch: int, batches: int, strategy: list[str]) -> dict:
    """The real train step (small Llama, CPU) over ``batches`` batches: seconds per example, after a warm-up."""
    import jax

    from seqjax.config.load import load_config
    from seqjax.data.pipeline import build_pipeline
    from seqjax.model import sharding
    from seqjax.train.optimizer import build_optimizer
    from seqjax.train.setup import sharded_model, sharded_optimizer_state
    from seqjax.train.step import make_train_step

    config = load_config(None, ["data.corpus=jsonl", "data.train_files=[x.jsonl]", "data.format=tokenized",
                                f"data.seq_len={seq_len}", f"data.batch_size={batch}", "data.overlong=split",
                                "model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.d_ff=384",
                                f"model.vocab_size={store.vocab_size}", "model.attention=xla", "data.shuffle=false",
                                *strategy])
    mesh = sharding.build_mesh(config.mesh)
    placed = sharded_model(config, mesh)  # (full fine-tuning: every parameter trains, nothing frozen)
    graphdef, rest, params, param_shardings = placed.graphdef, placed.rest, placed.params, placed.param_shardings
    tx, _ = build_optimizer(config.train)
    opt_state, _ = sharded_optimizer_state(tx, params, param_shardings, sharding.replicated(mesh))
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=1, z_loss=0.0))
    iterator = iter(build_pipeline(config, store))
    work = [next(iterator) for _ in range(batches)]
    for width in sorted({b["inputs"].shape[1] for b in work}):  # compile every width first (length_grouped)
        warm = next(b for b in work if b["inputs"].shape[1] == width)
        jax.block_until_ready(step(params, opt_state, warm))
    examples = sum(len(np.unique(row[row > 0])) for b in work for row in b["segment_ids"])
    start = time.perf_counter()
    for b in work:
        params, opt_state, metrics = step(params, opt_state, b)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    tokens = sum(int((b["segment_ids"] > 0).sum()) for b in work)
    slots = sum(b["inputs"].size for b in work)
    return {"batches": batches, "examples": examples, "seconds": seconds, "ms_per_example": 1e3 * seconds / examples,
            "padding_fraction": 1 - tokens / slots}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=20000)
    p.add_argument("--seq-len", type=int, default=4096, help="row width of the packing comparison")
    p.add_argument("--batch", type=int, default=16, help="rows per batch (padding and length grouping)")
    p.add_argument("--step-seq-len", type=int, default=1024, help="row width of the train-step timing")
    p.add_argument("--step-batch", type=int, default=8)
    p.add_argument("--step-batches", type=int, default=8, help="train steps timed per layout")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    started = time.perf_counter()
    lengths, prompts = example_lengths(args.examples, args.seq_len - 1, args.seed)
    store = store_of(lengths, prompts, 512, args.seed)
    results = {}
    for packer in ("best_fit", "first_fit", "greedy", "best_fit_decreasing", "fill", "grain_first_fit",
                   "grain_best_fit"):
        results[f"seqjax pack/{packer}"] = seqjax_rows(store, args.seq_len, args.batch, packer)
        print(f"# seqjax pack/{packer}: {results[f'seqjax pack/{packer}']}", file=sys.stderr, flush=True)
    results["seqjax length_grouped"] = seqjax_rows(store, args.seq_len, args.batch, None)
    for strategy in ("bfd", "bfd_split"):
        found = trl_rows(lengths, args.seq_len, strategy)
        results[f"trl pack_dataset/{strategy}"] = found if found is not None else "trl not importable"
    results["lmms-engine greedy buffer (from its description)"] = greedy_buffer_rows(lengths, args.seq_len)
    results["pad to longest, group_by_length"] = pad_to_longest_rows(lengths, args.batch, args.seed)
    for name, row in results.items():
        print(f"# {name}: {row}", file=sys.stderr, flush=True)

    step_lengths, step_prompts = example_lengths(args.examples, args.step_seq_len - 1, args.seed + 1)
    step_store = store_of(step_lengths, step_prompts, 512, args.seed + 1)
    steps = {
        "packed (pack/best_fit)": step_time_per_example(step_store, args.step_seq_len, args.step_batch,
                                                        args.step_batches, ["data.strategy=pack"]),
        "padded (length_grouped)": step_time_per_example(step_store, args.step_seq_len, args.step_batch,
                                                         args.step_batches, ["data.strategy=length_grouped"]),
    }
    for name, row in steps.items():
        print(f"# step {name}: {row}", file=sys.stderr, flush=True)
    summary = {
        "bench": "sft",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "examples": args.examples,
        "length_median": float(np.median(lengths)),
        "length_p99": float(np.percentile(lengths, 99)),
        "length_max": int(lengths.max()),
        "seq_len": args.seq_len,
        "packing": results,
        "train_step": {"seq_len": args.step_seq_len, "batch": args.step_batch, **steps},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
