"""The one CLI path: bad input anywhere in a tool is one line and exit code 2; messages share one format and a level."""

from __future__ import annotations

import re

import pytest

from corpus_factory import make_text_corpus
from seqjax.config.load import load_config
from seqjax.core.errors import ConfigError, CorpusError, DataError, SeqjaxError, StoreError, TokenizerError
from seqjax.main import cli

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) seqjax[\w.]*: ")


def test_every_bad_input_error_is_a_seqjax_error_and_still_a_value_error():
    for error in (ConfigError, CorpusError, DataError, StoreError, TokenizerError):
        assert issubclass(error, SeqjaxError) and issubclass(error, ValueError)


def test_a_seqjax_error_inside_the_work_is_one_line_and_exit_code_2(capsys):
    def work(args):
        raise DataError("data.strategy=window: the token store holds 5 tokens, fewer than one row needs")

    with pytest.raises(SystemExit) as exit_:
        cli.run(cli.parser("seqjax-test", "test"), [], work)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert LOG_LINE.match(err) and err.rstrip().endswith(
        "seqjax-test: error: data.strategy=window: the token store holds 5 tokens, fewer than one row needs")


def test_a_bug_keeps_its_traceback():
    def work(args):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        cli.run(cli.parser("seqjax-test", "test"), [], work)


def test_a_corpus_error_in_evals_prepare_exits_2_without_a_traceback(tmp_path, monkeypatch, capsys):
    """eval used to call prepare() outside its try: a missing corpus printed a traceback."""
    from seqjax.main import eval as eval_cli

    config = load_config(None, ["data.corpus=text", "data.train_files=[nowhere.txt]", f"data.dir={tmp_path}",
                                f"data.cache_dir={tmp_path / 'cache'}"])
    monkeypatch.setattr("seqjax.main.trained.load_for_inference", lambda path, overrides: (config, None))
    with pytest.raises(SystemExit) as exit_:
        eval_cli.main(["--run", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "data.train_files: 'nowhere.txt' not found" in err and "Traceback" not in err


def test_a_corpus_error_in_the_data_cli_exits_2(tmp_path, capsys):
    from seqjax.main.data import main

    with pytest.raises(SystemExit) as exit_:
        main(["data.corpus=text", "data.train_files=[nowhere.txt]", f"data.cache_dir={tmp_path}"])
    assert exit_.value.code == 2
    assert "data.train_files: 'nowhere.txt' not found" in capsys.readouterr().err


def test_config_from_a_checkpoint_refuses_config_and_a_missing_folder(tmp_path, capsys):
    from seqjax.main import generate

    cases = [(["--run", str(tmp_path), "--config", "x.yaml", "--prompt", "a"], "--config: the configuration"),
             (["--run", str(tmp_path / "nope"), "--prompt", "a"], "no such folder")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            generate.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_messages_share_one_format_and_the_level_flag_filters_them(tmp_path, capsys):
    from seqjax.main.prepare import main

    overrides = make_text_corpus(tmp_path / "corpus", tmp_path / "cache")
    assert main(overrides) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "seqjax" in line]
    assert any("building the token store" in line for line in err)
    assert err and all(LOG_LINE.match(line) for line in err), err
    assert main([*overrides, "--log-level", "warning"]) == 0
    assert "seqjax.store.build" not in capsys.readouterr().err
    cli.configure_logging("INFO")  # leave the process as the other tests expect it

