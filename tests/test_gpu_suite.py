"""scripts/gpu_suite.py --dry-run: every stage of the GPU suite runs at toy size on the CPU, so the
one command that measures a GPU cannot rot between the runs that have one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def suite_env() -> dict[str, str]:
    """The suite's environment: no SEQJAX_ settings, and the session's persistent XLA cache (cli_env's), which
    every stage's subprocess then shares (a dry run's stages build the same toy shapes again and again)."""
    from test_train_support import cli_env

    return {k: v for k, v in cli_env().items() if not k.startswith("SEQJAX_") and k != "JAX_PLATFORMS"}


def test_the_dry_run_exercises_every_stage_and_writes_one_summary(tmp_path):
    env = suite_env()
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = summary["stages"]
    assert proc.returncode == 0, (proc.stdout[-2000:], {n: r.get("status") for n, r in stages.items()})
    # the default: the stages in the order of value (what no GPU has measured first), each with its own budget;
    # the first call of 9 minutes holds them up to gdn, and the second of 4 (--rerun) attention and fine-tuning
    assert list(stages) == ["setup", "env", "tests", "engine", "gdn", "attention", "finetune", "lora8b", "dpo",
                            "throughput"]
    from hf_support import script_module

    suite = script_module("gpu_suite")
    first = ["setup", "env", "tests", "engine", "gdn"]
    assert sum(suite.STAGES[name].budget_s for name in first) <= suite.FIRST_CALL_S == suite.parse_args(
        ["--out", "x"]).budget_s
    assert sum(suite.STAGES[name].budget_s for name in ("setup", "attention", "finetune")) <= suite.RERUN_CALL_S
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
    # what a dpo or grpo stage cut at its budget keeps: each layout's figures, read back from the log where the
    # bench printed them as the layout ended (on 2026-11-28 and -29 both stages were cut with nothing kept)
    parts = suite.parts_in_log(tmp_path / "dpo.log")
    assert {"packed", "shared_prompt", "pair_per_row"} <= set(parts) and all(parts[k] == dpo[k] for k in parts)
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
    # the generation engine: its tokens/s and their share of the decode's bandwidth bound, on this machine
    for workload in ("fixed", "grpo"):
        engine = stages["engine"]["small"][workload]["engine"]
        assert engine["new_tokens_per_s"] > 0 and 0 < engine["share_of_bound"] and engine["backend"] == "cpu"
    assert stages["engine"]["small"]["fixed"]["engine"]["slot_use"] == 1.0
    # Qwen3.5's DeltaNet: both forms and attention timed, the chunked form the recurrent one's numbers
    gdn = {r["impl"]: r for r in stages["gdn"]["records"]}
    assert set(gdn) == {"gdn_chunked", "gdn_recurrent", "gdn_pallas", "attention_xla"} and gdn["gdn_chunked"][
        "fwd_ms"] > 0
    assert all(gdn[n]["max_abs_diff_vs_recurrent"] < 1e-4 for n in ("gdn_chunked", "gdn_pallas"))


def test_the_opt_in_profile_recipe_quality_and_vision_stages_run_dry(tmp_path):
    """The opt-in stages in one call, at toy size: a profile trace, the recipe's validation, the
    quality run (resumed per call, then scored), the vision tower's two backends, GRPO's layouts and
    sampler, context parallelism's attention and step, and the experts' dispatches. (The study stage only calls
    scripts/study_strategies.py, whose --quick run tests/test_study.py covers.)"""
    env = suite_env()
    stages = "profile,recipe,quality,vision,grpo,context,moe"
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--dry-run", "--out", str(tmp_path), "--only",
                           stages], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert proc.returncode == 0, {n: r.get("status") for n, r in stages.items()}
    assert stages["profile"]["traces"] and stages["profile"]["traces"][0]["bytes"] > 0
    assert stages["recipe"]["validation"]["val_perplexity"] > 1
    assert stages["quality"]["test"]["word_perplexity"] > 1 and stages["quality"]["awd_lstm_word_perplexity"] == 65.8
    assert stages["quality"]["summary"]["finished"]
    # the tower: dense mask and kernel
    vision = {r["impl"]: r for r in stages["vision"]["result"]["records"]}
    assert vision["xla"]["fwd_ms"] > 0 and vision["pallas"]["rel_err_vs_first"] < 1e-5
    grpo = stages["grpo"]["result"]
    assert grpo["prompt_once"]["positions_computed_per_step"] < grpo["trl_layout"]["positions_computed_per_step"]
    assert grpo["sampling"]["sample_rollouts"]["new_tokens_per_s"] > 0
    # context parallelism: the real step on a context axis of 2, each way K/V travel, gives one device's losses
    steps = {(r["context"], r["kv_path"]): r["train_step"] for r in stages["context"]["records"] if "context" in r}
    assert set(steps) == {(1, None), (2, "all_gather"), (2, "ring")}
    for split in ((2, "all_gather"), (2, "ring")):
        assert steps[split]["loss_first_last"] == pytest.approx(steps[(1, None)]["loss_first_last"], rel=1e-5)
    # and the chunked loss both ways (tests/context_cases.py checks what each compiles to)
    loss, = [r["chunked_loss"] for r in stages["context"]["records"] if "chunked_loss" in r]
    assert loss["within_spans"]["fwd_bwd_ms"] > 0 and loss["whole_row"]["fwd_bwd_ms"] > 0
    # the experts' dispatches: each computes the same loss
    moe = {r["impl"]: r for r in stages["moe"]["default"]["results"]}
    assert set(moe) == {"ragged_dot", "blocked", "dense", "onehot"} and moe["blocked"]["fwd_bwd_ms"] > 0
    assert all(moe[n]["loss_rel_diff"] < 1e-5 for n in ("ragged_dot", "blocked", "dense")), moe
    # one-hot caps each expert's tokens: it differs exactly when it dropped some
    assert (moe["onehot"]["loss_rel_diff"] < 1e-5) == (moe["onehot"]["dropped_pairs"] == 0), moe["onehot"]


def test_the_engine_bench_measures_where_its_caller_runs(monkeypatch):
    """bench_engine runs each sampler in a fresh interpreter: that one keeps the caller's environment (on the GPU
    suite's machine its GPU and the suite's wheels), here seen as the three host devices the caller's XLA flags
    ask for. (It once ran the worker on the CPU alone, whatever the caller had: the GPU stage would have timed a
    1B model's decode on the host.)"""
    from hf_support import script_module

    bench = script_module("bench_engine")
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=3".strip())
    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
            "model.d_ff=64"]
    overrides = bench.config_overrides(bench.argparse.Namespace(prompt_median=4, max_new=3, dtype=None,
                                                                shape="small", vocab=64, scan_layers=False))
    spec = {"overrides": overrides + tiny, "prompts": [[5, 6, 7], [8, 9]], "generations": 2, "max_new": 3,
            "stops": 2, "slots": 2, "page_size": 4, "attention": "xla", "vocab": 64, "engine": True, "shape": "small",
            "hbm_gb_s": "0", "workloads": ["fixed"]}
    row = bench.in_subprocess(sys.executable, spec, str(REPO))
    assert "error" not in row, row
    engine = row["fixed"]["engine"]
    assert engine["devices"] == 3 and engine["backend"] == "cpu" and engine["new_tokens"] == 12
    assert "grpo" not in row  # (--workloads: the fixed one alone)


def run_suite(tmp_path, *flags) -> tuple[subprocess.CompletedProcess, dict]:
    env = suite_env()
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--dry-run", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(Path(flags[flags.index("--out") + 1], "summary.json").read_text())


def test_a_stage_that_overruns_its_budget_costs_only_itself_and_the_rerun_takes_it_again(tmp_path):
    """The H200's first call lost 355 of its 470 s: a stage that spent its budget left the next ones a deadline
    already past. Each stage now has its own deadline: env given 0.3 s is cut, and tests after it still runs with
    its whole budget. --rerun then takes what did not end ok (env), and nothing that did."""
    first, summary = run_suite(tmp_path, "--out", str(tmp_path / "first"), "--only", "setup,env,tests",
                               "--budgets", "env=0.3")
    stages = summary["stages"]
    assert stages["env"]["status"] == "timeout" and stages["env"]["budget_s"] == pytest.approx(0.3, abs=0.05)
    assert stages["tests"]["status"] == "ok" and stages["tests"]["tests"] >= 5, first.stderr[-2000:]
    assert stages["tests"]["budget_s"] > 100  # (its own, whatever env spent)
    assert summary["planned"] == ["setup", "env", "tests"]
    again, summary = run_suite(tmp_path, "--out", str(tmp_path / "second"), "--rerun", str(tmp_path / "first"))
    assert list(summary["stages"]) == ["setup", "env"] and summary["budget_s"] == 240
    assert summary["stages"]["env"]["status"] == "ok", again.stderr[-2000:]


def test_prepare_writes_one_folder_whose_stores_a_moved_copy_reuses(tmp_path, monkeypatch):
    """--prepare on the CPU: the wheels (here, stand-ins: nothing is downloaded), the data, each stage's answers and
    its tokenizer and stores, the project at HEAD, and a manifest under the size limit; copied elsewhere (the GPU
    machine), the stage's own data overrides reuse the tokenizer and stores: nothing trains on the device."""
    from hf_support import script_module
    from seqjax.config.load import load_config
    from seqjax.store.build import prepare

    suite = script_module("gpu_suite")
    monkeypatch.setattr(suite, "PREPARED_STAGES", {"finetune": ("configs/llama3_1b_finetune.yaml", 300,
                                                                ["tokenizer.vocab_size=300"])})
    data = tmp_path / "shared"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "wikitext-2" / "wiki.train.tokens").write_text(" = A = \n text \n")
    folder = tmp_path / "prepared"
    (folder / "wheels").mkdir(parents=True)
    (folder / "wheels" / "jax-0.12.0.1-py3-none-any.whl").write_bytes(b"stand-in")
    manifest = suite.prepare_folder(suite.parse_args(["--prepare", str(folder), "--data", str(data)]))
    assert manifest["total_mb"] < suite.PREPARED_LIMIT_MB and manifest["wheels"] == ["jax-0.12.0.1-py3-none-any.whl"]
    assert (folder / "project.tar.gz").stat().st_size > 0 and (folder / "data" / "wikitext-2").is_dir()
    moved = tmp_path / "on_the_gpu"
    shutil.copytree(folder, moved)
    args = suite.parse_args(["--out", str(tmp_path / "out"), "--prepared", str(moved)])
    overrides = suite.stage_data(suite.Suite(args), "finetune")
    assert any(str(moved) in o for o in overrides)
    again = prepare(load_config(suite.REPO / "configs/llama3_1b_finetune.yaml", overrides), splits=("train",))
    assert again.summary["train"]["reused"] and str(moved / "cache") in str(again.tokenizer.path)


def test_the_mosaic_sweep_weighs_every_variant_bench_attention_knows(monkeypatch):
    """The opt-in ``mosaic`` stage (its dry run is one interpreter case per variant, so it is not run here): the
    implementations it passes are exactly flash and every Mosaic variant bench_attention can build, so a variant
    added to the kernel reaches the next GPU's sweep."""
    from hf_support import script_module

    suite, bench = script_module("gpu_suite"), script_module("bench_attention")
    calls = []
    monkeypatch.setattr(suite, "bench_attention", lambda s, name, args, budget: calls.append((name, args)) or {})
    suite.stage_mosaic(type("Dry", (), {"dry": False})())
    (name, args), = calls
    impls = args[args.index("--impls") + 1].split(",")
    assert name == "mosaic" and sorted(impls) == sorted(["flash", *bench.MOSAIC_VARIANTS])
    assert len(bench.MOSAIC_VARIANTS) == len(set(bench.MOSAIC_VARIANTS.values()))  # no two names for one kernel


def test_a_failure_reaches_stderr_as_it_happens_under_the_suites_setting(tmp_path):
    """The tests stage's setting (SEQJAX_FAILURES_NOW=1): a failing test's report is on stderr when the test
    ends, before the tests after it run, so a stage killed at its budget keeps the report in its log."""
    (tmp_path / "test_two.py").write_text(
        "import time\n\ndef test_fails():\n    assert 1 + 1 == 3, 'the size of the gap'\n\n"
        "def test_after():\n    time.sleep(60)\n")
    env = {**suite_env(), "SEQJAX_FAILURES_NOW": "1", "PYTHONPATH": str(REPO / "tests")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-o",
                             "addopts=", str(tmp_path / "test_two.py")], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # the report arrives while test_after still sleeps
            lines.append(line)
            if "the size of the gap" in line:
                break
    finally:
        proc.kill()
    assert any(line.startswith("FAILED ") and "test_fails" in line for line in lines), lines
    assert "the size of the gap" in "".join(lines)
