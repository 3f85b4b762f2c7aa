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


@pytest.mark.slow  # (an end-to-end run: the full suite and CI; the fast loop keeps the import/export round trip)
def test_a_hub_folder_fine_tunes_by_its_path_and_exports_with_its_mtp_layers_untrained(tmp_path):
    """train.init_from names a folder as the Hub ships Qwen3.5 (the text model beside its vision tower and
    multi-token-prediction layers): the text model trains, and its export holds the trained text model with the
    mtp.* layers as they came."""
    import json

    import numpy as np

    from seqjax.main import export
    from test_moe_runs import records
    from test_qwen3_5 import MTP, exported, hub_folder, mtp_tensors, reference

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records("prompt_completion")))
    run = tmp_path / "run"
    assert_ok(run_cli([f"run.dir={run}", f"train.init_from={hub_folder(tmp_path / 'hub')}", "data.corpus=jsonl",
                       "data.format=prompt_completion", f"data.train_files=[{data}]", f"data.cache_dir={tmp_path}",
                       "data.seq_len=64", "data.batch_size=4", "model.attention=xla", "train.steps=2", "train.lr=0.01",
                       "train.eval_every=0", "train.checkpoint_every=100"]))
    export.main(["--run", str(run), "--out", str(tmp_path / "export")])
    tensors, config = exported(tmp_path / "export")
    record, _ = reference("qwen3_5")
    assert set(tensors) == set(record["tensors"]) | set(MTP) and config["mtp_num_hidden_layers"] == 1
    for name, value in mtp_tensors().items():
        np.testing.assert_array_equal(tensors[name], value.astype(np.float32), err_msg=name)
    from test_moe_families import SCRIPT

    before = SCRIPT.reference_weights(record["tensors"])
    trained = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not np.allclose(tensors[trained], before[trained])  # (the text model trained)
