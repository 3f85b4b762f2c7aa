"""scripts/gpu_suite.py --dry-run: every stage of the GPU suite runs at toy size on the CPU, so the
one command that measures a GPU cannot rot between the runs that have one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_exercises_every_stage_and_writes_one_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQJAX_")}
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = summary["stages"]
    assert proc.returncode == 0, (proc.stdout[-2000:], {n: r.get("status") for n, r in stages.items()})
    # the default: one call of about 8 minutes on a lent GPU, in the order of value, each stage
    # within its budget
    assert list(stages) == ["setup", "env", "tests", "attention", "finetune", "lora8b", "dpo", "throughput"]
    from hf_support import script_module

    suite = script_module("gpu_suite")
    assert sum(suite.STAGES[name].budget_s for name in stages) <= 480 == suite.parse_args(["--out", "x"]).budget_s
    assert all(r["status"] == "ok" for r in stages.values())
    # Each stage really ran its tool: records, timings, a trace, a validation.
    # both kernels
    assert {r["impl"] for r in stages["attention"]["records"]} >= {"flash", "mosaic", "xla"}
    mosaic = [r for r in stages["attention"]["records"] if r["impl"] == "mosaic"]
    # the interpreter's Mosaic kernel agrees with flash
    assert all(r["rel_err_vs_flash"] < 1e-2 for r in mosaic)
    assert all(r["fwd_ms"] > 0 for r in stages["attention"]["records"])
    # collected; skipped off the GPU
    assert stages["tests"]["tests"] >= 5 and stages["tests"]["failures"] == 0
    loops = stages["throughput"]["backends"]["xla model.loss_chunk_tokens=8192"]["loops"]
    # the chunked loss's throughput
    assert loops["sync"]["tokens_per_s"] > 0 and loops["async"]["tokens_per_s"] > 0
    assert stages["lora8b"]["result"]["loops"]["async"]["tokens_per_s"] > 0 and stages["lora8b"][
        "planned_bytes_per_device"] > 0
    dpo = stages["dpo"]["result"]
    assert {"packed", "shared_prompt", "pair_per_row", "trl_layout"} <= set(dpo)
    assert dpo["shared_prompt"]["rows_per_epoch"] <= dpo["packed"]["rows_per_epoch"] < dpo["pair_per_row"][
        "rows_per_epoch"]
    # the 1B stage's plumbing: throughput beside the plan (--finetune-plain adds the same run under
    # other settings; that remat keeps fewer activations, tests/test_scale.py's
    # test_remat_keeps_less_... shows)
    variant = stages["finetune"]["variants"]["as configured"]
    assert variant["loops"]["async"]["tokens_per_s"] > 0 and variant["planned_bytes_per_device"] > 0
    for name in stages:
        assert name == "setup" or (tmp_path / f"{name}.log").is_file()
    assert [t["target"] for t in summary["targets"]][:2] == ["dense causal D=128 T=8k forward TFLOP/s",
                                                              "dense causal D=128 T=8k fwd+bwd TFLOP/s"]
    assert "stage" in proc.stdout and "throughput" in proc.stdout  # the closing table


def test_the_opt_in_profile_recipe_quality_and_vision_stages_run_dry(tmp_path):
    """The opt-in stages in one call, at toy size: a profile trace, the recipe's validation, the
    quality run (resumed per call, then scored) and the vision tower's two backends. (The study
    stage only calls scripts/study_strategies.py, whose --quick run tests/test_study.py covers.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQJAX_")}
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--dry-run", "--out", str(tmp_path), "--only",
                           "profile,recipe,quality,vision"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert proc.returncode == 0, {n: r.get("status") for n, r in stages.items()}
    assert stages["profile"]["traces"] and stages["profile"]["traces"][0]["bytes"] > 0
    assert stages["recipe"]["validation"]["val_perplexity"] > 1
    assert stages["quality"]["test"]["word_perplexity"] > 1 and stages["quality"]["awd_lstm_word_perplexity"] == 65.8
    assert stages["quality"]["summary"]["finished"]
    # the tower: dense mask and kernel
    vision = {r["impl"]: r for r in stages["vision"]["result"]["records"]}
    assert vision["xla"]["fwd_ms"] > 0 and vision["pallas"]["rel_err_vs_first"] < 1e-5
