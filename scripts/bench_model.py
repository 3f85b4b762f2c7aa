"""Model speed and memory per attention backend: forward and forward+backward on packed batches (JSON).

    python scripts/bench_model.py --config configs/wikitext2_cpu.yaml [key=value ...] [--backends xla,pallas]

For each backend this platform can run (CPU: xla; GPU: xla, cudnn when the
compute dtype is bfloat16, pallas; TPU: xla, splash) it times the jitted
forward (logits) and the jitted forward+backward (lm_loss and its gradient
with respect to every parameter) on one batch of data.batch_size x data.seq_len
tokens packed with synthetic documents, and reads peak memory from XLA's
compiled memory analysis (arguments + outputs + temporaries - aliased), which
works on every platform. The last line printed is one JSON object.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.main.cli import parse, parser
from seqjax.model import build_model, param_count
from seqjax.model.attention import resolve_backend
from seqjax.model.loss import lm_loss


def available_backends(compute_dtype: str) -> list[str]:
    names = {"gpu": ["xla", "cudnn", "pallas"], "tpu": ["xla", "splash"]}.get(jax.default_backend(), ["xla"])
    if jnp.dtype(compute_dtype) == jnp.float32 and "cudnn" in names:
        names.remove("cudnn")  # cuDNN fused attention takes half precision only
    return names


def packed_batch(batch: int, seq_len: int, vocab: int, mean_doc_len: int, seed: int) -> dict[str, np.ndarray]:
    """Full rows of documents with geometric lengths (mean ``mean_doc_len``), the last one cut to fit."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    for row in range(batch):
        start, sid = 0, 1
        while start < seq_len:
            n = min(int(rng.geometric(1 / mean_doc_len)), seq_len - start)
            seg[row, start : start + n], pos[row, start : start + n] = sid, np.arange(n)
            start, sid = start + n, sid + 1
    inputs = rng.integers(0, vocab, (batch, seq_len)).astype(np.int32)
    return {"inputs": inputs, "targets": np.roll(inputs, -1, 1), "positions": pos, "segment_ids": seg,
            "weights": (seg != 0).astype(np.float32)}


def peak_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def measure(fn, args, repeats: int) -> dict[str, float | int | None]:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {"ms": 1e3 * statistics.median(times), "compile_s": compile_s, "peak_bytes": peak_bytes(compiled)}


def bench_backend(cfg, backend: str, batch: dict, repeats: int, seed: int) -> dict:
    model = build_model(dataclasses.replace(cfg.model, attention=backend), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    arrays = {k: jnp.asarray(v) for k, v in batch.items()}

    def forward(p, b):
        return nnx.merge(graphdef, p)(b["inputs"], positions=b["positions"], segment_ids=b["segment_ids"])

    def loss(p, b):
        return lm_loss(forward(p, b), b["targets"], b["weights"])[0]

    tokens = batch["inputs"].size
    row = {"backend": backend}
    for name, fn in (("forward", forward), ("forward_backward", jax.value_and_grad(loss))):
        m = measure(fn, (params, arrays), repeats)
        row[name] = {
            "ms": round(m["ms"], 3),
            "tokens_per_s": round(tokens / (m["ms"] / 1e3)),
            "peak_bytes_per_token": None if m["peak_bytes"] is None else round(m["peak_bytes"] / tokens),
            "compile_s": round(m["compile_s"], 2),
        }
        print(f"# {backend} {name}: {row[name]}", file=sys.stderr, flush=True)
    return row


def main(argv=None) -> dict:
    p = parser("bench_model", "time forward and forward+backward, and peak memory per token, per attention backend")
    p.add_argument("--backends", help="comma-separated (default: every backend this platform can run)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    p.add_argument("--mean-doc-len", type=int, default=64, help="mean synthetic document length in a packed row")
    args, config = parse(p, argv)
    vocab = config.model.vocab_size or config.tokenizer.vocab_size
    config.model = dataclasses.replace(config.model, vocab_size=vocab, max_seq_len=config.max_seq_len)
    backends = args.backends.split(",") if args.backends else available_backends(config.model.compute_dtype)
    for name in backends:
        resolve_backend(name)  # unknown names fail before any work
    batch = packed_batch(config.data.batch_size, config.data.seq_len, vocab, args.mean_doc_len, config.run.seed)
    counts = param_count(build_model(config.model, rngs=nnx.Rngs(0)))
    result = {
        "machine": (f"{jax.default_backend()}: {jax.devices()[0].device_kind}; "
                    f"host {platform.machine()}, {os.cpu_count()} cores"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python scripts/bench_model.py", *sys.argv[1:]] if argv is None else argv),
        "jax": jax.__version__,
        "model": {k: getattr(config.model, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                                      "vocab_size", "compute_dtype", "param_dtype")},
        "params": counts,
        "batch": {"rows": config.data.batch_size, "seq_len": config.data.seq_len,
                  "scored_tokens": int(batch["weights"].sum()),
                  "segments": int(sum(len(set(r) - {0}) for r in batch["segment_ids"]))},
        "results": [bench_backend(config, name, batch, args.repeats, config.run.seed) for name in backends],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
