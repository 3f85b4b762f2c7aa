"""eval and generate refuse, with one line and exit code 2, what cannot work with a trained run: a tokenizer the
model cannot read (too many tokens, or not the run's own), shapes that do not fit the checkpoint, a NaN
temperature; nothing is scored, and no traceback from orbax's threads reaches stderr."""

from __future__ import annotations

import pytest

from seqjax.config.load import load_config
from seqjax.store.build import prepare
from test_train_support import tiny_overrides

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def other_tokenizer(tiny_root, tmp_path, vocab_size: int) -> str:
    """A tokenizer trained on the tiny corpus with another vocabulary size (the tiny corpus caps it at 329)."""
    config = load_config(None, tiny_overrides(tiny_root, tmp_path / "unused", **{
        "tokenizer.vocab_size": vocab_size, "data.cache_dir": tmp_path / f"cache{vocab_size}"}))
    return str(prepare(config, splits=()).tokenizer.path)


def exits_2(main, argv: list[str], capfd) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err
    (line,) = [line for line in err.splitlines() if " ERROR " in line]
    return line


def test_eval_refuses_a_tokenizer_with_more_tokens_than_the_model_or_not_the_runs_own(reference, tiny_root,
                                                                                     tmp_path, capfd):
    from seqjax.main.eval import main

    run = str(tiny_root / "reference")
    bigger = other_tokenizer(tiny_root, tmp_path, 400)
    line = exits_2(main, ["--run", run, f"tokenizer.path={bigger}"], capfd)
    assert f"tokenizer {bigger}: 329 tokens, more than the model.vocab_size=300 of {run}" in line
    same_size = other_tokenizer(tiny_root, tmp_path, 280)
    line = exits_2(main, ["--run", run, f"tokenizer.path={same_size}"], capfd)
    assert f"is not the one {run} was trained with" in line


def test_eval_refuses_a_model_size_the_checkpoint_does_not_have_with_one_line(reference, tiny_root, capfd):
    from seqjax.main.eval import main

    line = exits_2(main, ["--run", str(tiny_root / "reference"), "model.vocab_size=1000"], capfd)
    assert "does not fit the model asked for (model.vocab_size: 300 -> 1000)" in line
    assert "embed/embedding: checkpoint (300, 32) float32, now (1000, 32) float32" in line


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_generate_refuses_a_sampling_setting_that_is_not_a_finite_number(reference, tiny_root, capfd, flag, value):
    from seqjax.main.generate import main

    line = exits_2(main, ["--run", str(tiny_root / "reference"), "--prompt", "the", flag, value], capfd)
    assert f"{flag}: got {value}, expected" in line


def test_export_and_init_from_refuse_a_step_whose_run_tokenizer_was_replaced(reference, tiny_root, tmp_path, capfd):
    """A resume that retrained the tokenizer leaves older steps trained with the old one: every reader checks."""
    import shutil

    from seqjax.main.export import main as export
    from seqjax.main.train import main as train

    run = tmp_path / "run"
    shutil.copytree(tiny_root / "reference", run)
    shutil.copyfile(other_tokenizer(tiny_root, tmp_path, 280), run / "tokenizer.json")
    step = run / "checkpoints" / "60"
    line = exits_2(export, ["--checkpoint", str(step), "--out", str(tmp_path / "hf")], capfd)
    assert f"is not the one {step} was trained with" in line and "(the run folder's own tokenizer.json)" in line
    assert not (tmp_path / "hf").exists()
    line = exits_2(train, tiny_overrides(tiny_root, tmp_path / "tuned", **{"train.init_from": step}), capfd)
    assert f"is not the one {step} was trained with" in line and "(train.init_from)" in line
    assert not (tmp_path / "tuned").exists()


def test_eval_and_generate_agree_on_the_trained_length(tiny_root, tmp_path, capfd):
    """A run trained on 32-token rows saves model.max_seq_len=32: eval refuses a longer context, as generate does."""
    from seqjax.main.eval import main as evaluate
    from test_train_support import assert_ok, run_cli

    run = tmp_path / "run"
    assert_ok(run_cli(tiny_overrides(tiny_root, run, **{"model.max_seq_len": "null", "train.steps": 2,
                                                        "train.checkpoint_every": 2})))
    line = exits_2(evaluate, ["--run", str(run), "eval.context=128"], capfd)
    assert "eval.context: got 128, expected at most model.max_seq_len=32, the longest sequence the model was " \
           "trained on (add model.max_seq_len=128 to evaluate beyond it anyway)" in line


def test_eval_names_the_step_it_scored_and_keeps_each_result_in_the_run(reference, tiny_root, tmp_path, capfd):
    import json
    import shutil

    from seqjax.main.eval import main as evaluate

    run = tmp_path / "run"
    shutil.copytree(tiny_root / "reference", run)
    for mode in ("blocks", "sliding"):
        evaluate(["--run", str(run), f"eval.mode={mode}"])
        printed = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
        assert printed["checkpoint_step"] == 60
    results = json.loads((run / "eval_results.json").read_text())
    assert sorted(results) == ["valid/blocks/step60", "valid/sliding/step60"]
    assert results["valid/sliding/step60"]["nll_sum"] == printed["nll_sum"]
