"""eval.mode=documents on short examples: windows packed into rows (eval.pack, the default) against one window per
row padded to the context (eval.pack=false, what it did before), side by side in one run (JSON).

    python scripts/bench_eval_documents.py [--examples 2000] [--context 1024] [--d-model 256] [--layers 4]

A synthetic split of chat-sized examples (lengths drawn from a log-normal around 200 tokens, as instruction sets
run) is scored by the same random model both ways. Reported per way: rows, slots filled (rows x context),
seconds (after one warm-up batch compiles), scored tokens per second, and the nll sum, which must agree. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import time

import jax
import numpy as np
from flax import nnx

from seqjax.config.load import load_config
from seqjax.eval.evaluate import evaluate, windows_for
from seqjax.model import build_model
from seqjax.store.reader import TokenStore


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(200), 0.7, args.examples).astype(int), 8, args.context - 1)
    store = TokenStore.from_documents([rng.integers(1, args.vocab, n) for n in lengths], eot_id=0,
                                      vocab_size=args.vocab)
    base = load_config(None, [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=4",
                              f"model.d_ff={4 * args.d_model}", f"model.max_seq_len={args.context}",
                              f"data.seq_len={args.context}", "model.attention=xla", "eval.mode=documents",
                              f"eval.batch_size={args.batch_size}", f"model.vocab_size={args.vocab}"])
    model = build_model(base, rngs=nnx.Rngs(0))
    rows = {}
    for name, pack in (("packed", True), ("one_window_per_row", False)):
        config = dataclasses.replace(base, eval=dataclasses.replace(base.eval, pack=pack))
        windows = windows_for(store, config)
        evaluate(model, store, config, max_batches=1, progress=False)  # compile
        start = time.perf_counter()
        result = evaluate(model, store, config, progress=False)
        seconds = time.perf_counter() - start
        rows[name] = {"rows": windows.num_rows, "slots": windows.num_rows * args.context,
                      "scored_tokens": result["tokens"], "seconds": round(seconds, 3),
                      "tokens_per_s": round(result["tokens"] / seconds, 1), "nll_sum": result["nll_sum"]}
    out = {
        "bench": "eval_documents", "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "backend": jax.default_backend(), "examples": args.examples, "context": args.context,
        "mean_example_tokens": float(lengths.mean()), "d_model": args.d_model, "layers": args.layers, **rows,
        "speedup": round(rows["one_window_per_row"]["seconds"] / rows["packed"]["seconds"], 2),
        "nll_relative_difference": abs(rows["packed"]["nll_sum"] / rows["one_window_per_row"]["nll_sum"] - 1),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
