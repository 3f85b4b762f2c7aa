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
