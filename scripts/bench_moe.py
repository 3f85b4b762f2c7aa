"""One mixture-of-experts layer's experts, dispatched five ways side by side in one run: the forward's time,
forward + backward's, and compiled temporary memory (JSON).

    python scripts/bench_moe.py [--shape cpu|qwen3_30b] [--tokens N] [--repeats 3]

- ``ragged_dot``: model.experts.dispatch=ragged_dot (auto's pick on a GPU or TPU): the (token, choice) pairs
  sorted by expert and run as grouped matmuls, ``jax.lax.ragged_dot``; every token reaches its k experts;
- ``blocked``: the pairs sorted by expert, each expert's group padded to 64-row blocks, one batched matmul
  over the blocks (model.experts.dispatch=blocked; auto's pick on the CPU);
- ``dense``: every expert on every token, each pair taking its expert's output (model.experts.dispatch=dense,
  the reference): E / k times the work;
- ``onehot``: GShard's one-hot dispatch and combine einsums with a capacity of ``--capacity-factor`` x N k / E
  rows an expert (MaxText's dropping path): pairs over an expert's capacity are dropped, and the run prints how
  many (the others compute no such loss);
- ``ragged_dot_mgpu``: jax's Mosaic GPU ragged-dot kernel (``jax.experimental.pallas.ops.gpu``), on a Hopper GPU
  when it imports. It has no backward rule, so its row has the forward time only.

``--shape cpu``: 2,048 tokens, d_model 256, 16 experts of width 128, top 2, float32. ``--shape qwen3_30b``:
Qwen3-30B-A3B's layer (d_model 2,048, 128 experts of width 768, top 8) on 8,192 tokens, bfloat16: the GPU
suite's ``moe`` stage. Time is the median of ``--repeats`` runs after one warm-up; memory is XLA's compiled
memory analysis. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.model.experts import ACTIVATIONS, DISPATCH

SHAPES = {"cpu": dict(tokens=2048, d_model=256, experts=16, d_ff=128, top_k=2, dtype="float32"),
          "qwen3_30b": dict(tokens=8192, d_model=2048, experts=128, d_ff=768, top_k=8, dtype="bfloat16")}


def onehot(x, chosen, w, act, capacity):
    """GShard's dispatch: each (token, choice) to a slot of its expert's capacity (dropped beyond it), the
    experts run on their [E, C, D] slots, combined back by the same one-hot."""
    n, k = chosen.shape
    e = w["w_gate"].shape[0]
    mask = jax.nn.one_hot(chosen.reshape(-1), e, dtype=jnp.int32)  # [N k, E]
    slot = jnp.cumsum(mask, axis=0) * mask - 1  # each pair's place in its expert's queue
    kept = (slot >= 0) & (slot < capacity)
    dispatch = (jax.nn.one_hot(jnp.where(kept, slot, -1), capacity, dtype=x.dtype) *
                kept[..., None].astype(x.dtype))  # [N k, E, C]
    rows = jnp.repeat(x, k, axis=0)
    slots = jnp.einsum("pec,pd->ecd", dispatch, rows)
    gate = jnp.einsum("ecd,edf->ecf", slots, w["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", slots, w["w_up"])
    out = jnp.einsum("ecf,efd->ecd", act(gate, up), w["w_down"])
    combined = jnp.einsum("pec,ecd->pd", dispatch, out)
    return combined.reshape(n, k, -1), 1.0 - jnp.mean(jnp.any(kept, axis=-1).astype(jnp.float32))


def mgpu(x, chosen, w, act):
    """jax's Mosaic GPU ragged dot in place of jax.lax.ragged_dot (the rows sorted by expert as seqjax sorts)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # (Hopper only; imported where asked for)

    n, k = chosen.shape
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w["w_gate"].shape[0]).astype(jnp.int32)
    rows = x[order // k]
    dot = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, block_m=128, block_n=128, block_k=64,
                            max_concurrent_steps=4, grid_block_n=1)  # (its own example's tile sizes)
    hidden = act(dot(rows, w["w_gate"]), dot(rows, w["w_up"]))
    out = dot(hidden, w["w_down"])
    return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)


def timed(fn, args, repeats: int) -> tuple[float, int | None]:
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, getattr(memory, "temp_size_in_bytes", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="cpu")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", default="ragged_dot,blocked,dense,onehot,ragged_dot_mgpu")
    args = p.parse_args()
    shape = {**SHAPES[args.shape], **({"tokens": args.tokens} if args.tokens else {}),
             **({"experts": args.experts} if args.experts else {})}
    n, d, e, f, k = (shape[key] for key in ("tokens", "d_model", "experts", "d_ff", "top_k"))
    dtype = jnp.dtype(shape["dtype"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, d)), dtype)
    w = {name: jnp.asarray(rng.standard_normal(s) / math.sqrt(s[1]), dtype) for name, s in
         (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d)))}
    logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
    weights, chosen = jax.lax.top_k(jax.nn.softmax(logits), k)
    act = ACTIVATIONS["swiglu"]
    capacity = math.ceil(args.capacity_factor * n * k / e)
    impls = {"ragged_dot": lambda x, w: DISPATCH["ragged_dot"](x, chosen, w, act),
             "blocked": lambda x, w: DISPATCH["blocked"](x, chosen, w, act),
             "dense": lambda x, w: DISPATCH["dense"](x, chosen, w, act),
             "onehot": lambda x, w: onehot(x, chosen, w, act, capacity)[0],
             "ragged_dot_mgpu": lambda x, w: mgpu(x, chosen, w, act)}
    results = []
    reference = None
    for name in args.impls.split(","):
        def loss(x, w, run=impls[name]):
            out = jnp.einsum("nk,nkd->nd", weights, run(x, w).astype(jnp.float32))
            return jnp.sum(out * out)

        row = {"impl": name}
        try:
            row["fwd_ms"] = round(timed(loss, (x, w), args.repeats)[0], 3)
            value = float(jax.jit(loss)(x, w))
            step = jax.value_and_grad(loss, argnums=(0, 1))
            ms, temp = timed(step, (x, w), args.repeats)
            row |= {"fwd_bwd_ms": round(ms, 3), "temp_bytes": temp}
        except Exception as err:  # noqa: BLE001  (a peer that does not run here: recorded, not fatal)
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        if "fwd_ms" not in row:
            results.append(row)
            print(json.dumps(row), flush=True)
            continue
        row["loss"] = value
        reference = reference if reference is not None else value
        row["loss_rel_diff"] = abs(value - reference) / max(abs(reference), 1e-30)
        if name == "onehot":
            row["dropped_pairs"] = float(jax.jit(lambda x, w: onehot(x, chosen, w, act, capacity)[1])(x, w))
            row["capacity"] = capacity
        results.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"bench": "moe", "shape": {**shape, "name": args.shape}, "device": jax.devices()[0].device_kind,
                      "platform": jax.default_backend(), "jax": jax.__version__, "host": platform.node(),
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "results": results}))


if __name__ == "__main__":
    main()
