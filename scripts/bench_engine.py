"""The generation engine against the samplers a user had before it and transformers' generate, side by side in
one run (JSON).

    python scripts/bench_engine.py                                           # the engine, and seqjax before it
    python scripts/bench_engine.py --torch-python /path/to/torch/env/bin/python   # and transformers' generate

Two workloads on bench_grpo's small Qwen3 shape (d_model 256, 4 layers, float32, random weights), prompts of a
lognormal length (median ``--prompt-median``), ``--generations`` completions each:

- ``fixed``: every completion ``--max-new`` tokens (no stop): bench_grpo's sampling row;
- ``grpo``: completions that stop at any of ``--stop-ids`` ids (the first ones of the vocabulary), so their
  lengths run from a token to ``--max-new``, as an RL batch's do (a random model draws each stop id with
  probability about 1 / vocab a token).

Samplers:

- ``engine``: seqjax.engine (packed prefill, paged KV cache with each prompt's pages shared by its group,
  continuous batching over ``--slots`` slots);
- ``static_rollouts`` and ``static_generate``: seqjax's samplers before the engine, run from a git worktree of
  ``--before`` (the commit before the engine): the static batch holding each prompt's cache G times, in one
  device loop; and the generate command's host loop over the prompts written out G times;
- ``transformers``: ``generate(num_return_sequences=G, do_sample=True)`` on the same shape, where
  ``--torch-python`` names an interpreter with torch and transformers.

Each reports new tokens/s (after a warm-up run), the share of decode slot-steps that drew a real token (the
static batch's is its real tokens over rows x the longest row's steps), and the KV bytes a group holds. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "d_ff": 1024}
BEFORE = "c2af91e"  # (main before the engine: seqjax.model.decode's samplers)


def prompts_of(args) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(args.prompt_median), 0.6, args.prompts), 4, 2 * args.prompt_median)
    return [rng.integers(args.stops + 1, args.vocab, int(n)).tolist() for n in lengths]


def config_overrides(args) -> list[str]:
    seq = 2 * args.prompt_median + args.max_new + 64
    return [*(f"model.{k}={v}" for k, v in SHAPE.items()), f"model.vocab_size={args.vocab}", f"model.max_seq_len={seq}",
            f"data.seq_len={seq}", "model.attention=xla", "model.qk_norm=true"]


def timed(call) -> tuple[float, object]:
    call(0)  # (compiles)
    start = time.perf_counter()
    made = call(1)
    return time.perf_counter() - start, made


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
    kv_token = 2 * config.model.n_layers * config.model.kv_heads * config.model.head_dim * 4
    out = {}
    if spec["engine"]:
        from seqjax.config.engine import EngineConfig
        from seqjax.engine import Engine

        engine = Engine(model, EngineConfig(slots=spec["slots"], page_size=spec["page_size"]))
        for name, stop in (("fixed", []), ("grpo", stops)):
            seconds, made = timed(lambda key, stop=stop: engine.run(
                prompts, max_new_tokens=new, stop_ids=stop, sampling=sampling, key=jax.random.key(key), copies=g))
            tokens = sum(len(c.tokens) for c in made)
            size = spec["page_size"]
            group_pages = np.mean([-(-len(p) // size) + sum(
                -(-(len(p) % size + len(c.tokens)) // size) - (len(p) % size > 0) for c in made[i * g:(i + 1) * g])
                for i, p in enumerate(prompts)])
            out[name] = {"engine": {"seconds": round(seconds, 3), "new_tokens": tokens,
                                    "new_tokens_per_s": round(tokens / seconds, 1),
                                    "slot_use": round(engine.stats["slot_use"], 4), "slots": engine.stats["slots"],
                                    "kv_bytes_per_group": int(group_pages * size * kv_token)}}
        return out
    from seqjax.model.decode import generate, sample_rollouts

    width = max(len(p) for p in prompts) + new
    for name, stop in (("fixed", []), ("grpo", stops)):
        runs = {"static_rollouts": lambda key, stop=stop: sample_rollouts(
                    model, prompts, stop_ids=stop, max_new_tokens=new, sampling=sampling, key=jax.random.key(key),
                    copies=g),
                "static_generate": lambda key, stop=stop: generate(
                    model, [p for p in prompts for _ in range(g)], eot_id=stop or None, max_new_tokens=new,
                    sampling=sampling, seed=key)}
        out[name] = {}
        for sampler, call in runs.items():
            seconds, made = timed(call)
            lengths = [len(m.tokens) + (sampler == "static_generate" and m.stopped) for m in made]
            out[name][sampler] = {"seconds": round(seconds, 3), "new_tokens": sum(lengths),
                                  "new_tokens_per_s": round(sum(lengths) / seconds, 1),
                                  "slot_use": round(sum(lengths) / (len(lengths) * max(lengths)), 4),
                                  "kv_bytes_per_group": g * width * kv_token}
    return out


def transformers_worker(spec: dict) -> dict:
    """(Under --torch-python.) transformers' generate with num_return_sequences on the same shape."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=spec["vocab"], hidden_size=SHAPE["d_model"],
                                      num_hidden_layers=SHAPE["n_layers"], num_attention_heads=SHAPE["n_heads"],
                                      num_key_value_heads=SHAPE["n_kv_heads"], head_dim=SHAPE["head_dim"],
                                      intermediate_size=SHAPE["d_ff"], max_position_embeddings=4096)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts, g, new = spec["prompts"], spec["generations"], spec["max_new"]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = {}
    for name, stops in (("fixed", None), ("grpo", list(range(1, spec["stops"] + 1)))):
        def run(stops=stops):
            return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=new,
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
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **({"PYTHONPATH": path} if path else {})}
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", default=BEFORE, help="the commit whose static samplers run beside the engine")
    p.add_argument("--torch-python", help="an interpreter with torch and transformers: adds their generate")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        print(json.dumps(transformers_worker(spec) if spec.get("torch") else seqjax_samplers(spec)))
        return
    prompts = prompts_of(args)
    spec = {"overrides": config_overrides(args), "prompts": prompts, "generations": args.generations,
            "max_new": args.max_new, "stops": args.stops, "slots": args.slots, "page_size": args.page_size,
            "vocab": args.vocab, "engine": True}
    result: dict = {}
    merge(result, in_subprocess(sys.executable, spec, str(REPO)))
    with tempfile.TemporaryDirectory() as tree:
        added = subprocess.run(["git", "worktree", "add", "--detach", tree, args.before], cwd=REPO,
                               capture_output=True, text=True)
        if added.returncode == 0:
            try:
                merge(result, in_subprocess(sys.executable, {**spec, "engine": False}, tree))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)
        else:
            result["static_error"] = added.stderr.strip()[:300]
    if args.torch_python:
        merge(result, in_subprocess(args.torch_python, {**spec, "torch": True}))
    summary = {"bench": "engine", "shape": SHAPE, "prompts": args.prompts, "generations": args.generations,
               "prompt_tokens_mean": round(float(np.mean([len(q) for q in prompts])), 1), "max_new": args.max_new,
               "vocab": args.vocab, "stop_ids": args.stops, "slots": args.slots, "page_size": args.page_size,
               "before": args.before, "host": platform.node(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **result}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
