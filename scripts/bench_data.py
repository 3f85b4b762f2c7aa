"""Tokens/s and padding of every sequence strategy on WikiText-2 train, beside Grain's packers and HF's group_texts.

    python scripts/bench_data.py [--config configs/wikitext2_cpu.yaml] [--seq-lens 512 2048] [--out FILE.json]

For each seq_len, one epoch of each strategy (and each packer) goes through
``epoch_stats``: the epoch's plan plus every batch of the five contract arrays,
timed end to end. Grain's FirstFit/BestFit/ConcatThenSplit run the same
documents through their IterDatasets with the same output contract. HF run_clm's
group_texts runs the way ``datasets.map(batched=True)`` runs it: Python lists,
1000 documents per call. Prints one JSON object (and writes it with --out),
including the issue's targets evaluated on these numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from itertools import chain
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from seqjax.config.data import PACKERS  # noqa: E402
from seqjax.config.load import load_config
from seqjax.data.sequences import HF_MAP_BATCH  # noqa: E402
from seqjax.data.stats import epoch_stats  # noqa: E402
from seqjax.store.build import prepare  # noqa: E402

CASES = [
    ("window", []),
    ("random_offset", []),
    ("sequential", []),
    ("random_window", []),
    ("concat_chunk", []),
    ("concat_chunk", ["data.cross_document_attention=true"]),
    *[("block", [f"data.break_mode={m}"]) for m in ("none", "complete", "complete_doc", "eos")],
    *[("pack", [f"data.packer={p}"]) for p in PACKERS],
    ("length_grouped", []),
]


def name(strategy: str, extra: list[str]) -> str:
    """``block/eos``, ``pack/best_fit``, ``concat_chunk/cross_document_attention``."""
    parts = [
        value if value not in ("true", "false") else key.split(".")[-1]
        for key, value in (e.split("=", 1) for e in extra)
    ]
    return "/".join([strategy, *parts])


def hf_group_texts(examples: dict[str, list[list[int]]], block_size: int) -> dict[str, list[list[int]]]:
    """run_clm's group_texts: concatenate the batch, cut into blocks, drop the remainder, copy labels."""
    concatenated = {k: list(chain(*examples[k])) for k in examples}
    total = (len(concatenated["input_ids"]) // block_size) * block_size
    result = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in concatenated.items()}
    result["labels"] = result["input_ids"].copy()
    return result


def bench_hf(store, seq_len: int) -> dict:
    tokens = store.tokens.tolist()
    cuts = (store.doc_offsets[:-1] - 1).tolist() + [len(tokens)]
    documents = [tokens[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    start = time.perf_counter()
    rows = 0
    for i in range(0, len(documents), HF_MAP_BATCH):
        rows += len(hf_group_texts({"input_ids": documents[i : i + HF_MAP_BATCH]}, seq_len + 1)["input_ids"])
    seconds = time.perf_counter() - start
    real = rows * seq_len
    return {
        "strategy": "hf_group_texts",
        "name": "hf_group_texts",
        "rows": rows,
        "seq_len": seq_len,
        "real_tokens": real,
        "padding_fraction": 0.0,
        "tokens_dropped": store.predicted_tokens - real,
        "tokens_per_s": real / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/wikitext2_cpu.yaml")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    p.add_argument(
        "--repeats", type=int, default=5, help="best of this many timed epochs per strategy (a shared machine is noisy)"
    )
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.batch_size=16")
    args = p.parse_args(argv)

    base = [f"model.max_seq_len={max(args.seq_lens)}", *args.overrides]
    store = prepare(load_config(args.config, base), splits=("train",)).stores["train"]
    results = []
    jobs = [(seq_len, strategy, extra) for seq_len in args.seq_lens for strategy, extra in CASES]
    for seq_len, strategy, extra in tqdm(jobs, desc="strategies", file=sys.stderr):
        config = load_config(args.config, [*base, f"data.seq_len={seq_len}", f"data.strategy={strategy}", *extra])
        runs = [epoch_stats(config, store) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        best["name"] = name(strategy, extra)
        results.append(best)
    for seq_len in args.seq_lens:
        results.append(bench_hf(store, seq_len))

    def find(seq_len, name):
        return next(r for r in results if r["seq_len"] == seq_len and r["name"] == name)

    targets = {}
    for seq_len in args.seq_lens:
        grain_ff = find(seq_len, "pack/grain_first_fit")["tokens_per_s"]
        ours = [
            r for r in results if r["seq_len"] == seq_len and "grain" not in r["name"] and r["name"] != "hf_group_texts"
        ]
        speedup = {r["name"]: r["tokens_per_s"] / grain_ff for r in ours}
        padding = {
            name: find(seq_len, name)["padding_fraction"]
            for name in ("pack/fill", "concat_chunk", "pack/best_fit", "pack/grain_best_fit")
        }
        targets[str(seq_len)] = {
            "speedup_vs_grain_first_fit": speedup,
            "below_10x": sorted(name for name, x in speedup.items() if x < 10),
            "padding": padding,
            "fill_and_concat_chunk_below_0.5%": padding["pack/fill"] < 0.005 and padding["concat_chunk"] < 0.005,
            "best_fit_no_worse_than_grain_best_fit": padding["pack/best_fit"] <= padding["pack/grain_best_fit"],
        }
    report = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/bench_data.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "store": {"documents": store.num_docs, "tokens": store.num_tokens},
        "batch_size": load_config(args.config, base).data.batch_size,
        "results": results,
        "targets": targets,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
