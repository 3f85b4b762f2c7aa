"""Reference numbers of TRL 1.16's own GRPOTrainer on fixed completions, on a tiny Qwen3 with LoRA, made by TRL itself.

    python scripts/make_grpo_reference.py --out tests/data/grpo   # needs torch, transformers 5, peft, TRL 1.16

The model and adapter are scripts/make_preference_reference.py's (a tiny Qwen3 built by transformers, peft's LoRA on
its seven projections, both drawn from their names), and so is the tokenizer. Four standard prompts (with a
``target`` column, None on one) get four completions each, drawn here as token ids (some stopped by the EOS, some cut
at ``max_completion_length``), and TRL's GRPOTrainer is given them through its ``rollout_func``, so it scores,
normalizes and trains on exactly these; the reward functions are tests/grpo_rewards.py's (two, weighted 1 and 0.5).
``grpo.json`` holds:

- ``prompts`` and ``completions`` (what seqjax replays through ``rl.rollouts_file``);
- ``cases``: for each loss type (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo), for dapo under each
  ``scale_rewards`` (group, batch, none), with the sequence-level ratio (GSPO) and with ``beta`` 0.1: the first
  batch's advantages and per-token log-probabilities (by prompt and completion), the loss and the gradient's norm
  (``compute_loss``, then ``backward``), and every metric TRL logs for that batch;
- ``rewards``: TRL's built-in ``think_format_reward`` and soft overlong punishment on chosen completions;
- ``curves``: two optimizer steps with ``num_iterations=2`` (the second trains on the same completions with the
  policy moved: the ratio leaves 1, the clip and the KL work), per loss type, TRL's logged loss, grad norm and
  metrics each step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Q: the cat sat on a mat A:", "Q: a dog ran far away A:", "Q: big red house tree A:",
           "Q: small blue river stone A:"]
TARGETS = [12, 20, None, 7]
G, MAX_COMPLETION, LR = 4, 8, 1e-2
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def completions(tokenizer, seed: int = 0) -> list[list[list[int]]]:
    """G completions per prompt: word tokens of the vocabulary, a third of them cut at the limit, the rest closed
    by the EOS."""
    rng = np.random.default_rng(seed)
    specials = set(tokenizer.all_special_ids)
    words = [i for i in range(len(tokenizer)) if i not in specials]
    out = []
    for _ in PROMPTS:
        group = []
        for j in range(G):
            if j % 3 == 2:  # cut at the limit: no EOS
                ids = [int(i) for i in rng.choice(words, MAX_COMPLETION)]
            else:
                ids = [int(i) for i in rng.choice(words, int(rng.integers(1, MAX_COMPLETION)))] + [
                    tokenizer.eos_token_id]
            group.append(ids)
        out.append(group)
    return out


FORMAT_TEXTS = ["<think>\nreasoning\n</think>\nanswer", "<think>reasoning", "answer <think>x</think>",
                "<think>a</think><think>b</think>", "<think>\n</think>", "\n<think>x</think>y",
                "<think>x\n</think>\n\ny\n"]


def built_in_rewards() -> dict:
    """TRL's think_format_reward on chosen texts (conversational, as TRL passes them) and its soft overlong
    punishment (max_completion_len 8, soft_punish_cache 2) on completions of 0 to 10 tokens."""
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    ids = [list(range(n)) for n in range(11)]
    return {"format_texts": FORMAT_TEXTS,
            "think_format_reward": think_format_reward([[{"role": "assistant", "content": t}] for t in FORMAT_TEXTS]),
            "overlong": {"max_completion_len": MAX_COMPLETION, "soft_punish_cache": 2, "lengths": list(range(11)),
                         "rewards": get_soft_overlong_punishment(MAX_COMPLETION, 2)(ids)}}


def trainer(tmp: str, completion_ids, loss_type: str, **settings):
    """TRL's GRPOTrainer on the drawn LoRA policy, the prompts in order, the completions through rollout_func."""
    import datasets
    import torch
    import trl
    from trl.trainer.grpo_trainer import RepeatSampler  # noqa: F401  (the sampler it would shuffle with)

    sys.path.insert(0, str(REPO / "tests"))
    import grpo_rewards

    pref = _script("make_preference_reference")
    policy, _, tokenizer = pref.build(pref.CHAT)
    given: dict[str, list] = {p: list(c) for p, c in zip(PROMPTS, completion_ids)}
    taken: dict[str, int] = {}

    def rollout(prompts, trainer):
        prompt_ids, out = [], []
        for p in prompts:
            k = taken.get(p, 0)
            taken[p] = k + 1
            prompt_ids.append(tokenizer(p)["input_ids"])
            out.append(given[p][k % G])
        return {"prompt_ids": prompt_ids, "completion_ids": out, "logprobs": [[0.0] * len(c) for c in out]}

    args = trl.GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=len(PROMPTS) * G, num_generations=G,
        max_completion_length=MAX_COMPLETION, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1,
        bf16=False, report_to=[], seed=0, use_cpu=True, save_strategy="no", optim="adamw_torch",
        shuffle_dataset=False, loss_type=loss_type, reward_weights=[1.0, 0.5], **settings)
    dataset = datasets.Dataset.from_list([{"prompt": p, "target": t} for p, t in zip(PROMPTS, TARGETS)])
    return trl.GRPOTrainer(model=policy, reward_funcs=[grpo_rewards.even_tokens, grpo_rewards.near_target],
                           args=args, train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout), torch


def first_batch(tmp: str, completion_ids, loss_type: str, **settings) -> dict:
    """The first batch: advantages and per-token log-probabilities by (prompt, completion), loss, grad norm,
    metrics."""
    t, torch = trainer(tmp, completion_ids, loss_type, **settings)
    t.model.train()
    t.current_gradient_accumulation_steps = 1  # what Trainer.train sets before the first step
    inputs = t._prepare_inputs(next(iter(t.get_train_dataloader())))
    loss = t.compute_loss(t.model, inputs)
    loss.backward()
    grads = [p.grad.detach().double() for p in t.model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, mask, inputs["completion_ids"].size(1))
    rows = {}
    for r in range(len(inputs["completion_ids"])):
        ids_r = inputs["completion_ids"][r][inputs["completion_mask"][r].bool()].tolist()
        key = next((f"{p}/{j}" for p, group in enumerate(completion_ids) for j, c in enumerate(group)
                    if c[:len(ids_r)] == ids_r and len(c) >= len(ids_r)), None)
        n = int(inputs["completion_mask"][r].sum())
        rows[key] = {"advantage": float(inputs["advantages"][r]), "logps": logps[r, :n].tolist()}
    return {"loss": float(loss), "grad_norm": norm, "rows": rows,
            "metrics": {k: float(v[-1]) for k, v in t._metrics["train"].items() if v}}


def curve(tmp: str, completion_ids, loss_type: str, **settings) -> list[dict]:
    """Two optimizer steps with num_iterations=2 on the same completions: TRL's logged rows."""
    t, _ = trainer(tmp, completion_ids, loss_type, num_iterations=2, max_steps=2, **settings)
    t.train()
    return [{k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k != "step_time"}
            for row in t.state.log_history if "loss" in row]  # (a wall-clock time: not reproducible)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/grpo"))
    args = p.parse_args()
    import peft
    import torch
    import transformers
    import trl

    pref = _script("make_preference_reference")
    _, _, tokenizer = pref.build(pref.CHAT)
    drawn = completions(tokenizer)
    cases, curves = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss_type in LOSS_TYPES:
            cases[loss_type] = first_batch(tmp, drawn, loss_type)
        for scale in ("batch", "none"):
            cases[f"dapo/scale_rewards={scale}"] = first_batch(tmp, drawn, "dapo", scale_rewards=scale)
        cases["grpo/sequence"] = first_batch(tmp, drawn, "grpo", importance_sampling_level="sequence")
        cases["dapo/beta=0.1"] = first_batch(tmp, drawn, "dapo", beta=0.1)
        cases["dapo/mask_truncated"] = first_batch(tmp, drawn, "dapo", mask_truncated_completions=True)
        for loss_type in ("grpo", "dapo", "cispo"):
            curves[loss_type] = curve(tmp, drawn, loss_type)
        curves["dapo/beta=0.1"] = curve(tmp, drawn, "dapo", beta=0.1)
        curves["grpo/sequence"] = curve(tmp, drawn, "grpo", importance_sampling_level="sequence")
    ref = json.loads((REPO / "tests" / "data" / "preference" / "text.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grpo.json").write_text(json.dumps({
        "prompts": [{"prompt": p, "target": t} for p, t in zip(PROMPTS, TARGETS)], "completions": drawn,
        "cases": cases, "curves": curves, "rewards": built_in_rewards(),
        "settings": {"num_generations": G, "max_completion_length": MAX_COMPLETION, "lr": LR,
                     "reward_weights": [1.0, 0.5], "rank": pref.RANK, "alpha": pref.ALPHA, "adapter_scale": 0.3,
                     "targets": pref.TARGETS, "eos_token_id": tokenizer.eos_token_id},
        "config": ref["config"], "tensors": ref["tensors"], "adapter_tensors": ref["adapter_tensors"],
        "made_by": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                    "torch": torch.__version__, "script": "scripts/make_grpo_reference.py"}}, indent=1) + "\n")
    print(json.dumps({k: round(v["loss"], 6) for k, v in cases.items()}))


if __name__ == "__main__":
    main()
