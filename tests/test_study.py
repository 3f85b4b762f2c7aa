"""scripts/study_strategies.py: every strategy trained to one target-token budget, scored alike, reported from JSON.

The study runs once, at --quick size on the tiny corpus (tests/test_train_support.py);
the tests read what it wrote. Its subset evaluation is checked on WikiText-2,
whose articles have many lines and ``<unk>`` special tokens.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from test_train_support import REPO, cli_env

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "study_strategies.py"


def load_study():
    spec = importlib.util.spec_from_file_location("study_strategies", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


study = load_study()


def tiny_data(root) -> list[str]:
    return ["data.corpus=jsonl", f"data.train_files=[{root / 'train.jsonl'}]",
            f"data.valid_files=[{root / 'valid.jsonl'}]", f"data.test_files=[{root / 'valid.jsonl'}]",
            f"data.cache_dir={root / 'cache'}", "tokenizer.vocab_size=300"]


def run_study(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def quick(tiny_root, tmp_path_factory):
    """(out folder, argv, finished process) of one --quick study of every default strategy, two seeds."""
    out = tmp_path_factory.mktemp("study")
    argv = ["--quick", "--out", str(out), "--config", "configs/wikitext2_cpu.yaml", *tiny_data(tiny_root)]
    proc = run_study(argv)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, argv, proc


def test_every_strategy_and_seed_trains_to_the_same_target_token_budget(quick):
    out, _, _ = quick
    document = json.loads((out / "results.json").read_text())
    budget = study.SCALES["quick"].target_tokens
    runs = {(r["strategy"], r["seed"]): r for r in document["runs"]}
    assert set(runs) == {(name, seed) for name in study.DEFAULT_STRATEGIES for seed in (0, 1)}
    for (name, seed), run in runs.items():
        run_dir = out / "runs" / name / f"seed{seed}"
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["data"]["strategy"] == run["overrides"][0].split("=")[1]  # it trained its own strategy
        assert config["run"]["seed"] == seed and config["train"]["steps"] == run["steps"]
        # The budget is reached at the last step, never before it: overshoot is less than one batch's slots.
        assert budget <= run["target_tokens"] < budget + 8 * 32
        assert run["slots"] >= run["tokens"] >= run["target_tokens"]
        assert 0 <= run["padding_fraction"] < 1
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in metrics if "loss" in r) == run["steps"]
        # The periodic validations end at the last step, with the whole budget behind them.
        steps = [p["step"] for p in run["curve"]]
        assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == run["steps"]
        assert run["curve"][-1]["target_tokens"] == run["target_tokens"]
    assert runs[("block-complete_doc", 0)]["padding_fraction"] > 0.05  # whole lines leave rows part-empty
    assert runs[("concat_chunk", 0)]["padding_fraction"] == 0


def test_every_model_is_scored_under_both_protocols_on_both_splits_in_three_units(quick):
    out, _, _ = quick
    document = json.loads((out / "results.json").read_text())
    for run in document["runs"]:
        assert list(run["final"]) == ["valid/sliding", "valid/documents", "test/sliding", "test/documents"]
        for protocol, result in run["final"].items():
            split = protocol.split("/")[0]
            assert result["tokens"] == document["eval_articles"][split]["tokens"]  # the same tokens for every model
            assert result["words"] == document["eval_articles"][split]["words"]
            assert math.exp(result["nll_sum"] / result["words"]) == pytest.approx(result["word_perplexity"])
            assert 1 < result["token_perplexity"] < result["word_perplexity"] and result["bits_per_byte"] > 0
        # The last periodic validation is the final model on valid/documents.
        assert run["curve"][-1]["word_perplexity"] == pytest.approx(run["final"]["valid/documents"]["word_perplexity"])


def test_the_report_tables_and_plot_come_from_the_json_alone(quick, tmp_path):
    out, _, proc = quick
    markdown = (out / "results.md").read_text().strip()
    assert markdown in proc.stdout
    for name in study.DEFAULT_STRATEGIES:
        assert sum(line.startswith(f"| {name} |") for line in markdown.splitlines()) == 2  # full and compact tables
    assert (out / "valid_word_perplexity.png").stat().st_size > 10_000

    again = run_study(["--report", str(out / "results.json"), "--plot", str(tmp_path / "plot.png")])
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.startswith(markdown)
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    assert json.loads(again.stdout.strip().splitlines()[-1])["runs"] == 16


def test_a_rerun_reuses_scored_runs_scores_a_trained_one_alike_and_refuses_other_settings(quick):
    out, argv, _ = quick
    unscored = out / "runs" / "pack-fill" / "seed0" / "run.json"
    before = json.loads(unscored.read_text())
    unscored.unlink()  # as if the study had been killed after training this run, before writing its result
    rerun = run_study([*argv, "--strategies", "concat_chunk,pack-fill", "--seeds", "1"])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert (summary["runs"], summary["trained"]) == (16, 1)  # the results still hold every run of --out
    after = json.loads(unscored.read_text())
    # nothing retrained (train() leaves a finished run alone): scored from its final checkpoint
    assert "already finished its" in rerun.stderr
    assert after["steps"] == before["steps"] and after["final_train_loss"] == before["final_train_loss"]
    assert after["curve"] == before["curve"]
    for protocol, result in before["final"].items():
        assert after["final"][protocol]["nll_sum"] == pytest.approx(result["nll_sum"], rel=1e-6)
    refused = run_study([*argv, "--target-tokens", "2048"])
    assert refused.returncode == 2
    (line,) = [x for x in refused.stderr.splitlines() if "error" in x]
    assert "its runs were made with target_tokens=1024, not 2048" in line


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_an_article_subset_counts_the_words_and_bytes_of_exactly_its_text(wikitext_prepared):
    store, tokenizer = wikitext_prepared.stores["valid"], wikitext_prepared.tokenizer
    whole = study.article_subset(store, tokenizer, 0)
    stats = store.manifest["stats"]
    assert (whole.words, whole.bytes, len(whole.docs)) == (stats["words"], stats["bytes"], stats["documents"])
    assert (whole.store.tokens == store.tokens).all() and (whole.store.line_offsets == store.line_offsets).all()
    some = study.article_subset(store, tokenizer, 8)
    assert some.docs == [0, 8, 17, 25, 34, 42, 51, 59]
    assert some.store.num_docs == 8 and 0 < some.words < stats["words"]
    assert some.store.predicted_tokens == sum(int(store.doc_lengths[i]) for i in some.docs)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from("abcde"), st.lists(st.floats(1, 1000), min_size=1, max_size=4), min_size=2))
def test_a_difference_is_called_larger_than_the_spread_only_when_the_seed_ranges_do_not_overlap(values):
    runs = [{"strategy": name, **{k: 1.0 for k in study.COSTS},
             "final": {"test/sliding": {"token_perplexity": 1.0, "word_perplexity": v, "bits_per_byte": 1.0}}}
            for name, vs in values.items() for v in vs]
    lines = study.separation(study.aggregate(runs), "test/sliding/word_perplexity", 1)
    claims = {line.split(" (")[0][2:]: line.split("lower than ")[1].split(", ") if "lower than" in line else []
              for line in lines}
    for a, beaten in claims.items():
        for b in values:
            assert (b in beaten) == (max(values[a]) < min(values[b]))


def test_the_committed_study_tables_are_the_report_of_the_committed_json():
    """BENCHMARKS.md and the README quote docs/benchmarks/study-cpu-*/results.md: it must be what the script makes."""
    (folder,) = sorted((REPO / "docs" / "benchmarks").glob("study-cpu-*"))
    document = json.loads((folder / "results.json").read_text())
    assert study.report(document).strip() == (folder / "results.md").read_text().strip()
    assert len(document["runs"]) == len(document["settings"]["strategies"]) * document["settings"]["seeds"]
