"""GRPO and its variants against TRL 1.16's own GRPOTrainer: the same tiny Qwen3 with LoRA, the same prompts, the
same completions, the same reward functions.

The reference (tests/data/grpo/grpo.json) was made by TRL itself, from the committed script
scripts/make_grpo_reference.py: the preference references' Qwen3 and peft adapter, four prompts (one with no
``target``), four completions each given to TRL's trainer through its ``rollout_func`` (some closed by the EOS,
some cut at ``max_completion_length``), and two reward functions, tests/grpo_rewards.py's, weighted 1 and 0.5.
Here seqjax reads the same model (``train.init_from``, ``train.init_adapter``), the same prompts
(``data.format=prompt``), replays the same completions (``rl.rollouts_file``) and imports the same reward
functions (``rl.reward_funcs=[grpo_rewards:...]``), then trains through its own loop; and:

- each completion's advantage and per-token log-probabilities are TRL's;
- every loss type's first-step loss, gradient norm and every metric TRL logs are TRL's, in each layout;
- two steps with ``num_iterations=2`` (the ratio leaves 1, the clip and the KL to the reference work) follow
  TRL's logged rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from seqjax.hf import folders as hf
from test_preference_trl import folders, models

DATA = Path(__file__).parent / "data" / "grpo"
# TRL logs these and seqjax does not: its own token count (seqjax logs tokens_seen, the tokens it computes), and
# the min and max over completions of the clipped share (docs/rl.md)
NOT_REPORTED = {"num_tokens", "clip_ratio/low_min", "clip_ratio/high_max"}
CASES = {"": [], "scale_rewards=batch": ["rl.scale_rewards=batch"], "scale_rewards=none": ["rl.scale_rewards=none"],
         "sequence": ["rl.importance_sampling_level=sequence"],
         # (TRL copies a PEFT model's pretrained adapter as its reference: train.reference=copy)
         "beta=0.1": ["rl.beta=0.1", "train.reference=copy"], "mask_truncated": ["rl.mask_truncated_completions=true"]}


def reference() -> dict:
    return json.loads((DATA / "grpo.json").read_text())


def run_config(tmp_path: Path, case: str, layout: str = "prompt_once", steps: int = 1):
    """The reference's model, prompts and completions as a seqjax run of ``case`` (``loss_type/setting``)."""
    ref = reference()
    base, adapter = folders(ref, tmp_path)
    prompts, rollouts = tmp_path / "prompts.jsonl", tmp_path / "rollouts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in ref["prompts"]))
    rollouts.write_text("".join(json.dumps({"index": i, "completions": c}) + "\n"
                                for i, c in enumerate(ref["completions"])))
    s = ref["settings"]
    specials = [t["content"] for t in json.loads((base / "tokenizer.json").read_text())["added_tokens"]]
    loss_type, _, setting = case.partition("/")
    rows = len(ref["prompts"]) * (1 if layout == "prompt_once" else s["num_generations"])
    return hf.run_config(hf.read_folder(base), [
        "data.corpus=jsonl", "data.format=prompt", f"data.train_files=[{prompts}]", f"data.cache_dir={tmp_path / 'c'}",
        "data.seq_len=64", "data.shuffle=false", f"data.batch_size={rows}",
        f"tokenizer.special_tokens={json.dumps(['<|im_end|>', *[t for t in specials if t != '<|im_end|>']])}",
        f"train.init_from={base}", f"train.init_adapter={adapter}", f"model.lora.rank={s['rank']}",
        f"model.lora.alpha={s['alpha']}", "model.attention=xla", "model.max_seq_len=64",
        *([] if loss_type == "dapo" else [f"train.objective={loss_type}"]),
        f"rl.num_generations={s['num_generations']}", f"rl.prompts_per_step={len(ref['prompts'])}",
        f"rl.max_completion_length={s['max_completion_length']}",
        "rl.reward_funcs=[grpo_rewards:even_tokens,grpo_rewards:near_target]",
        f"rl.reward_weights={s['reward_weights']}", f"rl.rollouts_file={rollouts}", f"rl.layout={layout}",
        f"rl.num_iterations={steps}", f"train.steps={steps}", f"train.lr={s['lr']}", "train.warmup_steps=0",
        "train.min_lr_ratio=1.0", "train.weight_decay=0.0", "train.b2=0.999", "train.grad_clip=1.0",
        "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=100", f"run.dir={tmp_path / 'run'}",
        *CASES[setting]])


def trained(config) -> list[dict]:
    from seqjax.train.loop import train
    from seqjax.train.metrics import read_metrics

    train(config)
    jax.clear_caches()
    return [row for row in read_metrics(Path(config.run.dir)) if "loss" in row]


def assert_trls(ours: dict, theirs: dict, case: str) -> None:
    """The loss, the gradient's norm before clipping, and every metric TRL logs but NOT_REPORTED."""
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-5, abs=2e-6), case
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-5, abs=2e-7), case
    named = {k: v for k, v in theirs.get("metrics", theirs).items()
             if k not in NOT_REPORTED | {"loss", "grad_norm", "learning_rate", "step", "step_time", "epoch"}}
    assert set(named) <= set(ours), (case, set(named) - set(ours))
    for name, value in named.items():
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=2e-6), (case, name, ours[name], value)


@pytest.mark.slow  # (the full suite: the fast loop was 8 min with it)
def test_advantages_and_per_token_log_probabilities_are_trls_and_the_default_loss_type_is_dapo(tmp_path):
    """From the generation batch the run wrote (run.dir/rollouts/): each completion's advantage and the policy's
    log-probability of each of its tokens, the EOS that closed it included, as TRL computed them; and TRL's
    default loss type's first step."""
    config = run_config(tmp_path, "dapo")
    assert config.train.objective == ["dapo"]  # (not named: TRL's default loss type is a prompt run's default)
    ours = trained(config)[0]
    ref = reference()
    assert_trls(ours, ref["cases"]["dapo"], "dapo")
    with np.load(tmp_path / "run" / "rollouts" / "generation_000000.npz") as f:
        batch = {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith("0/")}
    policy, _ = models(config)
    from seqjax.objectives.base import target_logprobs

    scored = batch["weights"] > 0
    logps = np.asarray(target_logprobs(policy, {k: jax.numpy.asarray(v) for k, v in batch.items()}, None,
                                       jax.numpy.asarray(scored)))
    g = ref["settings"]["num_generations"]
    seen = set()
    for key, theirs in ref["cases"]["dapo"]["rows"].items():
        p, j = map(int, key.split("/"))
        at = scored & (batch["completion"] == 1 + p * g + j)
        np.testing.assert_allclose(logps[at], theirs["logps"], rtol=1e-5, atol=3e-5, err_msg=key)
        np.testing.assert_allclose(batch["advantages"][at], theirs["advantage"], rtol=1e-6, atol=1e-6,
                                   err_msg=key)
        seen.add(key)
    assert len(seen) == len(ref["completions"]) * g
    jax.clear_caches()


FIRST_STEPS = ["grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo", "dapo/scale_rewards=batch",
               "dapo/scale_rewards=none", "grpo/sequence", "dapo/beta=0.1", "dapo/mask_truncated"]
FAST = {"dapo/mask_truncated"}  # (the default loss type in the fast loop; every other in the full suite)


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in FIRST_STEPS])
def test_each_loss_types_first_step_and_metrics_are_trls(case, tmp_path):
    """Each loss type (and dapo under each reward scaling, truncated completions masked, a KL term) on the same
    completions: the loss, the gradient's norm and every metric TRL logs."""
    ours = trained(run_config(tmp_path, case))[0]
    assert_trls(ours, reference()["cases"][case], case)


CURVES = [("grpo", "prompt_once"), ("dapo/beta=0.1", "prompt_once"), ("cispo", "padded"),
          ("grpo/sequence", "prompt_per_completion"), ("dapo", "padded")]


@pytest.mark.slow  # (the fast loop keeps the first step against TRL's)
@pytest.mark.parametrize("case,layout", CURVES)
def test_two_passes_over_one_generation_batch_follow_trls_rows(case, layout, tmp_path):
    """rl.num_iterations=2: the second step trains on the same completions with the policy moved, against the
    log-probabilities they were sampled with (the ratio leaves 1: clipping) and, with rl.beta, against the
    adapter's starting copy (the KL leaves 0): every logged row is TRL's, whichever way the groups are laid out."""
    rows = trained(run_config(tmp_path, case, layout, steps=2))
    theirs = reference()["curves"][case]
    assert len(rows) == len(theirs) == 2
    for ours, row in zip(rows, theirs):
        assert_trls(ours, row, f"{case} step {row['step']}")
    if "beta" in case:
        assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 1e-3  # (the reference is the policy until it moves)


@pytest.mark.slow
def test_the_grpo_lora_config_samples_trains_and_exports_at_a_reduced_size(tmp_path):
    """configs/qwen3_grpo_lora.yaml with the model reduced to the reference Qwen3 (its folder's path alone), on
    conversational prompts through the shipped qwen3 template: it samples, scores with accuracy and format,
    trains scanned and rematerialized with the loss in chunks and two micro-batches, logs its completions, and
    its exported adapter reads back onto the base."""
    from seqjax.main import export
    from seqjax.weights.inference import with_adapter
    from test_train_support import REPO, assert_ok, run_cli

    base, _ = folders(reference(), tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                           "answer": str(a + b)}) + "\n" for a, b in ((1, 2), (3, 4), (5, 6))))
    run = tmp_path / "run"
    overrides = [f"run.dir={run}", f"train.init_from={base}", f"data.train_files=[{prompts}]",
                 f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=256", "data.batch_size=2",
                 "model.max_seq_len=256", "model.loss_chunk_tokens=64", "model.param_dtype=float32",
                 "model.compute_dtype=float32", "model.lora.rank=4", "model.lora.alpha=8", "rl.num_generations=4",
                 "rl.prompts_per_step=2", "rl.max_completion_length=16", "rl.log_completions_every=1",
                 "train.steps=2", "train.warmup_steps=0", "train.grad_accum=2", "train.checkpoint_every=2"]
    assert_ok(run_cli(["--config", str(REPO / "configs" / "qwen3_grpo_lora.yaml"), *overrides]))
    from seqjax.train.metrics import read_metrics

    rows = [row for row in read_metrics(run) if "loss" in row]
    assert len(rows) == 2 and all({"reward", "rewards/accuracy/mean", "rewards/format/mean"} <= set(r) for r in rows)
    logged = [json.loads(line) for line in (run / "completions" / "step_000001.jsonl").read_text().splitlines()]
    assert len(logged) == 8 and logged[0]["prompt"].startswith("<|im_start|>user\nWhat is ")
    export.main(["--run", str(run), "--out", str(tmp_path / "exported")])
    config, model = hf.load(base, ["model.attention=xla"])
    config, _ = with_adapter(config, model, str(tmp_path / "exported"))
    assert config.model.lora.rank == 4
