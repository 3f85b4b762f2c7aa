"""Preference pairs packed against padded: padding, non-padding tokens/s and step time of LoRA DPO (JSON).

    python scripts/bench_preference.py                                       # seqjax's layouts, CPU
    python scripts/bench_preference.py --trl-python /path/to/torch/env/bin/python   # and TRL's DPOTrainer

The pairs are written here: prompts with a lognormal length of median ``--prompt-median`` tokens (multi-turn
chats: long and uneven), completions of median ``--completion-median``, random words of a word-level vocabulary
(one token a word, so every side tokenizes them to the same ids). The same pairs and the same model (a small
Qwen3 shape, LoRA rank 16 on all seven projections, DPO against the base with adapters off, float32) run, side
by side in one run, as:

- ``packed``: pairs packed whole into rows of ``--seq-len`` (``data.strategy=pack``, best_fit);
- ``shared_prompt``: the same, each prompt packed once (``data.shared_prompt``);
- ``pair_per_row``: one pair per row of ``--seq-len``, padded (``data.max_segments_per_row=2``);
- ``trl_layout``: what TRL and Tunix feed the model, each sequence its own row padded to its batch's longest
  (``--pairs-per-step`` pairs a batch, widths rounded up to 64 so the step compiles a few times, not every batch),
  through the same step (a timing layout: its chosen and rejected rows are apart, so its loss is not DPO's);
- ``trl``: TRL 1.16's DPOTrainer itself (torch, peft) on the same pairs and model shape, where
  ``--trl-python`` names an interpreter that has them.

Each reports padding (``1 - real tokens / row slots``; for the packers over the whole epoch's plan), and, timed
over ``--steps`` steps after a warm-up, step time, pairs/s and non-padding tokens/s (the prompt counted once per
sequence it is in: the work every layout does; the shared prompt does less of it). The last stdout line is one
JSON object.
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
RANK, ALPHA, BETA = 16, 32, 0.1


def pair_ids(n: int, prompt_median: int, completion_median: int, limit: int, vocab: int, seed: int):
    """``n`` (prompt, chosen, rejected) id lists; every sequence at most ``limit`` ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(np.clip(rng.lognormal(np.log(prompt_median), 0.8), 4, limit // 2))
        c, r = (int(np.clip(rng.lognormal(np.log(completion_median), 0.7), 2, limit - p)) for _ in range(2))
        out.append(tuple(list(rng.integers(3, vocab, k)) for k in (p, c, r)))
    return out


def config_for(layout: str, args, extra=()):
    from seqjax.config.load import load_config

    model = [f"model.{k}={v}" for k, v in SHAPES[args.shape].items()]
    layouts = {"packed": [], "shared_prompt": ["data.shared_prompt=true"],
               "pair_per_row": ["data.max_segments_per_row=2"]}
    return load_config(None, [
        "data.corpus=jsonl", "data.format=preference", "data.train_files=[x.jsonl]", "data.strategy=pack",
        "data.packer=best_fit", f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch}",
        f"model.vocab_size={args.vocab}", f"model.max_seq_len={args.seq_len}", f"model.attention={args.attention}",
        f"model.compute_dtype={args.dtype}", f"model.param_dtype={args.dtype}",
        "model.qk_norm=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "train.objective=dpo",
        f"train.beta={BETA}", "train.lr=1e-4", "train.warmup_steps=0", *model, *layouts.get(layout, []), *extra])


def step_runner(config):
    """A jitted DPO step of ``config``'s model and LoRA, against the base with adapters off."""
    import jax
    from flax import nnx

    from seqjax.model import build_model, split_params
    from seqjax.model.lora import adapters_off
    from seqjax.objectives import resolve
    from seqjax.train.optimizer import build_optimizer
    from seqjax.train.step import make_train_step

    graphdef, params, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    params, frozen = nnx.to_pure_dict(params), nnx.to_pure_dict(frozen)
    tx, _ = build_optimizer(config.train)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=1, objective=resolve(["dpo"]),
                                   settings={"beta": BETA, "label_smoothing": 0.0},
                                   reference_graphdef=adapters_off(graphdef, params, frozen, rest)))
    state = {"params": params, "opt": tx.init(params)}

    def run(batch):
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch, None, 0, frozen)
        return metrics

    return run


def timed(run, batches: list, steps: int, pair_count, real_tokens) -> dict:
    """Step time, pairs/s and non-padding tokens/s over ``steps`` steps after one warm-up step per shape."""
    import jax

    seen = set()
    for b in batches:
        shape = b["inputs"].shape
        if shape not in seen:
            jax.block_until_ready(run(b)["loss"])
            seen.add(shape)
    chosen = [batches[i % len(batches)] for i in range(steps)]
    start = time.perf_counter()
    for b in chosen:
        metrics = run(b)
    jax.block_until_ready(metrics["loss"])
    seconds = time.perf_counter() - start
    pairs, tokens = sum(map(pair_count, chosen)), sum(map(real_tokens, chosen))
    return {"step_s": round(seconds / steps, 4), "pairs_per_s": round(pairs / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1)}


def seqjax_layout(layout: str, pairs, args) -> dict:
    from seqjax.data.pipeline import build_pipeline
    from seqjax.data.plan import EpochPlanner
    from seqjax.store.reader import TokenStore

    docs, weights = [], []
    for p, c, r in pairs:
        for completion in (c, r):
            docs.append(p + completion)
            weights.append([0] * len(p) + [1] * len(completion))
    store = TokenStore.from_documents(docs, eot_id=0, vocab_size=args.vocab, weights=weights)
    config = config_for(layout, args)
    plan = EpochPlanner(config, store).plan(0)
    slots = plan.num_batches * args.batch * args.seq_len
    import jax.numpy as jnp

    pipeline = iter(build_pipeline(config, store))
    batches = [{k: jnp.asarray(v) for k, v in next(pipeline).items()} for _ in range(min(args.steps, plan.num_batches))]

    def pair_count(b):
        return int(np.asarray(b["pair_ids"]).max(axis=1).sum() // 2)

    def real_tokens(b):  # each sequence's tokens, the prompt counted in both (the work every layout does)
        seg, pid = np.asarray(b["segment_ids"]), np.asarray(b["pair_ids"])
        return int((seg > 0).sum() + (pid == 0)[seg > 0].sum())

    row = {"padding": round(1 - float(plan.lengths.sum() - len(plan.lengths)) / slots, 4),
           "rows_per_epoch": int(plan.num_rows)}
    return {**row, **timed(step_runner(config), batches, args.steps, pair_count, real_tokens)}


def trl_layout(pairs, args) -> dict:
    """Each sequence its own row, padded to its batch's longest (rounded up to 64), pairs in order."""
    import jax.numpy as jnp

    batches, slots, real = [], 0, 0
    for i in range(0, len(pairs), args.pairs_per_step):
        group = pairs[i : i + args.pairs_per_step]
        seqs = [(p + c, len(p)) for p, c, _ in group] + [(p + r, len(p)) for p, _, r in group]
        width = -(-max(len(s) for s, _ in seqs) // 64) * 64
        b = {k: np.zeros((len(seqs), width), np.int32 if k != "weights" else np.float32)
             for k in ("inputs", "targets", "segment_ids", "positions", "weights", "pair_ids")}
        for row, (s, n) in enumerate(seqs):
            m = len(s) - 1
            b["inputs"][row, :m], b["targets"][row, :m] = s[:-1], s[1:]
            b["segment_ids"][row, :m], b["positions"][row, :m] = 1, np.arange(m)
            b["weights"][row, n - 1 : m] = 1
            b["pair_ids"][row, :m] = 1 if row < len(group) else 2
        slots, real = slots + b["inputs"].size, real + sum(len(s) - 1 for s, _ in seqs)
        if len(batches) < args.steps:  # (padding over the whole epoch; the timed steps: the first ones)
            batches.append({k: jnp.asarray(v) for k, v in b.items()})
    config = config_for("trl", args)
    run = step_runner(config)

    def pair_count(b):
        return b["inputs"].shape[0] // 2

    def real_tokens(b):
        return int((np.asarray(b["segment_ids"]) > 0).sum())

    return {"padding": round(1 - real / slots, 4), **timed(run, batches, args.steps, pair_count, real_tokens)}


def trl_worker(spec: dict) -> dict:
    """(Run with --trl-worker under an interpreter with torch, transformers, peft and TRL.)"""
    import datasets
    import peft
    import tokenizers
    import torch
    import transformers
    import trl

    torch.manual_seed(0)
    folder = Path(spec["folder"])
    vocab = {f"w{i}": i for i in range(spec["vocab"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w1")
    m = spec["model"]
    config = transformers.Qwen3Config(vocab_size=spec["vocab"], hidden_size=m["d_model"],
                                      num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                                      num_key_value_heads=m["n_kv_heads"],
                                      head_dim=m["head_dim"], intermediate_size=m["d_ff"],
                                      max_position_embeddings=spec["seq_len"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    rows = [{"prompt": " ".join(f"w{i}" for i in p) + " ", "chosen": " ".join(f"w{i}" for i in c) + " ",
             "rejected": " ".join(f"w{i}" for i in r) + " "}  # (TRL appends the EOS text "w2" to each completion)
            for p, c, r in json.loads((folder / "pairs.json").read_text())]
    args = trl.DPOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=spec["pairs_per_step"],
                         max_length=spec["seq_len"] // 2, learning_rate=1e-4, max_steps=spec["steps"] + 1,
                         logging_steps=1, bf16=False, gradient_checkpointing=False, report_to=[], use_cpu=True,
                         save_strategy="no", beta=BETA)
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
    times, tokens, slots = [], 0, 0

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Clock())
    for batch in list(trainer.get_train_dataloader())[: spec["steps"] + 1]:
        tokens, slots = tokens + int(batch["attention_mask"].sum()), slots + batch["attention_mask"].numel()
    trainer.train()
    seconds = sum(times[1:])  # (the first step warms up)
    steps = len(times) - 1
    return {"padding": round(1 - tokens / slots, 4), "step_s": round(seconds / steps, 4),
            "pairs_per_s": round(steps * spec["pairs_per_step"] / seconds, 2),
            "tokens_per_s": round(tokens / (steps + 1) * steps / seconds, 1), "trl": trl.__version__,
            "torch": torch.__version__}


def progress(result: dict, name: str, started: float) -> None:
    """A part's figures on stderr as it ends: a run cut at a time limit (the GPU suite's stages) keeps them."""
    print(f"# {name} ({time.perf_counter() - started:.1f} s in): {json.dumps(result[name])}", file=sys.stderr,
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--prompt-median", type=int, default=300)
    p.add_argument("--completion-median", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="rows of --seq-len a step (the packed layouts)")
    p.add_argument("--pairs-per-step", type=int, default=4, help="pairs a step (the padded layouts)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=tuple(SHAPES), default="small", help="the model: toy, small (default), 1b "
                   "(Llama-3.2-1B's blocks)")
    p.add_argument("--attention", default="auto", help="model.attention (a shared prompt runs on xla whatever it says)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--trl-python", help="an interpreter with torch, transformers, peft and TRL: adds TRL's run")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        print(json.dumps(trl_worker(json.loads(Path(args.trl_worker).read_text()))))
        return
    started = time.perf_counter()
    pairs = pair_ids(args.pairs, args.prompt_median, args.completion_median, args.seq_len // 2, args.vocab, args.seed)
    result = {"pairs": args.pairs, "seq_len": args.seq_len, "model": SHAPES[args.shape], "lora_rank": RANK,
              "prompt_tokens_mean": float(np.mean([len(p) for p, _, _ in pairs])),
              "completion_tokens_mean": float(np.mean([len(c) + len(r) for _, c, r in pairs]) / 2)}
    for layout in ("packed", "shared_prompt", "pair_per_row"):
        result[layout] = seqjax_layout(layout, pairs, args)
        progress(result, layout, started)
    result["trl_layout"] = trl_layout(pairs, args)
    if args.trl_python:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "pairs.json").write_text(json.dumps([[list(map(int, x)) for x in pair] for pair in pairs]))
            spec = {"folder": tmp, "vocab": args.vocab, "model": SHAPES[args.shape], "seq_len": args.seq_len,
                    "pairs_per_step": args.pairs_per_step, "steps": args.steps}
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            done = subprocess.run([args.trl_python, __file__, "--trl-worker", str(Path(tmp) / "spec.json")],
                                  capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            result["trl"] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    import jax

    result |= {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
               "backend": jax.default_backend(), "command": " ".join(sys.argv)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
