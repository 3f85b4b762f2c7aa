"""SFT, DPO with a shared prompt and GRPO with the prompt once train a Qwen3.5-shaped model (Gated DeltaNet and
gated attention layers, partial RoPE, a MoE variant with a shared expert) from the command line unchanged: the
shared prompt runs through the DeltaNet's prompt-continuing rule, and GRPO samples through the engine's state
rows."""

from __future__ import annotations

import math

import pytest

from test_moe_runs import overrides
from test_train_support import assert_ok, run_cli

QWEN3_5 = ["model.layer_types=[linear,full]", "model.deltanet.key_heads=2", "model.deltanet.value_heads=4",
           "model.deltanet.key_dim=8", "model.deltanet.value_dim=8", "model.attention_gate=true",
           "model.rope_fraction=0.5", "model.qk_norm=true", "model.norm_plus_one=true"]
SHARED_EXPERT = ["model.experts.count=4", "model.experts.top_k=2", "model.experts.d_ff=16",
                 "model.experts.shared_d_ff=24", "model.experts.aux_loss_coef=0.01"]


@pytest.mark.slow  # (end-to-end runs: the full suite and CI)
@pytest.mark.parametrize("objective, extra", [
    ("sft", []), ("dpo", ["data.shared_prompt=true"]), ("grpo", []), ("grpo", SHARED_EXPERT)],
    ids=["sft", "dpo_shared_prompt", "grpo_prompt_once", "grpo_moe"])
def test_sft_dpo_and_grpo_train_a_qwen3_5_shaped_model(objective, extra, tmp_path):
    from seqjax.train.metrics import read_metrics

    argv = [a for a in overrides(tmp_path, objective) if not a.startswith("model.experts")] + QWEN3_5 + extra
    assert_ok(run_cli(argv))
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r and "event" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows), rows
    if objective == "grpo":  # (the engine sampled the groups through the DeltaNet's state rows)
        assert all(math.isfinite(r["reward"]) for r in rows), rows
    if extra == SHARED_EXPERT:
        assert all(r["aux_loss"] > 0 for r in rows), rows
