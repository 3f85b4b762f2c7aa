"""What a new user and a fault campaign found in RL runs (issue 56), each held to what it should do: a prompt run's
default loss type from a saved config, rows sized to the groups, replayed completions checked whole and cut as
sampling cuts, reward functions called with TRL 1.16's keywords and their failures named, reward on the console,
summary.json and loss.png, completions tables at N, 2N, ..., damaged or unwritable rollouts in one line."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.core.errors import DataError
from seqjax.train.rewards import Reward, RewardError, TrainerState, advantages, score
from test_one_line_errors import run
from test_rl_run import rl_overrides, write_prompts
from test_train_support import assert_ok, run_cli

REWARDS = Path(__file__).parent / "grpo_rewards.py"


def test_a_prompt_run_trains_dapo_from_a_saved_configs_lm_but_keeps_an_explicit_choice(tmp_path):
    """A saved config.yaml holds objective [lm] (its run's); under data.format=prompt on the command line, lm can
    never train, so TRL's default loss type takes its place. Named on the command line, it stays (and is refused
    as the batches are)."""
    saved = tmp_path / "config.yaml"
    load_config(None, ["data.corpus=jsonl"]).save(saved)
    assert "- lm" in saved.read_text()
    assert load_config(saved, ["data.format=prompt"]).train.objective == ["dapo"]
    assert load_config(saved, ["data.format=prompt", "train.objective=lm"]).train.objective == ["lm"]
    assert load_config(saved, ["data.format=prompt", "train.objective=grpo"]).train.objective == ["grpo"]
    assert load_config(saved).train.objective == ["lm"]


def rl_config(tmp_path: Path, *extra: str):
    return load_config(None, [a for a in rl_overrides(tmp_path, tmp_path / "run") if not a.startswith("run.")]
                       + list(extra))


@pytest.fixture(scope="module")
def tokenizer_and_prompts(tmp_path_factory):
    from seqjax.store.build import prepare
    from seqjax.train.rollouts import load_prompts

    folder = tmp_path_factory.mktemp("rl")
    write_prompts(folder, 6)
    config = rl_config(folder)
    tokenizer = prepare(config, splits=()).tokenizer
    prompts, stop_ids = load_prompts(config, tokenizer)
    return folder, tokenizer, prompts, stop_ids


def test_rows_are_sized_to_the_groups_unless_the_command_line_asks_for_more(tokenizer_and_prompts, caplog):
    """The documented run's base config asks 16 rows for 4 groups a step: the rows are sized to what the groups
    take at worst (here 4: a group a row), said in one line; 16 given on the command line stays, with one line
    saying how much of it is padding."""
    from seqjax.train.rollouts import sized_rows

    folder, _, prompts, _ = tokenizer_and_prompts
    file = folder / "base.yaml"
    load_config(None, ["data.batch_size=16"]).save(file)
    config = load_config(file, [a for a in rl_overrides(folder, folder / "run") if "batch_size" not in a])
    with caplog.at_level(logging.INFO):
        sized = sized_rows(config, prompts, shards=1)
    assert config.data.batch_size == 16 and sized.data.batch_size == 4
    assert "data.batch_size: 4 rows a step" in caplog.text and "would be at least 75% padding" in caplog.text
    padded = rl_config(folder, "rl.layout=padded", "data.batch_size=40")
    assert sized_rows(padded, prompts, shards=1).data.batch_size == 40  # (given: kept)
    assert "data.batch_size=40: a step's 4 group(s) take at most 32 rows" in caplog.text
    assert sized_rows(rl_config(folder, "rl.layout=padded", "data.batch_size=16"), prompts, 1).data.batch_size == 16
    three = load_config(file, [a for a in rl_overrides(folder, folder / "run") if "batch_size" not in a]
                        + ["rl.prompts_per_step=3"])
    assert sized_rows(three, prompts, shards=2).data.batch_size == 4  # (3 rows, rounded up to the shards)


def rollouts_file(folder: Path, lines: list, name: str = "r.jsonl") -> Path:
    path = folder / name
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return path


def test_a_rollouts_file_is_checked_whole_and_each_fault_names_its_line(tokenizer_and_prompts, caplog):
    """Every prompt once, by a number the prompts have; at least G completions of text or in-vocabulary ids;
    UTF-8; no lone surrogate: each fault is one line naming the file and line, before any step. A completion
    longer than rl.max_completion_length is cut to it, as sampling cuts it, in one line."""
    from seqjax.store.replay import read_rollouts

    folder, tokenizer, prompts, stop_ids = tokenizer_and_prompts
    good = [{"index": i, "completions": [[5, 6]] * 8} for i in range(len(prompts))]

    def read(lines, *extra):
        config = rl_config(folder, f"rl.rollouts_file={rollouts_file(folder, lines)}", "model.vocab_size=300",
                           *extra)
        return read_rollouts(config, tokenizer, prompts, stop_ids)

    assert sorted(read(good).completions) == list(range(6))
    cases = {
        "index 9 names no prompt; expected 0 to 5": [*good[:5], {"index": 9, "completions": [[1]] * 8}],
        "index 1 again (first at": [*good, {"index": 1, "completions": [[1]] * 8}],
        "has no line for prompt(s) 5 of 6": good[:5],
        "token id 300 is outside the vocabulary; expected ids 0 to 299": [*good[:5], {
            "index": 5, "completions": [[1, 300]] * 8}],
        "is a lone surrogate": [*good[:5], {"index": 5, "completions": ["ab\ud800"] * 8}],
        "is not UTF-8": [*good[:5], b'{"index": 5, "completions": ["\xff"]}'],
        "prompt 5 has 2 completions; expected rl.num_generations=8": [*good[:5], {"index": 5,
                                                                                 "completions": [[1]] * 2}],
    }
    for message, lines in cases.items():
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
            read(lines)
        assert f"r.jsonl:{len(lines)}" in str(err.value) or "no line" in message, (message, str(err.value))
    long = [*good[:5], {"index": 5, "completions": [list(range(1, 21))] * 8}]
    with caplog.at_level(logging.WARNING):
        cut = read(long, "rl.max_completion_length=6").completions[5]
    assert all(c == list(range(1, 7)) for c in cut)
    assert "8 completion(s) longer than rl.max_completion_length=6 (the longest 20 tokens, at" in caplog.text


def test_reward_functions_get_trls_keywords_and_their_faults_are_named(caplog):
    """TRL 1.16 passes trainer_state, log_extra and log_metric: a reward that reads them runs, and what it logs
    is kept. None (or NaN) from a function for every completion, and a completion no function scores, are
    warnings naming them, as TRL warns (no numpy noise); an infinity is refused in one line, naming the function
    and the completion; a raising function is named with its file and line."""
    import grpo_rewards
    from seqjax.train.rewards import RewardLogs

    logs = RewardLogs()
    table, total = score([Reward("staged", grpo_rewards.staged)], [], ["p"] * 2, ["a", "b"], [[2, 4], [1, 2]], {},
                         TrainerState(global_step=5, max_steps=10), logs)
    np.testing.assert_allclose(total, [1.5, 0.75])  # (the share of even ids, times 1 + 5/10)
    assert logs.columns == {"length": [2, 2]} and logs.means() == {"staged/step": 5.0}
    with caplog.at_level(logging.WARNING), _no_numpy_warnings():
        _, total = score([Reward("silent", lambda **_: [None, float("nan")]), Reward("half", lambda **_: [1.0, None])],
                         [], ["p", "q"], ["a", "b"], [[1], [2]], {})
        adv, _ = advantages(total, 2, "group")
    assert "reward silent: returned None (or NaN) for all 2 completions" in caplog.text
    assert "1 of 2 completions got no reward from any of silent, half" in caplog.text
    assert adv[1] == 0.0 and np.isnan(total[1])
    with pytest.raises(RewardError, match=r"reward boom: returned inf for completion 1; expected a finite float"):
        score([Reward("boom", lambda **_: [1.0, float("inf")])], [], ["p"] * 2, ["a", "b"], [[1], [2]], {})


def _no_numpy_warnings():
    import warnings

    class Catch:
        def __enter__(self):
            self.context = warnings.catch_warnings(record=True)
            self.seen = self.context.__enter__()
            warnings.simplefilter("always")
            return self

        def __exit__(self, *exc):
            self.context.__exit__(*exc)
            assert not [w for w in self.seen if "slice" in str(w.message)], [str(w.message) for w in self.seen]

    return Catch()


def test_the_leave_one_out_estimator_is_rloos():
    """RLOO's advantage: a reward less the mean of its group's other scored rewards; an unscored completion is
    left out of its siblings' baselines and gets 0."""
    total = np.asarray([1.0, 2.0, 6.0, np.nan, 0.0, 0.0, 3.0, 1.0])
    adv, zero = advantages(total, 4, "leave_one_out")
    np.testing.assert_allclose(adv, [1 - 4.0, 2 - 3.5, 6 - 1.5, 0.0, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3, 1 - 1.0])
    assert not zero.any()


@pytest.mark.slow  # (command-line runs)
def test_an_rl_run_shows_its_reward_and_writes_tables_at_n_2n(tmp_path):
    """A 4-step run with a reward that reads TRL's keywords, tables every 2 steps: the plain log line and
    summary.json carry the reward, loss.png plots it, the tables are steps 2 and 4 with the reward's own column,
    its metric and TRL's num_tokens are logged, and the rows are sized to the groups."""
    run_dir = tmp_path / "run"
    proc = run_cli(rl_overrides(tmp_path, run_dir, "train.steps=4", "rl.log_completions_every=2",
                                f"rl.reward_funcs=[{REWARDS}:staged]", "data.batch_size=4"))
    assert_ok(proc)
    assert "reward " in proc.stderr and "(std " in proc.stderr  # (the plain log line, off a terminal)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"last", "best", "best_step"} <= set(summary["reward"]) and summary["reward"]["generations"] == 4
    assert sorted(p.name for p in (run_dir / "completions").glob("*.jsonl")) == ["step_000002.jsonl",
                                                                                 "step_000004.jsonl"]
    first = json.loads((run_dir / "completions" / "step_000002.jsonl").read_text().splitlines()[0])
    assert "length" in first["extra"]
    from seqjax.train.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["staged/step"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[0]["num_tokens"] < rows[1]["num_tokens"] and rows[0]["padding_fraction"] < 0.5
    assert (run_dir / "loss.png").stat().st_size > 1000


@pytest.mark.slow  # (command-line runs)
def test_damaged_or_unwritable_rollouts_are_one_line_and_lose_nothing(tmp_path):
    """A generation batch cut on disk is set aside and made again when the run resumes inside it (one warning);
    a rollouts folder the run cannot write stops it in one line, its checkpoints and log intact."""
    common = ["rl.steps_per_generation=2", "rl.prompts_per_step=2", "train.checkpoint_every=1"]
    run_dir = tmp_path / "run"
    assert_ok(run_cli(rl_overrides(tmp_path, run_dir, "train.steps=1", *common)))
    npz = run_dir / "rollouts" / "generation_000000.npz"
    npz.write_bytes(npz.read_bytes()[:100])
    resumed = run_cli(rl_overrides(tmp_path, run_dir, "train.steps=2", *common))
    assert_ok(resumed)
    assert "is damaged" in resumed.stderr and "made again" in resumed.stderr
    assert list((run_dir / "rollouts").glob("generation_000000.damaged-*.npz"))
    # (a folder the run cannot write, as a full or read-only disk refuses it: here the folder is a file, which
    # refuses root too)
    folder = run_dir / "rollouts"
    for old in folder.iterdir():
        old.unlink()
    folder.rmdir()
    folder.write_text("not a folder")
    stopped = run("-m", "seqjax.train", *rl_overrides(tmp_path, run_dir, "train.steps=4", *common))
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    (line,) = [line for line in stopped.stderr.splitlines() if " ERROR " in line]
    assert re.search(r"generation_000001.npz could not be written at step 3: \[Errno \d+\] .* The run stops before "
                     r"training on it \(nothing already written is lost\)", line), line
    assert (run_dir / "checkpoints" / "2").is_dir() and folder.read_text() == "not a folder"
