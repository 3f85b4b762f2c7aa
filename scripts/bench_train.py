"""Training-step throughput: tokens/s, step time, MFU and peak memory of the real train step on real batches (JSON).

    python scripts/bench_train.py --config configs/gpt2_small.yaml model.attention=pallas
    python scripts/bench_train.py --config configs/gpt2_small.yaml --steps 30 --loops sync,async

It builds what ``python -m seqjax.train`` builds (the sharded model and AdamW
state, the jitted step with the same shardings and donation, the configured
data pipeline) and times ``--steps`` steps after ``--warmup`` steps of
compilation and warm-up, without checkpoints or validation. Two ways of driving
the loop are timed, one after the other on the same state:

- ``sync``: the loop before it stopped waiting on the host: each batch is built
  and copied in the loop, and each step's metrics are fetched (``device_get``)
  before the next step is dispatched;
- ``async``: what the train loop does now: batches built and put on the device
  ``train.prefetch`` steps ahead in a thread, metrics fetched once per
  ``train.log_every`` steps.

MFU uses seqjax.train.flops (6N + 12·L·H·Dh·T per token) against the device's
bf16 peak. Peak memory is the device's ``peak_bytes_in_use`` for this process
(run one backend per process for a clean figure), and XLA's compiled plan for
the step (arguments + outputs + temporaries - aliased). The last stdout line is
one JSON object.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time

import jax
import numpy as np

from seqjax.data.pipeline import build_pipeline
from seqjax.main.cli import parse, parser
from seqjax.model import sharding
from seqjax.objectives import settings_of
from seqjax.store.build import prepare
from seqjax.train.flops import flops_per_token, peak_flops_per_device
from seqjax.train.metrics import peak_memory_bytes
from seqjax.train.optimizer import build_optimizer
from seqjax.train.prefetch import DevicePrefetch
from seqjax.train.setup import (
    count,
    objective_of,
    reference_arguments,
    sharded_optimizer_state,
    starting_weights,
    with_vocab,
)
from seqjax.train.step import make_train_step
from seqjax.weights.reference import decide, same_weights_rule


def compiled_bytes(compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def main(argv=None) -> dict:
    p = parser("bench_train", "time the train step on real batches: tokens/s, step time, MFU, peak memory")
    p.add_argument("--steps", type=int, default=30, help="timed steps per loop mode")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--loops", default="sync,async", help="loop modes to time, in order (sync, async)")
    args, config = parse(p, argv)
    wall = time.perf_counter()
    tc = config.train
    mesh = sharding.build_mesh(config.mesh)
    sharding.check_batch_fits(config.data.batch_size, mesh, tc.grad_accum)
    prepared = prepare(config, splits=("train",))
    config = with_vocab(config, prepared.tokenizer.vocab_size)
    # the training run's own placement: the frozen base and a reference model ride as extra arguments
    placed, _ = starting_weights(config, mesh, None)
    params, num_params = placed.params, placed.model_params
    trained = count(params)
    objective = objective_of(config)
    ref = decide(config, objective.reference)
    extras, extra_shardings, reference_graphdef, _ = reference_arguments(placed, config, ref)
    tx, _ = build_optimizer(tc)
    replicated = sharding.replicated(mesh)
    opt_state, opt_shardings = sharded_optimizer_state(tx, params, placed.param_shardings, replicated)
    batch_sharding = sharding.batch_sharding(mesh)
    step = make_train_step(placed.graphdef, placed.rest, tx, grad_accum=tc.grad_accum, z_loss=tc.z_loss,
                           objective=objective, settings=settings_of(config, objective),
                           reference_graphdef=reference_graphdef, same_weights=same_weights_rule(ref, config))
    rng = sharding.place(jax.random.key_data(jax.random.key(config.run.seed)), replicated)
    jitted = jax.jit(
        step,
        in_shardings=(placed.param_shardings, opt_shardings, batch_sharding, replicated, replicated,
                      *extra_shardings),
        out_shardings=(placed.param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )
    step_fn = lambda params, opt_state, batch: jitted(params, opt_state, batch, rng, 0, *extras)  # noqa: E731
    iterator = iter(build_pipeline(config, prepared.stores["train"]))
    to_device = lambda b: sharding.global_batch(b, batch_sharding, 1)  # noqa: E731

    first = to_device(next(iterator))
    start = time.perf_counter()
    compiled = jitted.lower(params, opt_state, first, rng, 0, *extras).compile()
    compile_s = time.perf_counter() - start
    for _ in range(args.warmup):
        params, opt_state, m = step_fn(params, opt_state, to_device(next(iterator)))
    jax.block_until_ready(m)

    rows, length = first["inputs"].shape
    flops_tok = flops_per_token(config.model, length, num_params, config.model.vocab_size, trained=trained)
    peak = peak_flops_per_device(override=tc.peak_flops)
    results = {}
    for mode in args.loops.split(","):
        tokens = 0
        losses = []
        if mode == "sync":
            start = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, m = step_fn(params, opt_state, to_device(next(iterator)))
                m = jax.device_get(m)  # the old loop: one host sync per step
                tokens += int(m["tokens"])
                losses.append(float(m["loss"]))
            seconds = time.perf_counter() - start
        elif mode == "async":
            with DevicePrefetch(iterator, to_device, depth=tc.prefetch) as prefetch:
                pending = []
                start = time.perf_counter()
                for i in range(1, args.steps + 1):
                    batch, _ = next(prefetch)
                    params, opt_state, m = step_fn(params, opt_state, batch)
                    pending.append(m)
                    if i % tc.log_every == 0 or i == args.steps:
                        fetched = jax.device_get(pending)  # one host sync per log window
                        tokens += sum(int(f["tokens"]) for f in fetched)
                        losses += [float(f["loss"]) for f in fetched]
                        pending = []
                seconds = time.perf_counter() - start
        else:
            p.error(f"--loops: unknown mode {mode!r}, expected sync or async")
        rate = tokens / seconds
        results[mode] = {
            "steps": args.steps,
            "step_time_ms": 1e3 * seconds / args.steps,
            "tokens_per_s": rate,
            "mfu": None if peak is None else rate * flops_tok / (jax.device_count() * peak),
            "padding_fraction": 1 - tokens / (args.steps * rows * length),
            "loss_first_last": [losses[0], losses[-1]],
            "finite": bool(np.isfinite(losses).all()),
        }
        print(f"# {config.model.attention} {mode}: {results[mode]}", file=sys.stderr, flush=True)
    device = jax.devices()[0]
    summary = {
        "bench": "train",
        "device": device.device_kind,
        "platform": jax.default_backend(),
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "command": " ".join(["python scripts/bench_train.py", *(sys.argv[1:] if argv is None else argv)]),
        "attention": config.model.attention,
        "compute_dtype": config.model.compute_dtype,
        "parameters": num_params,
        "trained_parameters": trained,
        "batch": {"rows": rows, "seq_len": length, "grad_accum": tc.grad_accum, "strategy": config.data.strategy},
        "flops_per_token": flops_tok,
        "peak_flops_per_device": peak,
        "compile_s": compile_s,
        "compiled_step_bytes": compiled_bytes(compiled),
        "peak_memory_bytes": peak_memory_bytes(),
        "loops": results,
        "speedup_async_over_sync": (results["sync"]["step_time_ms"] / results["async"]["step_time_ms"]
                                    if {"sync", "async"} <= results.keys() else None),
        "wall_s": time.perf_counter() - wall,
        "model": {k: getattr(config.model, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                                      "vocab_size", "max_seq_len")},
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
