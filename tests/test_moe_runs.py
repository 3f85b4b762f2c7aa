"""SFT, DPO and GRPO train a model with experts from the command line unchanged, through the objective seam: the
router's losses join each objective's loss (pooled over the step's two micro-batches), metrics.jsonl logs them
with each layer's busiest expert's share, and the run draws router.png beside loss.png."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from test_rl_run import rl_overrides
from test_train_support import assert_ok, run_cli

EXPERTS = ["model.experts.count=4", "model.experts.top_k=2", "model.experts.d_ff=16",
           "model.experts.aux_loss_coef=0.01", "model.experts.z_loss_coef=0.001", "train.grad_accum=2"]


def records(kind: str) -> list[dict]:
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
    out = []
    for i in range(96):
        prompt = f"Q: {words[i % 8]} {words[(3 * i) % 8]}?"
        if kind == "preference":
            out.append({"prompt": prompt, "chosen": f" {words[(i + 1) % 8]}", "rejected": f" {words[(i + 5) % 8]}"})
        else:
            out.append({"prompt": prompt, "completion": f" {words[(i + 1) % 8]} {words[(i + 2) % 8]}"})
    return out


def overrides(tmp_path: Path, objective: str) -> list[str]:
    """(sft: prompt-completion records under the lm objective, the completions scored, as TRL's SFTTrainer)"""
    run_dir = tmp_path / "run"
    if objective == "grpo":
        return rl_overrides(tmp_path, run_dir, "train.steps=2", *EXPERTS)
    kind = "preference" if objective == "dpo" else "prompt_completion"
    data = tmp_path / f"{kind}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(kind)))
    return [f"run.dir={run_dir}", "data.corpus=jsonl", f"data.format={kind}", f"data.train_files=[{data}]",
            f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64", "data.batch_size=4",
            "tokenizer.vocab_size=300", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.d_ff=64", "model.max_seq_len=64", "model.attention=xla",
            f"train.objective={'lm' if objective == 'sft' else objective}", "train.steps=2", "train.eval_every=0",
            "train.log_every=1", "train.checkpoint_every=100", *EXPERTS]


@pytest.mark.slow  # (three end-to-end runs: the full suite and CI)
@pytest.mark.parametrize("objective", ["sft", "dpo", "grpo"])
def test_sft_dpo_and_grpo_train_a_model_with_experts_and_log_its_router(objective, tmp_path):
    from seqjax.train.metrics import read_metrics

    assert_ok(run_cli(overrides(tmp_path, objective)))
    run_dir = tmp_path / "run"
    rows = [r for r in read_metrics(run_dir) if "loss" in r and "event" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["loss"]) and row["aux_loss"] > 0 and row["router_z_loss"] > 0, row
        # (top 2 of 4 experts: the busiest takes between an even quarter and half of a layer's routes)
        assert all(0.25 <= row[f"router/max_share/{layer}"] <= 0.5 for layer in (0, 1)), row
    assert (run_dir / "router.png").stat().st_size > 0 and (run_dir / "loss.png").exists()
