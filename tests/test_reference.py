"""The reference model of a preference run, decided in one place (seqjax.weights.reference): a model of the user's
choosing (TRL's ref_model) in the step and precomputed, kept across a resume; and seqjax.eval on a model that never
trained here scoring pairs against its own weights, not a random initialization.

The model and pairs are TRL's (tests/data/preference, made by scripts/make_preference_reference.py): a tiny Qwen3 as
a Hugging Face folder, peft's adapter on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from seqjax.config.tree import ConfigError
from seqjax.core.errors import CheckpointMismatchError
from test_preference_trl import run_config
from test_train_support import train_losses


def reference(kind: str) -> dict:
    from test_preference_trl import reference as trl_reference

    return trl_reference(kind)


def reference_pairs() -> list[dict]:
    """TRL's per-pair log-probabilities of the text pairs (the policy's, and the base's as ref_*)."""
    from test_preference_trl import reference

    return reference("text")["per_pair"]


def pairs_run(tmp_path: Path, name: str, *extra: str):
    config, ref = run_config("text", tmp_path, "train.objective=dpo", "train.steps=3", "train.warmup_steps=0",
                             "train.min_lr_ratio=1.0", "train.lr=1e-3", "train.eval_every=0", "train.log_every=1",
                             "train.checkpoint_every=100", f"run.dir={tmp_path / name}", *extra)
    return config


def rewards(run: Path) -> list[float]:
    from seqjax.train.metrics import read_metrics

    return [row["rewards/margins"] for row in read_metrics(run) if "rewards/margins" in row]


@pytest.mark.slow  # (CLI runs: the full suite and CI)
def test_a_named_reference_that_is_the_base_gives_autos_numbers_in_the_step_and_precomputed(tmp_path):
    """train.reference=<the base's HF folder> under LoRA: the same steps, bit for bit, as the base with the adapters
    off (auto), whether the step runs it or its log-probabilities are precomputed."""
    from seqjax.train.loop import train

    base = tmp_path / "qwen3"
    runs = {"auto": [], "folder": [f"train.reference={base}"],
            "folder, precomputed": [f"train.reference={base}", "train.precompute_reference=true"]}
    losses = {}
    for name, extra in runs.items():
        train(pairs_run(tmp_path, name.replace(", ", "_"), *extra))
        losses[name] = (train_losses(tmp_path / name.replace(", ", "_")), rewards(tmp_path / name.replace(", ", "_")))
    assert (tmp_path / "folder_precomputed" / "reference" / "train.npz").exists()
    assert len(losses["auto"][0]) == 3 and losses["folder"] == losses["auto"]
    np.testing.assert_allclose(list(losses["folder, precomputed"][0].values()), list(losses["auto"][0].values()),
                               rtol=1e-6)


@pytest.mark.slow  # (the fast loop keeps the LoRA and precomputed references)
def test_a_full_fine_tune_against_another_model_computes_dpo_on_its_log_probabilities(tmp_path):
    """A full fine-tune with a reference that is not its starting point: the step-1 loss is DPO's formula on the
    policy's and that model's per-pair log-probabilities, each computed alone; a resume against that folder's
    weights changed is one line."""
    from seqjax.data.pipeline import build_pipeline
    from seqjax.hf import folders as hf
    from seqjax.objectives.base import target_logprobs
    from seqjax.objectives.preference import pair_sums
    from seqjax.store.build import prepare
    from seqjax.train.loop import train

    other = tmp_path / "other"  # the base with every weight scaled: another model of the same shape
    config = pairs_run(tmp_path, "full", "model.lora.rank=0", "train.init_adapter=null",
                       f"train.reference={other}", "train.checkpoint_every=1", "train.steps=2")
    base = Path(config.train.init_from)
    other.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (other / name).write_bytes((base / name).read_bytes())
    save_file({k: v * 1.05 for k, v in load_file(str(base / "model.safetensors")).items()},
              str(other / "model.safetensors"), metadata={"format": "pt"})
    train(config)
    first = train_losses(tmp_path / "full")[1]

    store = prepare(config, splits=("train",)).stores["train"]
    batch = next(iter(build_pipeline(config, store)))
    scored = batch["weights"] > 0
    sums = []
    for folder in (base, other):
        _, model = hf.load(folder, ["model.attention=xla", f"model.max_seq_len={config.data.seq_len}"])
        c, r = pair_sums(target_logprobs(model, batch, None, scored), batch)
        sums.append((np.asarray(c), np.asarray(r)))
    (c, r), (c0, r0) = sums
    valid = np.asarray(pair_sums(np.ones(scored.shape, np.float32), batch)[0]) > 0
    delta = ((c - c0) - (r - r0))[valid]
    expected = float(np.mean(np.logaddexp(0.0, -config.train.beta * delta)))  # -log sigmoid(beta * delta)
    assert abs(delta).max() > 0.05 and first == pytest.approx(expected, rel=1e-5)

    save_file({k: v * 1.1 for k, v in load_file(str(base / "model.safetensors")).items()},
              str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=r"train.reference: .*other has xxh3 .* but checkpoint .* was "
                                                      r"trained against .*other"):
        train(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=3)))


def eval_args(**where) -> argparse.Namespace:
    return argparse.Namespace(config=None, overrides=where.pop("overrides", []), run=where.get("run"),
                              checkpoint=None, hf=where.get("hf"), adapter=None, split=None,
                              per_example=where.get("per_example"))


@pytest.mark.slow  # (CLI runs: the full suite and CI)
def test_eval_scores_pairs_against_a_models_own_weights_when_it_never_trained_and_refuses_a_random_start(tmp_path):
    """seqjax.eval on preference pairs: an imported folder (and --hf) is its own reference, so DPO's loss is ln 2
    exactly and no pair is counted accurate; a run that trained without a reference has none, which is one line,
    until train.reference names one."""
    from seqjax.main import eval as eval_cli
    from seqjax.main import import_hf
    from seqjax.train.loop import train

    config = pairs_run(tmp_path, "sft", "train.objective=sft", "train.steps=1", "model.lora.rank=0",
                       "train.init_adapter=null")
    base = Path(config.train.init_from)
    pairs = config.data.train_files[0]
    data = ["data.corpus=jsonl", "data.format=preference", f"data.valid_files=[{pairs}]",
            f"data.cache_dir={config.data.cache_dir}", f"data.chat_template={config.data.chat_template}",
            "data.seq_len=192", "data.strategy=pack", "data.max_segments_per_row=2", "train.objective=dpo",
            "model.attention=xla", "model.max_seq_len=192"]
    import_hf.main([str(base), "--out", str(tmp_path / "imported")])
    for where in ({"run": str(tmp_path / "imported")}, {"hf": str(base), "per_example": str(tmp_path / "p.jsonl")}):
        result = eval_cli.score(eval_args(overrides=data, **where))
        assert abs(result["loss"] - math.log(2)) < 1e-6 and result["rewards/accuracies"] == 0.0, where
        assert result["rewards/margins"] == 0.0 and result["pairs"] == 16
    # --per-example: a line a pair, the base's log-probabilities of each completion those TRL computed for it
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    theirs = reference_pairs()
    assert [row["pair"] for row in rows] == list(range(16)) and all(row["margin"] == 0.0 for row in rows)
    np.testing.assert_allclose([row["logp_chosen"] for row in rows][:len(theirs)],
                               [p["ref_chosen"] for p in theirs], rtol=2e-6, atol=2e-4)
    np.testing.assert_allclose([row["ref_logp_rejected"] for row in rows][:len(theirs)],
                               [p["ref_rejected"] for p in theirs], rtol=2e-6, atol=2e-4)
    # simpo has no reference: an imported folder is scored alone, each pair's reward beta times its per-token mean
    # (TRL's CPO and SimPO rewards), from the log-probabilities TRL computed for the base
    simpo = [*data[:-3], "train.objective=simpo", "train.beta=2.0", *data[-2:]]
    scored = eval_cli.score(eval_args(overrides=simpo, hf=str(base), per_example=str(tmp_path / "s.jsonl")))
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    lengths = [(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in reference("text")["tokenized"]]
    assert "ref_logp_chosen" not in rows[0] and scored["rewards/margins"] != 0.0
    np.testing.assert_allclose([row["reward_chosen"] for row in rows][:len(theirs)],
                               [2.0 * p["ref_chosen"] / n for p, (n, _) in zip(theirs, lengths)], rtol=2e-6, atol=2e-5)
    margins = [2.0 * (p["ref_chosen"] / n - p["ref_rejected"] / m) for p, (n, m) in zip(theirs, lengths)]
    np.testing.assert_allclose([row["margin"] for row in rows][:len(theirs)], margins, rtol=2e-6, atol=2e-5)
    train(config)  # (sft: no reference model)
    with pytest.raises(ConfigError, match="train.reference: the run was trained without a reference model"):
        eval_cli.score(eval_args(run=str(tmp_path / "sft"), overrides=data))
    named = eval_cli.score(eval_args(run=str(tmp_path / "sft"), overrides=[*data, f"train.reference={base}"]))
    assert named["rewards/margins"] != 0.0 and json.dumps(named)
    # ... but a reference-free objective scores the same run's pairs without one
    alone = eval_cli.score(eval_args(run=str(tmp_path / "sft"), overrides=simpo))
    assert alone["pairs"] == 16 and alone["rewards/margins"] != 0.0
