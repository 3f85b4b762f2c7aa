"""Bad input to python -m seqjax.train that only shows once the tokenizer is known."""

from __future__ import annotations

import pytest

from test_train_support import tiny_overrides

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused_before_training(tiny_root, tmp_path, capsys):
    """Out-of-range ids cannot raise under jit (they give NaN), so the CLI refuses the config up front."""
    from seqjax.main.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(tiny_overrides(tiny_root, tmp_path / "run", **{"model.vocab_size": 100}))
    assert exit_info.value.code == 2
    assert "model.vocab_size: got 100, expected at least the tokenizer's 300" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_vocabulary_check_runs_before_any_token_store_is_built(tiny_root, tmp_path, capsys):
    from seqjax.main.train import main

    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_overrides(tiny_root, tmp_path / "run", **{"model.vocab_size": 100, "data.cache_dir": cache}))
    assert exit_info.value.code == 2
    assert "model.vocab_size: got 100, expected at least the tokenizer's" in capsys.readouterr().err
    assert (cache / "tokenizers").is_dir() and not (cache / "stores").exists()


def test_the_log_names_the_config_file_and_overrides_and_says_each_notice_once(tiny_root, tmp_path):
    """Issue: every command printed the whole resolved config (about 150 lines) on stdout ahead of its JSON line,
    and a notice such as 'attention auto' four times. stdout is now the JSON summary alone; stderr names
    config.yaml and the overrides once, and says each notice once."""
    import json

    from test_train_support import run_cli

    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.steps": 3, "train.eval_every": 2,
                                                      "model.attention": "auto"})
    proc = run_cli(overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stdout.strip().splitlines()
    assert json.loads(line)["steps"] == 3
    assert proc.stderr.count(f"resolved config: {run_dir / 'config.yaml'}") == 1
    assert proc.stderr.count("overrides: run.dir=") == 1
    assert proc.stderr.count("attention auto: using xla") == 1
