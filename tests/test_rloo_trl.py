"""RLOO against TRL 1.16's own RLOOTrainer, and the metrics TRL's GRPOTrainer logs that the GRPO tests leave out.

RLOO is rows, not a trainer: ``train.objective=rloo`` is a row of the loss types (the clipped surrogate on each
completion's summed ratio, averaged over completions), whose rollouts take the leave-one-out advantage estimator
and the KL in the reward (:mod:`seqjax.objectives.rl`, :data:`seqjax.train.rewards.ADVANTAGES`). The reference
(tests/data/grpo/rloo.json) was made by TRL itself from the committed script scripts/make_rloo_reference.py, on
the GRPO reference's model, prompts, completions and reward functions (tests/test_grpo_trl.py): the first step's
advantages, log-probabilities, loss, gradient norm and every metric, and two steps after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from test_grpo_trl import reference as grpo_reference
from test_grpo_trl import run_config, trained

DATA = Path(__file__).parent / "data" / "grpo"
SETTINGS = {"beta=0": [], "beta=0.05": ["rl.beta=0.05", "train.reference=copy"],
            "normalize": ["rl.normalize_advantages=true"], "epsilon_high=0.28": ["rl.epsilon_high=0.28"]}
SKIP = {"loss", "grad_norm", "learning_rate", "step", "step_time", "epoch"}


def reference() -> dict:
    return json.loads((DATA / "rloo.json").read_text())


def rloo_config(tmp_path: Path, case: str, steps: int, iterations: int):
    config = run_config(tmp_path, "rloo", steps=steps)
    from seqjax.config.load import load_config

    saved = tmp_path / "rloo.yaml"
    config.save(saved)
    return load_config(saved, [*SETTINGS[case], f"rl.num_iterations={iterations}"])


def assert_all_metrics(ours: dict, theirs: dict, case: str) -> None:
    """The loss, the gradient's norm before clipping, and every metric TRL logged, none left out."""
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-5, abs=2e-6), case
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-5, abs=2e-7), case
    named = {k: v for k, v in theirs.get("metrics", theirs).items() if k not in SKIP}
    assert set(named) <= set(ours), (case, set(named) - set(ours))
    for name, value in named.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=2e-6), (case, name, ours[name], value)


@pytest.mark.slow  # (RLOO against TRL: the full suite; the fast loop keeps GRPO's first step against TRL's)
@pytest.mark.parametrize("case", [pytest.param("beta=0", marks=pytest.mark.slow),
                                  pytest.param("normalize", marks=pytest.mark.slow),
                                  pytest.param("epsilon_high=0.28", marks=pytest.mark.slow), "beta=0.05"])
def test_rloo_follows_trls_rlootrainer(case, tmp_path):
    """The first step (each completion's leave-one-out advantage and log-probabilities, the loss, the gradient's
    norm, every metric) and the step after it: a second pass over the generation (the summed ratio leaves 1, the
    clip works), or, with the KL in the reward, a second generation whose reward pays the moved policy's KL."""
    ref = reference()["cases"][case]
    rows = trained(rloo_config(tmp_path, case, steps=2, iterations=ref["iterations"]))
    assert len(rows) == len(ref["curve"]) == 2
    assert_all_metrics(rows[0], ref["first"], f"{case} first")
    for ours, row in zip(rows, ref["curve"]):
        assert_all_metrics(ours, row, f"{case} step {row['step']}")
    with np.load(tmp_path / "run" / "rollouts" / "generation_000000.npz") as f:
        batch = {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("0/")}
    g = grpo_reference()["settings"]["num_generations"]
    scored = batch["weights"] > 0
    for key, theirs in ref["first"]["rows"].items():
        p, j = map(int, key.split("/"))
        at = scored & (batch["completion"] == 1 + p * g + j)
        np.testing.assert_allclose(batch["advantages"][at], theirs["advantage"], rtol=1e-6, atol=1e-6, err_msg=key)
    if case == "beta=0.05":  # (the reference is the policy until it moves: the second generation pays a KL)
        assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 1e-3
    jax.clear_caches()


@pytest.mark.slow  # (the full suite)
def test_grpo_logs_the_metrics_trl_logs_that_its_tests_leave_out(tmp_path):
    """TRL's cumulative num_tokens and the clipped share's min and max over completions (clip_ratio/low_min,
    /high_max), on a GRPO curve whose second pass clips: TRL's numbers."""
    rows = trained(run_config(tmp_path, "grpo", steps=2))
    theirs = grpo_reference()["curves"]["grpo"]
    for name in ("num_tokens", "clip_ratio/low_min", "clip_ratio/high_max"):
        for ours, row in zip(rows, theirs):
            if name in row:
                assert ours[name] == pytest.approx(row[name], rel=1e-6, abs=1e-7), (name, row["step"])
    assert any(row["clip_ratio/high_max"] > 0 for row in theirs)
