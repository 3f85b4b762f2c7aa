"""The generation engine against the samplers a user had before it and transformers' generate, side by side in
one run (JSON).

    python scripts/bench_engine.py                                           # the engine, and seqjax before it
    python scripts/bench_engine.py --torch-python /path/to/torch/env/bin/python   # and transformers' generate

Two workloads on a Qwen3 shape with random weights (``--shape``: ``small``, bench_grpo's d_model 256 and 4
layers in float32, the CPU's; ``1b`` and ``8b``, Llama-3.2-1B's and Llama-3.1-8B's, the GPU suite's engine
stage with ``--dtype bfloat16 --samplers engine --hbm-gb-s``), prompts of a lognormal length (median
``--prompt-median``), ``--generations`` completions each:

- ``fixed``: every completion ``--max-new`` tokens (no stop): bench_grpo's sampling row;
- ``grpo``: completions that stop at any of ``--stop-ids`` ids (the first ones of the vocabulary), so their
  lengths run from a token to ``--max-new``, as an RL batch's do (a random model draws each stop id with
  probability about 1 / vocab a token).

``--workloads`` picks (both by default; the GPU suite's stage times ``fixed`` first, every slot decoding).

Samplers:

- ``engine``: seqjax.engine (packed prefill, paged KV cache with each prompt's pages shared by its group,
  continuous batching over ``--slots`` slots);
- ``static_rollouts`` and ``static_generate``: seqjax's samplers before the engine, run from a git worktree of
  ``--before`` (the commit before the engine): the static batch holding each prompt's cache G times, in one
  device loop; and the generate command's host loop over the prompts written out G times;
- ``transformers``: ``generate(num_return_sequences=G, do_sample=True)`` on the same shape, where
  ``--torch-python`` names an interpreter with torch and transformers.

With ``--hbm-gb-s`` the engine's rows add the decode's bandwidth bound (each step reading the weights and
every slot's keys and values once) and the share of it measured. Each reports new tokens/s (after a warm-up
run), the share of decode slot-steps that drew a real token (the static batch's is its real tokens over rows x
the longest row's steps), and the KV bytes a group holds. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # small: bench_grpo's CPU shape; 1b and 8b: Llama-3.2-1B's and Llama-3.1-8B's (the GPU suite's)
    "small": {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "d_ff": 1024},
    "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "head_dim": 64, "d_ff": 8192},
    "8b": {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "d_ff": 14336},
}
BEFORE = "c2af91e"  # (main before the engine: seqjax.model.decode's samplers)


def prompts_of(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(args.prompt_median), 0.6, args.prompts), 4, 2 * args.prompt_median)
    return [rng.integers(args.stops + 1, args.vocab, int(n)).tolist() for n in lengths]


def config_overrides(args) -> list[str]:
    seq = 2 * args.prompt_median + args.max_new + 64
    dtype = [f"model.param_dtype={args.dtype}", f"model.compute_dtype={args.dtype}"] if args.dtype else []
    return [*(f"model.{k}={v}" for k, v in SHAPES[args.shape].items()), f"model.vocab_size={args.vocab}",
            f"model.max_seq_len={seq}", f"data.seq_len={seq}", "model.attention=xla", "model.qk_norm=true", *dtype,
            f"model.scan_layers={str(args.scan_layers).lower()}"]


HBM_GB_S = {"H100": 3350.0, "H200": 4800.0}  # the SXM parts' memory bandwidth, GB/s (NVIDIA's data sheets)


def hbm_gb_s(value: str) -> float:
    """``--hbm-gb-s``: a number, or ``auto``: the first device's by its kind (0 when unknown)."""
    if value != "auto":
        return float(value)
    import jax

    kind = jax.devices()[0].device_kind
    return next((gb for name, gb in HBM_GB_S.items() if name in kind), 0.0)


def bandwidth_bound(spec: dict, model, row: dict, bandwidth: float) -> dict:
    """The decode's bound where every step reads the weights and each slot's keys and values once from
    memory of ``--hbm-gb-s``: new tokens/s at the run's mean context (prompt + half the mean
    completion), and the share of it measured. (A bound on decode alone: the figure measured includes
    the prefill.)"""
    from seqjax.model.transformer import param_count

    cfg = model.cfg
    itemsize = jnp_itemsize(cfg.param_dtype)
    weights = param_count(model)["total"] * itemsize
    sequences = len(spec["prompts"]) * spec["generations"]
    context = np.mean([len(p) for p in spec["prompts"]]) + row["new_tokens"] / sequences / 2
    kv = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * jnp_itemsize(cfg.compute_dtype) * context
    bound = row["slots"] * bandwidth * 1e9 / (weights + row["slots"] * kv)
    return {"hbm_gb_s": bandwidth, "bandwidth_bound_new_tokens_per_s": round(float(bound), 1),
            "share_of_bound": round(row["new_tokens_per_s"] / float(bound), 4), "weight_bytes": int(weights)}


def jnp_itemsize(dtype: str) -> int:
    return np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize


def timed(call) -> tuple[float, object, float]:
    """(seconds of a second call, what it made, seconds of the first: its compile included)."""
    start = time.perf_counter()
    call(0)  # (compiles)
    first = time.perf_counter() - start
    start = time.perf_counter()
    made = call(1)
    return time.perf_counter() - start, made, first


def seqjax_samplers(spec: dict) -> dict:
    """The samplers of the seqjax on sys.path: the engine (this tree) or the static ones (--before's tree)."""
    import jax
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.model import build_model
    from seqjax.model.sampling import SamplingConfig

    config = load_config(None, spec["overrides"])
    model = build_model(config, rngs=nnx.Rngs(0))
    prompts, g, new = spec["prompts"], spec["generations"], spec["max_new"]
    stops = list(range(1, spec["stops"] + 1))
    sampling = SamplingConfig(temperature=1.0)
    kv_token = (2 * config.model.n_layers * config.model.kv_heads * config.model.head_dim
                * jnp_itemsize(config.model.compute_dtype))
    out = {}
    if spec["engine"]:
        from seqjax.config.engine import EngineConfig
        from seqjax.engine import Engine
        from seqjax.engine.engine import decode_attention

        engine = Engine(model, EngineConfig(slots=spec["slots"], page_size=spec["page_size"],
                                            attention=spec.get("attention", "auto"),
                                            shrink_to=spec.get("shrink_to", EngineConfig.shrink_to),
                                            prefill_tokens=spec.get("prefill_tokens", EngineConfig.prefill_tokens)))
        for name, stop in workloads(spec, [], stops):
            seconds, made, first = timed(lambda key, stop=stop: engine.run(
                prompts, max_new_tokens=new, stop_ids=stop, sampling=sampling, key=jax.random.key(key), copies=g))
            tokens = sum(len(c.tokens) for c in made)
            size = spec["page_size"]
            group_pages = np.mean([-(-len(p) // size) + sum(
                -(-(len(p) % size + len(c.tokens)) // size) - (len(p) % size > 0) for c in made[i * g:(i + 1) * g])
                for i, p in enumerate(prompts)])
            out[name] = {"engine": {"seconds": round(seconds, 3), "first_call_s": round(first, 2), "new_tokens": tokens,
                                    "new_tokens_per_s": round(tokens / seconds, 1),
                                    "slot_use": round(engine.stats["slot_use"], 4), "slots": engine.stats["slots"],
                                    "waves": engine.stats["waves"], "pieces": engine.stats.get("pieces", 0),
                                    "attention": decode_attention(engine.config.attention),
                                    "backend": jax.default_backend(), "devices": jax.device_count(),
                                    "kv_bytes_per_group": int(group_pages * size * kv_token)}}
            bandwidth = hbm_gb_s(spec["hbm_gb_s"])
            if bandwidth:
                out[name]["engine"] |= bandwidth_bound(spec, model, out[name]["engine"], bandwidth)
        return out
    from seqjax.model.decode import generate, sample_rollouts

    width = max(len(p) for p in prompts) + new
    for name, stop in workloads(spec, [], stops):
        runs = {"static_rollouts": lambda key, stop=stop: sample_rollouts(
                    model, prompts, stop_ids=stop, max_new_tokens=new, sampling=sampling, key=jax.random.key(key),
                    copies=g),
                "static_generate": lambda key, stop=stop: generate(
                    model, [p for p in prompts for _ in range(g)], eot_id=stop or None, max_new_tokens=new,
                    sampling=sampling, seed=key)}
        out[name] = {}
        for sampler, call in runs.items():
            seconds, made, _ = timed(call)
            lengths = [len(m.tokens) + (sampler == "static_generate" and m.stopped) for m in made]
            out[name][sampler] = {"seconds": round(seconds, 3), "new_tokens": sum(lengths),
                                  "new_tokens_per_s": round(sum(lengths) / seconds, 1),
                                  "slot_use": round(sum(lengths) / (len(lengths) * max(lengths)), 4),
                                  "kv_bytes_per_group": g * width * kv_token}
    return out


WORKLOADS = ("fixed", "grpo")


def workloads(spec: dict, no_stop, stops) -> list[tuple[str, object]]:
    """The workloads ``--workloads`` names, each with its stop ids: ``fixed`` (``no_stop``), ``grpo``."""
    return [(name, stop) for name, stop in (("fixed", no_stop), ("grpo", stops))
            if name in spec.get("workloads", WORKLOADS)]


def transformers_worker(spec: dict) -> dict:
    """(Under --torch-python.) transformers' generate with num_return_sequences on the same shape."""
    import torch
    import transformers

    torch.manual_seed(0)
    shape = SHAPES[spec["shape"]]
    config = transformers.Qwen3Config(vocab_size=spec["vocab"], hidden_size=shape["d_model"],
                                      num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
                                      num_key_value_heads=shape["n_kv_heads"], head_dim=shape["head_dim"],
                                      intermediate_size=shape["d_ff"], max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts, g, new = spec["prompts"], spec["generations"], spec["max_new"]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = {}
    for name, stops in workloads(spec, None, list(range(1, spec["stops"] + 1))):
        def run(stops=stops):
            # (top_k=0: the full distribution, as the engine's default samples; transformers' default filters to 50)
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=new,
                                  num_return_sequences=g, pad_token_id=0, eos_token_id=stops,
                                  **({"min_new_tokens": new} if stops is None else {}))

        with torch.no_grad():
            run()
            start = time.perf_counter()
            made = run()[:, width:]
            seconds = time.perf_counter() - start
        if stops is None:
            tokens = made.numel()
        else:
            ended = torch.isin(made, torch.tensor(stops))
            first = torch.where(ended.any(1), ended.float().argmax(1) + 1, torch.full((made.shape[0],), new))
            tokens = int(first.sum())
        out[name] = {"transformers": {"seconds": round(seconds, 3), "new_tokens": int(tokens),
                                      "new_tokens_per_s": round(int(tokens) / seconds, 1)}}
    return out


def in_subprocess(python: str, spec: dict, path: str | None = None) -> dict:
    """``spec``'s samplers in a fresh ``python``, with the caller's environment (its platform and paths: on the
    GPU suite's machine the GPU and the suite's installed wheels) and ``path`` first on its PYTHONPATH."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([python, __file__, "--worker", f.name], capture_output=True, text=True, env=env,
                          cwd=path or REPO, timeout=3600)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def merge(into: dict, part: dict) -> None:
    for workload, rows in part.items():
        if isinstance(rows, dict):
            into.setdefault(workload, {}).update(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-median", type=int, default=200)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--stops", type=int, default=24, help="the grpo workload's stop ids: 1 .. this")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--shrink-to", type=int, default=None, help="engine.shrink_to (default: the config's)")
    p.add_argument("--attention", choices=["auto", "xla", "pallas"], default="auto",
                   help="the engine's decode attention over the pages (engine.attention)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-layers", action="store_true",
                   help="model.scan_layers=true: the blocks stacked, the engine's decode step scanned over them")
    p.add_argument("--before", default=BEFORE, help="the commit whose static samplers run beside the engine")
    p.add_argument("--torch-python", help="an interpreter with torch and transformers: adds their generate")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="(default: the config's)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="which to run: fixed, grpo (both by default)")
    p.add_argument("--samplers", default="engine,static,transformers",
                   help="which to run: engine, static (--before's), transformers (--torch-python)")
    p.add_argument("--hbm-gb-s", default="0",
                   help="the device's memory bandwidth in GB/s (auto: by its kind, an H100's or H200's): adds "
                   "the engine's share of the decode's bandwidth bound")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="engine.prefill_tokens (default: the config's): fewer cut a request into waves")
    p.add_argument("--engine-before", default=None,
                   help="a commit whose engine runs beside this one on the same workload (its rows: engine_before)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        p.error(f"--workloads: got {', '.join(unknown)}, expected among {', '.join(WORKLOADS)}")
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        print(json.dumps(transformers_worker(spec) if spec.get("torch") else seqjax_samplers(spec)))
        return
    prompts = prompts_of(args)
    spec = {"overrides": config_overrides(args), "prompts": prompts, "generations": args.generations,
            "max_new": args.max_new, "stops": args.stops, "slots": args.slots, "page_size": args.page_size,
            "attention": args.attention, **({} if args.shrink_to is None else {"shrink_to": args.shrink_to}),
            **({} if args.prefill_tokens is None else {"prefill_tokens": args.prefill_tokens}),
            "vocab": args.vocab, "engine": True, "shape": args.shape, "workloads": args.workloads.split(","),
            "hbm_gb_s": args.hbm_gb_s}
    result: dict = {}
    samplers = args.samplers.split(",")
    if "engine" in samplers:
        merge(result, in_subprocess(sys.executable, spec, str(REPO)))
    if args.engine_before:
        before = worktree_run(args.engine_before, spec)
        result["engine_before_error"] = before.pop("error", None)
        merge(result, {w: {"engine_before": rows["engine"]} for w, rows in before.items()})
    if "static" in samplers:
        merge(result, static_samplers(args, spec))
    if args.torch_python and "transformers" in samplers:
        merge(result, in_subprocess(args.torch_python, {**spec, "torch": True}))
    summary = {"bench": "engine", "shape": {"name": args.shape, **SHAPES[args.shape]}, "dtype": args.dtype,
               "prompts": args.prompts, "generations": args.generations,
               "prompt_tokens_mean": round(float(np.mean([len(q) for q in prompts])), 1), "max_new": args.max_new,
               "vocab": args.vocab, "stop_ids": args.stops, "slots": args.slots, "page_size": args.page_size,
               "scan_layers": args.scan_layers, "before": args.before, "prefill_tokens": args.prefill_tokens,
               "engine_before": args.engine_before, "host": platform.node(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **result}
    print(json.dumps(summary))


def static_samplers(args, spec: dict) -> dict:
    """seqjax's samplers before the engine, from a git worktree of ``--before``."""
    result = worktree_run(args.before, {**spec, "engine": False})
    if "error" in result:
        result["static_error"] = result.pop("error")
    return result


def worktree_run(commit: str, spec: dict) -> dict:
    """``spec``'s samplers run by the code of ``commit``, from a git worktree of it."""
    result: dict = {}
    with tempfile.TemporaryDirectory() as tree:
        added = subprocess.run(["git", "worktree", "add", "--detach", tree, commit], cwd=REPO,
                               capture_output=True, text=True)
        if added.returncode == 0:
            try:
                part = in_subprocess(sys.executable, spec, tree)
                merge(result, part)
                if "error" in part:  # (merge keeps the workloads' rows only)
                    result["error"] = part["error"]
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)
        else:
            result["error"] = added.stderr.strip()[:300]
    return result


if __name__ == "__main__":
    main()
