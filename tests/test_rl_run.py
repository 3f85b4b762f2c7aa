"""An online RL run from the command line (data.format=prompt, docs/rl.md): it samples its own completions, learns a
verifiable reward, writes what it sampled, resumes exactly in the middle of a generation batch, and bad input is
one line. The built-in rewards are TRL's where TRL has them; a reward function is called as TRL calls it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.train.rewards import Reward, RewardError, advantages, extract_answer, load_rewards, same_answer, score
from test_one_line_errors import one_line, run
from test_train_support import assert_ok, run_cli, train_losses

DATA = Path(__file__).parent / "data" / "grpo"
EVEN = str(Path(__file__).parent / "grpo_rewards.py") + ":even_tokens"


def write_prompts(folder: Path, n: int = 64) -> Path:
    rng = random.Random(0)
    path = folder / "prompts.jsonl"
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def rl_overrides(folder: Path, run_dir: Path, *extra: str) -> list[str]:
    """A 2-layer model on a tokenizer of the prompts themselves, 8 completions of at most 6 tokens a prompt."""
    prompts = folder / "prompts.jsonl"
    if not prompts.exists():
        write_prompts(folder)
    return [f"run.dir={run_dir}", "data.corpus=jsonl", "data.format=prompt", f"data.train_files=[{prompts}]",
            f"data.cache_dir={folder / 'cache'}", "data.seq_len=64", "data.batch_size=4", "tokenizer.vocab_size=300",
            "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
            "model.max_seq_len=64", "model.attention=xla", "rl.num_generations=8", "rl.prompts_per_step=4",
            "rl.max_completion_length=6", f"rl.reward_funcs=[{EVEN}]", "train.lr=1e-2", "train.warmup_steps=0",
            "train.schedule=constant", "train.eval_every=0", "train.checkpoint_every=100", "train.log_every=1",
            *extra]


def rewards_of(run_dir: Path) -> list[float]:
    from seqjax.train.metrics import read_metrics

    return [row["reward"] for row in read_metrics(run_dir) if "reward" in row]


@pytest.mark.slow  # (an end-to-end run: the full suite and CI)
def test_a_grpo_run_samples_its_own_completions_and_learns_a_verifiable_reward(tmp_path):
    """30 steps of DAPO (TRL's default loss type) on 8 completions of each of 4 prompts a step, sampled by the
    policy being trained: the share of even token ids it writes (the reward) climbs from chance to nearly all;
    the completions tables and the last two generation batches are on disk."""
    run_dir = tmp_path / "run"
    assert_ok(run_cli(rl_overrides(tmp_path, run_dir, "train.steps=30", "rl.log_completions_every=10")))
    rewards = rewards_of(run_dir)
    assert len(rewards) == 30
    assert np.mean(rewards[:3]) < 0.6 and np.mean(rewards[-5:]) > 0.85, rewards
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == ["generation_000028.npz",
                                                                         "generation_000029.npz"]
    table = [json.loads(line) for line in (run_dir / "completions" / "step_000010.jsonl").read_text().splitlines()]
    assert len(table) == 32 and {"prompt", "completion", "rewards", "advantage"} <= set(table[0])
    markdown = (run_dir / "completions" / "step_000010.md").read_text()
    assert "| prompt | completion | even_tokens | advantage |" in markdown


@pytest.mark.slow
def test_a_run_cut_in_the_middle_of_a_generation_batch_resumes_exactly(tmp_path):
    """A generation batch trained on for 4 steps (2 steps of it, twice: rl.steps_per_generation=2,
    rl.num_iterations=2), cut after step 3 and resumed: the uninterrupted run's losses, bit for bit (the batch is
    read back from run.dir/rollouts/, and the next one sampled with the same keys)."""
    common = ["rl.steps_per_generation=2", "rl.num_iterations=2", "rl.prompts_per_step=2", "train.checkpoint_every=3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_ok(run_cli(rl_overrides(tmp_path, whole, "train.steps=6", *common)))
    assert_ok(run_cli(rl_overrides(tmp_path, cut, "train.steps=3", *common)))
    resumed = run_cli(rl_overrides(tmp_path, cut, "train.steps=6", *common))
    assert_ok(resumed)
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from"] == 3
    assert train_losses(cut) == train_losses(whole) and len(train_losses(whole)) == 6


@pytest.mark.slow  # (a dozen CLI refusals: the full suite)
def test_bad_rl_input_is_one_line(tmp_path):
    (tmp_path / "no_prompt.jsonl").write_text(json.dumps({"question": "1+1="}) + "\n")
    (tmp_path / "rollouts.jsonl").write_text('{"index": 0, "completions": [[1, 2], "x"]}\n{"index": 1}\n')
    write_prompts(tmp_path, 4)
    cases = {
        f"data.train_files=[{tmp_path / 'no_prompt.jsonl'}]": "no_prompt.jsonl:1",
        "rl.reward_funcs=[no_such_module:reward]": "rl.reward_funcs[0]: 'no_such_module:reward' could not be loaded",
        f"rl.rollouts_file={tmp_path / 'rollouts.jsonl'}": "rollouts.jsonl:1: prompt 0 has 2 completions",
        "rl.max_completion_length=60": "rl.layout=prompt_once: a group with its prompt takes",
    }
    for override, message in cases.items():
        proc = run("-m", "seqjax.train", *rl_overrides(tmp_path, tmp_path / "run", "train.steps=1", override))
        assert message in one_line(proc), (override, proc.stderr[-1500:])


def test_the_built_in_rewards_are_trls(tmp_path):
    """format is TRL's think_format_reward and length its soft overlong punishment, on TRL's own outputs
    (scripts/make_grpo_reference.py)."""
    ref = json.loads((DATA / "grpo.json").read_text())["rewards"]
    over = ref["overlong"]
    config = load_config(None, ["data.corpus=jsonl", "data.format=prompt", "rl.reward_funcs=[format,length]",
                                f"rl.max_completion_length={over['max_completion_len']}",
                                f"rl.overlong_buffer={over['soft_punish_cache']}"])
    fmt, length = load_rewards(config)
    texts = ref["format_texts"]
    assert fmt.fn(prompts=texts, completions=texts, completion_ids=[[1]] * len(texts)) == ref["think_format_reward"]
    ids = [list(range(n)) for n in over["lengths"]]
    assert length.fn(prompts=ids, completions=ids, completion_ids=ids) == over["rewards"]


@pytest.mark.parametrize("text, answer, right", [
    ("so the sum is \\boxed{12}.", "12", True), ("\\boxed{\\frac{1}{2}} or 7", "0.5", False),
    ("first 3, then 1,000", "1000", True), ("it is 0.5", "1/2", True), ("Paris.", "paris", True),
    ("\\boxed{x^{2}}", "x^{2}", True), ("11", "12", False)])
def test_accuracy_reads_the_last_boxed_answer_else_the_last_number(text, answer, right):
    assert same_answer(extract_answer(text), answer) is right


def test_a_reward_function_is_called_as_trl_calls_it_and_its_failures_are_one_line():
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(columns, n=len(completions))
        return [None if c == "skip" else float(len(c)) for c in completions]

    table, total = score([Reward("spy", spy), Reward("one", lambda **_: [1.0, 1.0, None])], [1.0, 2.0],
                         ["p"] * 3, ["ab", "skip", "c"], [[1], [2], [3]], {"answer": ["1", "2", "3"]})
    # (TRL 1.16's keywords beside the columns: the run's state, and two loggers)
    assert set(seen) == {"answer", "n", "trainer_state", "log_extra", "log_metric"}
    assert seen["answer"] == ["1", "2", "3"] and seen["n"] == 3 and seen["trainer_state"].global_step == 0
    np.testing.assert_array_equal(total, [4.0, 2.0, 1.0])  # (None is no score: the others still add up)
    assert np.isnan(table[1, 0])
    adv, zero = advantages(np.asarray([1.0, 3.0, 2.0, 2.0]), 2, "group")
    np.testing.assert_allclose(adv, [-1 / (np.sqrt(2) + 1e-4), 1 / (np.sqrt(2) + 1e-4), 0, 0], rtol=1e-6)
    assert zero.tolist() == [False, False, True, True]
    raised = "reward bad: raised ZeroDivisionError at .*test_rl_run.py:LINE: division by zero"
    for fn, message in ((lambda **_: 1 / 0, raised),
                        (lambda **_: [1.0], "reward bad: returned 1 rewards for 3 completions"),
                        (lambda **_: ["x", 1, 2], "reward bad: returned ['x', 1, 2]...; expected floats or None")):
        pattern = message.replace("[", r"\[").replace("(", r"\(").replace("LINE", r"\d+")
        with pytest.raises(RewardError, match=pattern):
            score([Reward("bad", fn)], [], ["p"] * 3, ["a", "b", "c"], [[1]] * 3, {})
    with pytest.raises(ConfigError, match="rl.reward_funcs\\[0\\]: got 'nope', expected one of accuracy"):
        load_rewards(load_config(None, ["data.corpus=jsonl", "data.format=prompt", "rl.reward_funcs=[nope]"]))


def test_the_data_command_lays_out_and_draws_a_generation_batch(tmp_path):
    """seqjax.data on prompts: the first generation batch in each layout, the prompt-once layout computing fewer
    positions than one sequence per completion (as many as it, for the other two), and its picture."""
    from seqjax.main import data

    common = [a for a in rl_overrides(tmp_path, tmp_path / "run") if not a.startswith(("run.dir", "train."))]
    stats = {}
    for layout in ("prompt_once", "prompt_per_completion", "padded"):
        rows = "data.batch_size=4" if layout == "prompt_once" else "data.batch_size=32"
        stats[layout] = data.describe(data_args(tmp_path, [*common, rows, f"rl.layout={layout}"]))
    once = stats["prompt_once"]
    assert once["groups"] == 4 and once["completions"] == 32 and once["positions"] < \
        once["positions_one_sequence_per_completion"]
    assert stats["padded"]["positions"] == stats["prompt_per_completion"]["positions"] == \
        once["positions_one_sequence_per_completion"]
    data.describe(data_args(tmp_path, [*common, "data.batch_size=4"], plot=str(tmp_path / "group.png")))
    assert (tmp_path / "group.png").stat().st_size > 1000


def data_args(tmp_path: Path, overrides: list[str], plot: str | None = None):
    import argparse

    return argparse.Namespace(config=None, overrides=overrides, split="train", dump=None, show_config=False,
                              batches=1, plot=plot, steps=1)


@pytest.mark.slow  # (the full suite: the fast loop was 8 min with it)
def test_lora_grpo_with_a_kl_term_starts_at_exactly_zero(tmp_path):
    """LoRA adapters start with B = 0, so at step 1 the reference (the base, adapters off) is the policy: the KL is
    exactly 0, then grows as the adapters move."""
    from seqjax.train.metrics import read_metrics

    run_dir = tmp_path / "run"
    assert_ok(run_cli(rl_overrides(tmp_path, run_dir, "train.steps=3", "model.lora.rank=4", "model.lora.alpha=8",
                                   "rl.beta=0.04", "train.lr=5e-2")))
    kl = [row["kl"] for row in read_metrics(run_dir) if "kl" in row]
    assert kl[0] == 0.0 and kl[2] > 1e-6, kl


@pytest.mark.slow
def test_qlora_grpo_on_a_mesh_takes_the_one_device_steps(tmp_path):
    """QLoRA (an nf4 base), scanned and rematerialized: two host devices as an fsdp mesh sample the same
    completions and take the one-device run's losses."""
    common = ["train.steps=3", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.quantize=nf4",
              "model.lora.quant_block=16", "model.scan_layers=true", "model.remat=full"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(rl_overrides(tmp_path, one, *common)))
    assert_ok(run_cli(rl_overrides(tmp_path, two, *common, "mesh.data=1", "mesh.fsdp=2"), devices=2))
    a, b = train_losses(one), train_losses(two)
    assert rewards_of(one) == pytest.approx(rewards_of(two), abs=1e-6)
    assert sorted(a) == [1, 2, 3] and all(abs(a[k] - b[k]) < 2e-5 for k in a), (a, b)
