"""GRPO's two programs, side by side: a step on the same groups in each layout, and sampling the groups (JSON).

    python scripts/bench_grpo.py                                             # seqjax, CPU
    python scripts/bench_grpo.py --trl-python /path/to/torch/env/bin/python  # and TRL / transformers

The groups are drawn here: ``--prompts`` prompts of a lognormal length of median ``--prompt-median`` tokens, each
with ``--generations`` completions of median ``--completion-median`` (at most ``--max-completion``), random ids.
The same groups and the same model (a small Qwen3 shape, LoRA rank 16 on all seven projections, DAPO, float32)
run as:

- ``prompt_once``: each group in one row, its prompt once, each completion attending to it and to itself
  (``rl.layout=prompt_once``, the default);
- ``prompt_per_completion``: each completion with its own copy of the prompt, packed into rows (Tunix's way);
- ``padded``: one completion a row of ``--seq-len``;
- ``trl_layout``: what TRL feeds its model, one completion a row padded to the step's longest prompt plus
  longest completion (rounded up to 64), through the same step;
- ``trl``: TRL 1.16's GRPOTrainer itself (torch, peft) on the same completions through its ``rollout_func``,
  where ``--trl-python`` names an interpreter that has it.

Each reports padding (``1 - real tokens / row slots``), the tokens the model computes, the flash kernel's
forward tiles a step (the attention's work where it runs: the GPU's ``auto``), and, timed over
``--steps`` steps after a warm-up, step time and completion tokens/s. Sampling (``--generations`` copies of each
prompt, ``--max-completion`` new tokens each, no stop) is timed for seqjax's ``sample_rollouts`` (each prompt
prefilled once, its cache copied to its rows, one device loop), seqjax's ``generate`` on the prompts written out
G times (the host loop the generate command runs), and transformers' ``generate`` with
``num_return_sequences`` (what TRL runs without vLLM), each as new tokens/s after a warm-up. The last stdout
line is one JSON object.
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

SHAPES = {"toy": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "d_ff": 64},
          "small": {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "d_ff": 1024},
          "1b": {"d_model": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "head_dim": 64, "d_ff": 8192}}
RANK, ALPHA = 16, 32
LAYOUTS = ("prompt_once", "prompt_per_completion", "padded")


def draw_groups(args) -> list[tuple[list[int], list[list[int]]]]:
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.prompts):
        n = int(np.clip(rng.lognormal(np.log(args.prompt_median), 0.6), 4, 2 * args.prompt_median))
        completions = [list(map(int, rng.integers(3, args.vocab, int(np.clip(
            rng.lognormal(np.log(args.completion_median), 0.7), 1, args.max_completion)))))
            for _ in range(args.generations)]
        out.append((list(map(int, rng.integers(3, args.vocab, n))), completions))
    return out


def config_for(args, layout: str, seq_len: int | None = None):
    from seqjax.config.load import load_config

    model = [f"model.{k}={v}" for k, v in SHAPES[args.shape].items()]
    return load_config(None, [
        "data.corpus=jsonl", "data.format=prompt", "data.train_files=[x.jsonl]",
        f"data.seq_len={seq_len or args.seq_len}", f"data.batch_size={args.batch}", f"model.vocab_size={args.vocab}",
        f"model.max_seq_len={args.seq_len}",
        f"model.attention={args.attention}", f"model.compute_dtype={args.dtype}", f"model.param_dtype={args.dtype}",
        "model.qk_norm=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "train.objective=dapo",
        f"rl.layout={layout}", f"rl.num_generations={args.generations}",
        f"rl.max_completion_length={args.max_completion}",
        "train.lr=1e-5", "train.warmup_steps=0", *model])


def model_parts(config):
    from flax import nnx

    from seqjax.model import build_model, split_params

    graphdef, params, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(frozen), rest


def step_runner(config):
    """A jitted DAPO step of ``config``'s model and LoRA."""
    import jax

    from seqjax.objectives import resolve, settings_of
    from seqjax.train.optimizer import build_optimizer
    from seqjax.train.step import make_train_step

    graphdef, params, frozen, rest = model_parts(config)
    tx, _ = build_optimizer(config.train)
    objective = resolve(["dapo"])
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=1, objective=objective,
                                   settings=settings_of(config, objective)))
    state = {"params": params, "opt": tx.init(params)}

    def run(batch):
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch, None, 0, frozen)
        return metrics

    return run


def with_rollout_fields(batch: dict) -> dict:
    import jax.numpy as jnp

    rows = len(batch["inputs"])
    out = {k: jnp.asarray(v) for k, v in batch.items()}
    zeros = jnp.zeros(batch["weights"].shape, jnp.float32)
    return out | {"old_logps": zeros, "rollout_reference_logps": zeros, "fresh": jnp.ones((rows, 1), jnp.int32),
                  "reference_is_policy": jnp.zeros((rows, 1), jnp.int32)}


def flash_tiles(batches: list, head_dim: int) -> dict:
    """The flash kernel's forward tiles a step visits (its block sizes for ``head_dim``, from the batches' segment
    and prompt ids): what its time scales with. Under a shared prompt also what one range a query block, from its
    prompt to its diagonal, would visit instead of the prompt's range beside its own."""
    import jax
    import jax.numpy as jnp

    from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata

    sizes, tiles, one_range = BlockSizes.for_head_dim(head_dim), 0, 0
    metadata_of = jax.jit(block_metadata, static_argnums=1)  # (one program a shape, not dozens of eager ops)
    for batch in batches:
        prefix = batch.get("prefix_ids")
        metadata = metadata_of(jnp.asarray(batch["segment_ids"]), sizes, prefix_ids=prefix)
        own = np.asarray(metadata.fwd_kv)
        tiles += int((own[..., 3] - own[..., 0]).sum())
        if prefix is not None:
            prompt = np.asarray(metadata.fwd_prefix)
            tiles += int((prompt[..., 3] - prompt[..., 0]).sum())
            start = np.where(prompt[..., 3] > prompt[..., 0], np.minimum(prompt[..., 0], own[..., 0]), own[..., 0])
            one_range += int((own[..., 3] - start).sum())
    steps = len(batches)
    return {"flash_tiles_per_step": round(tiles / steps, 1),
            **({"flash_tiles_one_range_per_step": round(one_range / steps, 1)} if one_range else {})}


def timed(run, batches: list, steps: int) -> dict:
    import jax

    for b in {b["inputs"].shape: b for b in batches}.values():  # (a warm-up step per shape)
        jax.block_until_ready(run(b)["loss"])
    chosen = [batches[i % len(batches)] for i in range(steps)]
    start = time.perf_counter()
    for b in chosen:
        metrics = run(b)
    jax.block_until_ready(metrics["loss"])
    seconds = time.perf_counter() - start
    completion = sum(float(np.asarray(b["weights"]).sum()) for b in chosen)
    return {"step_s": round(seconds / steps, 4), "completion_tokens_per_s": round(completion / seconds, 1)}


def _groups(chunk) -> list:
    from seqjax.data.rollouts import Group

    return [Group(np.asarray(p), [np.asarray(c) for c in cs], np.linspace(-1, 1, len(cs)).astype(np.float32),
                  np.zeros(len(cs), bool)) for p, cs in chunk]


def seqjax_layout(layout: str, groups, args) -> dict:
    """``--batch`` groups a step in ``layout``: rows of ``--seq-len`` (padded: of the longest prompt plus
    ``--max-completion``, the data.seq_len such a run sets), as many a step as the fullest step needs."""
    from seqjax.data.rollouts import rollout_batches

    longest = max(len(p) for p, _ in groups) + args.max_completion
    width = args.seq_len if layout != "padded" else -(-longest // 64) * 64
    chunks = [_groups(groups[i:i + args.batch]) for i in range(0, len(groups), args.batch)]
    most = args.batch * args.generations
    rows = max(int(np.asarray(rollout_batches(c, layout, width, most, steps=1)[0]["segment_ids"]).any(axis=1).sum())
               for c in chunks)
    batches, slots, real = [], 0, 0
    for chunk in chunks:
        (batch,) = rollout_batches(chunk, layout, width, rows, steps=1)
        slots, real = slots + batch["inputs"].size, real + int((batch["segment_ids"] > 0).sum())
        batches.append(with_rollout_fields(batch))
    config = config_for(args, layout, width)
    return {"padding": round(1 - real / slots, 4), "positions_computed_per_step": round(real / len(batches), 1),
            "rows_per_step": rows, "row_width": width, **flash_tiles(batches, SHAPES[args.shape]["head_dim"]),
            **({} if args.tiles_only else timed(step_runner(config), batches, args.steps))}


def trl_layout(groups, args) -> dict:
    """One completion a row, each step's rows padded to its longest prompt plus longest completion (rounded up to
    64: a few shapes, a few compiles)."""
    from seqjax.data.rollouts import rollout_batches

    batches, slots, real = [], 0, 0
    for i in range(0, len(groups), args.batch):
        chunk = groups[i:i + args.batch]
        width = -(-(max(len(p) for p, _ in chunk) + max(len(c) for _, cs in chunk for c in cs)) // 64) * 64
        (batch,) = rollout_batches(_groups(chunk), "padded", width, len(chunk) * args.generations, steps=1)
        slots, real = slots + batch["inputs"].size, real + int((batch["segment_ids"] > 0).sum())
        batches.append(with_rollout_fields(batch))
    return {"padding": round(1 - real / slots, 4), "positions_computed_per_step": round(real / len(batches), 1),
            **flash_tiles(batches, SHAPES[args.shape]["head_dim"]),
            **({} if args.tiles_only else timed(step_runner(config_for(args, "padded")), batches, args.steps))}


def sampling(groups, args) -> dict:
    """New tokens/s of seqjax's two samplers on the prompts, G completions each, no stop."""
    import jax
    from flax import nnx

    from seqjax.engine import generate, sample_rollouts
    from seqjax.model import build_model
    from seqjax.model.sampling import SamplingConfig

    model = build_model(config_for(args, "prompt_once"), rngs=nnx.Rngs(0))
    prompts = [p for p, _ in groups[:args.batch]]
    cfg = SamplingConfig(temperature=1.0)
    new = len(prompts) * args.generations * args.max_completion
    out = {}
    for name, call in (
            ("sample_rollouts", lambda key: sample_rollouts(
                model, prompts, stop_ids=[], max_new_tokens=args.max_completion, sampling=cfg,
                key=jax.random.key(key), copies=args.generations)),
            ("generate", lambda key: generate(model, [p for p in prompts for _ in range(args.generations)], eot_id=None,
                                              max_new_tokens=args.max_completion, sampling=cfg, seed=key))):
        call(0)  # (compiles)
        start = time.perf_counter()
        made = call(1)
        seconds = time.perf_counter() - start
        assert sum(len(g.tokens) for g in made) == new
        out[name] = {"seconds": round(seconds, 3), "new_tokens_per_s": round(new / seconds, 1)}
    return out


def trl_worker(spec: dict) -> dict:
    """(Run with --trl-worker under an interpreter with torch and transformers, and for TRL's step peft and TRL.)
    transformers' generate and TRL's GRPOTrainer step on the same shapes."""
    import torch
    import transformers

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = spec["model"]
    config = transformers.Qwen3Config(vocab_size=spec["vocab"], hidden_size=m["d_model"],
                                      num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                                      num_key_value_heads=m["n_kv_heads"], head_dim=m["head_dim"],
                                      intermediate_size=m["d_ff"], max_position_embeddings=spec["seq_len"])
    dtype = torch.bfloat16 if spec["dtype"] == "bfloat16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    groups, g, max_new = spec["groups"], spec["generations"], spec["max_completion"]
    prompts = [p for p, _ in groups[:spec["batch"]]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    out = {}

    def sample():
        # (top_k=0: the full distribution, as seqjax samples and TRL's GRPOConfig asks; transformers' default is 50)
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=max_new,
                              min_new_tokens=max_new, num_return_sequences=g, pad_token_id=0)

    with torch.no_grad():
        sample()
        start = time.perf_counter()
        made = sample()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    new = int((made.shape[1] - width) * made.shape[0])
    out["transformers_generate"] = {"seconds": round(seconds, 3), "new_tokens_per_s": round(new / seconds, 1),
                                    "transformers": transformers.__version__, "device": device}
    try:
        out["trl"] = trl_step(spec, model, dtype, device)
    except ImportError as err:  # (the GPU image has no TRL: its generate still counts)
        out["trl"] = {"error": f"not installed: {err.name}"}
    return out


def trl_step(spec: dict, model, dtype, device: str) -> dict:
    """TRL's GRPOTrainer (peft's LoRA) on the groups' completions through its rollout_func: step time."""
    import datasets
    import peft
    import tokenizers
    import torch
    import transformers
    import trl

    groups, g, max_new = spec["groups"], spec["generations"], spec["max_completion"]
    vocab = {f"w{i}": i for i in range(spec["vocab"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w1")
    policy = peft.get_peft_model(model.float() if dtype == torch.float32 else model,
                                 peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    text = {" ".join(f"w{i}" for i in p): (p, cs) for p, cs in groups}
    taken: dict[str, int] = {}

    def rollout(batch_prompts, trainer):
        prompt_ids, completion_ids = [], []
        for p in batch_prompts:
            ids_, cs = text[p]
            k = taken.get(p, 0)
            taken[p] = k + 1
            prompt_ids.append(ids_)
            completion_ids.append(cs[k % g])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": [[0.0] * len(c) for c in completion_ids]}

    def reward(completion_ids, **_):
        return [float(len(c) % 3) for c in completion_ids]

    args = trl.GRPOConfig(output_dir=spec["folder"] + "/trl", per_device_train_batch_size=spec["batch"] * g,
                          num_generations=g, max_completion_length=max_new, learning_rate=1e-5,
                          max_steps=spec["steps"] + 1, logging_steps=1, bf16=dtype == torch.bfloat16, report_to=[],
                          use_cpu=device == "cpu", save_strategy="no", loss_type="dapo", shuffle_dataset=False)
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=[reward], args=args, processing_class=tokenizer,
                              train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in text]),
                              rollout_func=rollout)
    times = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Clock())
    trainer.train()
    seconds = sum(times[1:])
    steps = len(times) - 1
    completion = np.mean([sum(len(c) for c in cs) for _, cs in groups]) * spec["batch"]
    return {"step_s": round(seconds / steps, 4), "completion_tokens_per_s": round(completion * steps / seconds, 1),
            "trl": trl.__version__, "torch": torch.__version__, "device": device}


def progress(result: dict, name: str, started: float) -> None:
    """A part's figures on stderr as it ends: a run cut at a time limit (the GPU suite's stages) keeps them."""
    print(f"# {name} ({time.perf_counter() - started:.1f} s in): {json.dumps(result[name])}", file=sys.stderr,
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-median", type=int, default=200)
    p.add_argument("--completion-median", type=int, default=100)
    p.add_argument("--max-completion", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=2560, help="a row: one group, its prompt once")
    p.add_argument("--batch", type=int, default=4, help="groups a step")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=tuple(SHAPES), default="small")
    p.add_argument("--attention", default="auto", help="model.attention (auto: xla on a CPU, the flash kernel on "
                   "a GPU)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--no-sampling", action="store_true", help="time the steps only")
    p.add_argument("--tiles-only", action="store_true", help="count each layout's positions and flash tiles only "
                   "(no model, no timing, no sampling): the attention's work at shapes a CPU cannot run")
    p.add_argument("--trl-python", help="an interpreter with torch, transformers, peft and TRL: adds their runs")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        print(json.dumps(trl_worker(json.loads(Path(args.trl_worker).read_text()))))
        return
    started = time.perf_counter()
    groups = draw_groups(args)
    result = {"prompts": args.prompts, "generations": args.generations, "seq_len": args.seq_len,
              "model": SHAPES[args.shape], "lora_rank": RANK,
              "prompt_tokens_mean": float(np.mean([len(p) for p, _ in groups])),
              "completion_tokens_mean": float(np.mean([len(c) for _, cs in groups for c in cs]))}
    for layout in LAYOUTS:
        result[layout] = seqjax_layout(layout, groups, args)
        progress(result, layout, started)
    result["trl_layout"] = trl_layout(groups, args)
    if not (args.no_sampling or args.tiles_only):
        result["sampling"] = sampling(groups, args)
        progress(result, "sampling", started)
    if args.trl_python and not args.tiles_only:
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"folder": tmp, "vocab": args.vocab, "model": SHAPES[args.shape], "seq_len": args.seq_len,
                    "groups": groups, "generations": args.generations, "max_completion": args.max_completion,
                    "batch": args.batch, "steps": args.steps, "dtype": args.dtype}
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            done = subprocess.run([args.trl_python, __file__, "--trl-worker", str(Path(tmp) / "spec.json")],
                                  capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            theirs = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
            result["trl"] = theirs.get("trl", theirs)
            if "transformers_generate" in theirs:
                result.setdefault("sampling", {})["transformers_generate"] = theirs["transformers_generate"]
    import jax

    result |= {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "backend": jax.default_backend(), "command": " ".join(sys.argv)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
