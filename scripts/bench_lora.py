"""LoRA against full fine-tuning at the same small shape, side by side in one run (JSON).

    python scripts/bench_lora.py [--d-model 512] [--layers 8] [--rank 16] [--seq-len 512] [--batch 8]

Both build the same model (bf16 matmuls, float32 parameters) and run the real train step (seqjax.train.step)
on the same random batches: full fine-tuning differentiates every parameter, ``model.lora`` (rank ``--rank``,
all seven projections) only the adapters, with the base a frozen argument. Reported for each: trainable
parameters, optimizer-state bytes (AdamW's moments), the bytes of a checkpoint of what each run saves
(orbax, on disk), and the median step time after warm-up. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from seqjax.config.load import load_config
from seqjax.model import build_model, split_params
from seqjax.train.optimizer import build_optimizer
from seqjax.train.step import make_train_step


def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    shape = [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=8",
             "model.n_kv_heads=4", f"model.d_ff={4 * args.d_model}", f"model.vocab_size={args.vocab}",
             f"model.max_seq_len={args.seq_len}", f"data.seq_len={args.seq_len}", "model.compute_dtype=bfloat16",
             "model.attention=xla", "train.warmup_steps=0"]
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq_len + 1)), jnp.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": jnp.ones_like(ids[:, 1:]),
             "positions": jnp.tile(jnp.arange(args.seq_len), (args.batch, 1)),
             "weights": jnp.ones(ids[:, 1:].shape, jnp.float32)}
    rows = {}
    for name, extra in (("full", []), ("lora", [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"])):
        config = load_config(None, shape + extra)
        graphdef, params, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(params)
        frozen_args = [] if frozen is None else [nnx.to_pure_dict(frozen)]
        tx, _ = build_optimizer(config.train)
        opt_state = tx.init(params)
        step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=1, z_loss=0.0), donate_argnums=(0, 1))
        times = []
        for k in range(args.repeats + 1):
            start = time.perf_counter()
            params, opt_state, metrics = step(params, opt_state, batch, None, k, *frozen_args)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        with tempfile.TemporaryDirectory() as tmp:
            with ocp.StandardCheckpointer() as ckpt:
                ckpt.save(Path(tmp) / "ckpt", {"params": params, "opt_state": opt_state})
            saved = sum(f.stat().st_size for f in (Path(tmp) / "ckpt").rglob("*") if f.is_file())
        total = sum(x.size for x in jax.tree.leaves(params)) + sum(
            x.size for x in jax.tree.leaves(frozen_args[0] if frozen_args else {}))
        rows[name] = {"trainable_parameters": int(sum(x.size for x in jax.tree.leaves(params))),
                      "parameters": int(total), "optimizer_bytes": nbytes(opt_state), "checkpoint_bytes": int(saved),
                      "step_seconds_median": round(statistics.median(times[1:]), 4),
                      "final_loss": float(metrics["loss"])}
    out = {"bench": "lora", "date": datetime.date.today().isoformat(), "machine": platform.machine(),
           "backend": jax.default_backend(), "device": str(jax.devices()[0]), "shape": vars(args), **rows,
           "trainable_ratio": rows["lora"]["trainable_parameters"] / rows["full"]["trainable_parameters"],
           "checkpoint_ratio": rows["lora"]["checkpoint_bytes"] / rows["full"]["checkpoint_bytes"],
           "step_time_ratio": rows["lora"]["step_seconds_median"] / rows["full"]["step_seconds_median"]}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
