"""Reference numbers of TRL 1.16's own RLOOTrainer on fixed completions, made by TRL itself: the same tiny Qwen3 with
LoRA, prompts, completions and reward functions as scripts/make_grpo_reference.py.

    python scripts/make_rloo_reference.py --out tests/data/grpo   # needs torch, transformers 5, peft, TRL 1.16

RLOOTrainer has no ``rollout_func``: its one-turn generation (``_generate_single_turn``) is replaced on the
trainer by one that hands back the drawn completions of each prompt in turn, so it scores, baselines and trains
on exactly these. ``rloo.json`` holds, per case (RLOOTrainer's defaults but ``beta``: 0; ``beta`` 0.05, its
default, with the KL in the reward; ``normalize_advantages``; the clip's upper side at 0.28):

- ``first``: the first batch's advantages and per-token log-probabilities (by prompt and completion), the loss
  and the gradient's norm (``compute_loss``, then ``backward``), and every metric TRL logs for that batch;
- ``curve``: two optimizer steps, TRL's logged loss, grad norm and metrics each step: with ``num_iterations=2``
  (the second trains on the same completions with the policy moved: the ratio leaves 1 and the clip works), and,
  for ``beta`` 0.05, with a generation each step (the second's reward pays the KL of the moved policy).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRPO = _script("make_grpo_reference")
CASES = {"beta=0": {"beta": 0.0}, "beta=0.05": {"beta": 0.05}, "normalize": {"beta": 0.0, "normalize_advantages": True},
         "epsilon_high=0.28": {"beta": 0.0, "epsilon_high": 0.28}}


def trainer(tmp: str, completion_ids, **settings):
    """TRL's RLOOTrainer on the drawn LoRA policy, the prompts in order, the completions handed to it in turn."""
    import datasets
    import torch
    import trl

    sys.path.insert(0, str(REPO / "tests"))
    import grpo_rewards

    pref = _script("make_preference_reference")
    policy, _, tokenizer = pref.build(pref.CHAT)
    by_prompt = {tuple(tokenizer(p)["input_ids"]): list(c) for p, c in zip(GRPO.PROMPTS, completion_ids)}
    taken: dict[tuple, int] = {}

    def replay(prompt_ids, images, multimodal_fields):
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            k = taken.get(key, 0)
            taken[key] = k + 1
            out.append(by_prompt[key][k % GRPO.G])
        return out

    args = trl.RLOOConfig(
        output_dir=tmp, per_device_train_batch_size=len(GRPO.PROMPTS) * GRPO.G, num_generations=GRPO.G,
        max_completion_length=GRPO.MAX_COMPLETION, learning_rate=GRPO.LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        logging_steps=1, bf16=False, report_to=[], seed=0, use_cpu=True, save_strategy="no", optim="adamw_torch",
        shuffle_dataset=False, reward_weights=[1.0, 0.5], **settings)
    dataset = datasets.Dataset.from_list([{"prompt": p, "target": t} for p, t in zip(GRPO.PROMPTS, GRPO.TARGETS)])
    t = trl.RLOOTrainer(model=policy, reward_funcs=[grpo_rewards.even_tokens, grpo_rewards.near_target], args=args,
                        train_dataset=dataset, processing_class=tokenizer)
    t._generate_single_turn = replay
    return t, torch


def first_batch(tmp: str, completion_ids, **settings) -> dict:
    """The first batch: advantages and per-token log-probabilities by (prompt, completion), loss, grad norm,
    metrics."""
    t, torch = trainer(tmp, completion_ids, **settings)
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


def curve(tmp: str, completion_ids, iterations: int, **settings) -> list[dict]:
    """Two optimizer steps on the same completions (``iterations`` passes over each generation): TRL's logged
    rows."""
    t, _ = trainer(tmp, completion_ids, num_iterations=iterations, max_steps=2, **settings)
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
    drawn = GRPO.completions(tokenizer)  # (the completions grpo.json holds)
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, settings in CASES.items():
            iterations = 1 if settings["beta"] else 2
            cases[name] = {"settings": settings, "iterations": iterations, "first": first_batch(tmp, drawn, **settings),
                           "curve": curve(tmp, drawn, iterations, **settings)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rloo.json").write_text(json.dumps({
        "completions": drawn, "cases": cases,
        "made_by": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                    "torch": torch.__version__, "script": "scripts/make_rloo_reference.py"}}, indent=1) + "\n")
    print(json.dumps({k: round(v["first"]["loss"], 6) for k, v in cases.items()}))


if __name__ == "__main__":
    main()
