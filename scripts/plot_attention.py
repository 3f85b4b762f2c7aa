"""Plot bench_attention.py records: useful TFLOP/s against T, one line per implementation (PNG).

    python scripts/plot_attention.py docs/benchmarks/h100-2026-11-23/attention.jsonl --head-dim 128 \
        --out docs/benchmarks/h100-2026-11-23/attention_d128.png

Four panels: forward and forward+backward, on dense rows (one document per row) and on packed rows
(~512-token documents). Packed TFLOP/s count only the pairs inside documents (``flops_useful``), so a
kernel that computes the masked-out pairs scores low there. Records with an error, and records whose
output disagreed with seqjax's kernel (``rel_err_vs_flash`` > 0.05), are left out and listed on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(prog="plot_attention", description=__doc__.split("\n")[0])
    p.add_argument("records", type=Path, help="JSONL written by bench_attention.py --out")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.startswith("{")]
    records = [r for r in records if r.get("head_dim") == args.head_dim and "impl" in r]
    if not records:
        p.error(f"{args.records}: no records with head_dim {args.head_dim}")
    kept = []
    for r in records:
        bad = r.get("error") or ((r.get("rel_err_vs_flash") or 0) > 0.05 and "wrong output")
        if bad:
            print(f"left out: {r['impl']} {r['input']} T={r['seq_len']}: {bad}", file=sys.stderr)
        else:
            kept.append(r)
    names = list(dict.fromkeys(r["impl"] for r in kept)) + ["varlen"]
    colors = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per implementation in every panel
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for col, kind in enumerate(("dense", "packed")):
        for row, (key, label) in enumerate((("fwd_tflops", "forward"), ("fwd_bwd_tflops", "forward+backward"))):
            ax = axes[row][col]
            inputs = (kind, "varlen") if kind == "packed" else (kind,)
            for impl in dict.fromkeys(r["impl"] for r in kept):
                for inp in inputs:
                    pts = sorted((r["seq_len"], r[key]) for r in kept
                                 if r["impl"] == impl and r["input"] == inp and r.get(key))
                    if pts:
                        name = "flash on separate rows (ideal varlen)" if inp == "varlen" else impl
                        ax.plot(*zip(*pts), "o--" if inp == "varlen" else "o-", label=name,
                                color=colors["varlen" if inp == "varlen" else impl])
            ax.set_xscale("log", base=2)
            ax.set_title(f"{label}, {kind} rows, D={args.head_dim}")
            ax.set_ylabel("useful TFLOP/s")
            ax.grid(True, alpha=0.3)
            if row == 1:
                ax.set_xlabel("row length T (tokens)")
            ax.legend(fontsize=7)
    device = records[0].get("device", "")
    fig.suptitle(f"Attention on {device} ({records[0].get('date', '')[:10]}), bf16, causal")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(json.dumps({"plot": str(args.out), "records": len(kept), "left_out": len(records) - len(kept)}))
    return args.out


if __name__ == "__main__":
    main()
