"""The typed config: YAML + dotted overrides, and for every mistake an error naming key, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import all_keys, announce, load_config
from seqjax.config.tree import Config, ConfigError
from seqjax.data.strategies import check_config
from seqjax.main import cli

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "configs" / "wikitext2_cpu.yaml"


def test_overrides_are_typed_and_win_over_the_file():
    config = load_config(
        CPU_CONFIG,
        [
            "data.seq_len=64",
            "train.lr=1e-3",
            "data.shuffle=false",
            "model.n_kv_heads=null",
            "data.bucket_lengths=[8, 16]",
            "run.dir=/tmp/somewhere",
        ],
    )
    assert config.data.seq_len == 64 and isinstance(config.data.seq_len, int)
    assert config.train.lr == 1e-3 and isinstance(config.train.lr, float)
    assert config.data.shuffle is False
    assert config.model.n_kv_heads is None
    assert config.data.bucket_lengths == [8, 16]
    assert config.run.dir == "/tmp/somewhere"
    # keys the override did not touch keep the file's values, the rest the defaults
    in_file = yaml.safe_load(CPU_CONFIG.read_text())
    assert config.model.d_model == in_file["model"]["d_model"] != Config().model.d_model
    assert config.data.batch_size == in_file["data"]["batch_size"]
    assert config.train.z_loss == Config().train.z_loss


def test_every_shipped_config_loads():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.seq_lne=64", "unknown config key 'data.seq_lne'; did you mean data.seq_len?"),
        ("trian.steps=5", "unknown config key 'trian'; did you mean train?"),
        ("zzzz=1", "unknown config key 'zzzz'; run with --help-config"),
        ("data.seq_len.x=1", "unknown config key 'data.seq_len.x'"),
        ("data.seq_len=abc", "data.seq_len: got 'abc', expected an integer"),
        ("data.seq_len=2.5", "data.seq_len: got 2.5, expected an integer"),
        ("data.shuffle=3", "data.shuffle: got 3, expected true or false"),
        ("train.lr=fast", "train.lr: got 'fast', expected a number"),
        ("data.train_files=a.txt", "data.train_files: got 'a.txt', expected list of str"),
        ("data.seq_len=null", "data.seq_len: got null, expected int"),
        ("data.seq_len=1", "data.seq_len: got 1, expected at least 2"),
        ("train.b1=1.5", "train.b1: got 1.5, expected at most 1.0"),
        ("data.strategy=shuffle", "data.strategy: got 'shuffle', expected one of window, random_offset"),
        ("data.strategy=length_grouping", "length_grouped; did you mean length_grouped?"),
        ("data.packer=bestfit", "data.packer: got 'bestfit', expected one of greedy"),
        ("data.packer=bestfit", "; did you mean best_fit?"),
        ("model.n_heads=3", "model.n_heads: got 3, expected a divisor of model.d_model=256"),
        ("data.seq_len=1024", "data.seq_len: got 1024, expected at most model.max_seq_len=512"),
        ("train.grad_accum=3", "train.grad_accum: got 3, expected a divisor of data.batch_size=16"),
        ("tokenizer.vocab_size=1", "tokenizer.vocab_size: got 1, expected more than the 1 special tokens"),
        ("seq_len", "override 'seq_len': expected key=value"),
        ("train.lr=nan", "train.lr: got nan, expected a finite number"),
        ("train.lr=inf", "train.lr: got inf, expected a finite number"),
        ("train.grad_clip=.inf", "train.grad_clip: got inf, expected a finite number"),
    ],
)
def test_bad_override_names_key_value_and_what_is_allowed(override, expected):
    # Pin the sizes the cross-field messages quote, so retuning the shipped config does not move them.
    pinned = ["model.d_model=256", "model.max_seq_len=512", "data.batch_size=16"]
    with pytest.raises(ConfigError) as err:
        load_config(CPU_CONFIG, pinned + [override])
    assert expected in str(err.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.yaml' not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml' is not valid YAML") as err:
        load_config(broken)
    assert "\n" not in str(err.value)  # one line, as every refusal
    with pytest.raises(ConfigError, match="config file .* is a folder"):
        load_config(tmp_path)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections, got list"):
        load_config(listing)
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  seqlen: 5\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'data.seqlen'; did you mean data.seq_len\? \(in .*typo.yaml\)"
    ):
        load_config(typo)
    section = tmp_path / "section.yaml"
    section.write_text("data: 5\n")
    with pytest.raises(ConfigError, match="data: got 5, expected a mapping of DataConfig keys"):
        load_config(section)


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  lr: 0.01\n  warmup_steps: 50\ndata:\n  seq_len: 64\ntrain:\n  steps: 10\n", "train", (1, 6)),
    ("train:\n  lr: 0.01\n  steps: 5\n  lr: 0.02\n", "lr", (2, 4)),
])
def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_it_and_both_lines(tmp_path, text, key, lines):
    """YAML keeps the last of two equal keys: an appended train: block would silently drop the first one's lr."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"twice.yaml': key '{key}' is given twice \(lines {lines[0]} and "
                                          rf"{lines[1]}\)"):
        load_config(path)


def test_cli_exits_with_the_message_before_any_work(capsys):
    p = cli.parser("seqjax.test", "test")
    with pytest.raises(SystemExit) as exit_:
        cli.parse(p, ["--config", str(CPU_CONFIG), "data.seq_lne=5"])
    assert exit_.value.code == 2
    assert "config error: unknown config key 'data.seq_lne'; did you mean data.seq_len?" in capsys.readouterr().err


def test_help_config_lists_every_key(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse(cli.parser("seqjax.test", "test"), ["--help-config"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    leaves = {k for k in all_keys() if "." in k}
    assert leaves <= listed
    from seqjax.objectives import OBJECTIVES  # every objective of the table, one line with its description

    objectives = {line.split()[0]: line for line in out.split("train.objective takes one of these")[1].splitlines()[1:]}
    assert set(objectives) == set(OBJECTIVES) and all(row.doc in objectives[name] for name, row in OBJECTIVES.items())


def test_resolved_config_is_saved_named_with_its_overrides_and_loads_back(tmp_path, caplog, capsys):
    """The file holds every key; the log names it and the overrides (stdout is for results alone)."""
    config = load_config(CPU_CONFIG, ["data.seq_len=64", "train.lr=3e-4", "data.corpus=text",
                                      "data.train_files=[a.txt]"], record=True)
    with caplog.at_level("INFO", logger="seqjax.config"):
        saved = announce(config, tmp_path / "out")
    assert saved == tmp_path / "out" / "config.yaml" and capsys.readouterr().out == ""
    assert f"resolved config: {saved} (from {CPU_CONFIG}; overrides: data.seq_len=64 train.lr=3e-4" in caplog.text
    assert load_config(saved) == config
    # a config read on the way (the run train.init_from names) is not the command's: the line still names its own
    caplog.clear()
    with caplog.at_level("INFO", logger="seqjax.config"):
        announce(config, tmp_path / "again")
    assert f"(from {CPU_CONFIG}; overrides: data.seq_len=64 train.lr=3e-4" in caplog.text


def test_a_quick_run_needs_only_train_steps_and_its_warmup_shrinks_with_one_warning(caplog):
    with caplog.at_level("WARNING", logger="seqjax.config.tree"):
        config = load_config(CPU_CONFIG, ["train.steps=24"])
    assert config.train.warmup_steps == 24
    assert [r.getMessage() for r in caplog.records] == [
        "train.warmup_steps: 70 is longer than train.steps=24; warming up over all 24 steps"]


def test_max_seq_len_follows_the_data_unless_set():
    """The README's data example needs no model limit; an explicit limit is still enforced, eval.context included."""
    from flax import nnx

    from seqjax.model import build_model

    config = load_config(CPU_CONFIG, ["data.strategy=pack", "data.packer=fill", "data.seq_len=512"])
    assert config.model.max_seq_len is None and config.max_seq_len == 512
    assert load_config(CPU_CONFIG, ["eval.context=600"]).max_seq_len == 600
    small = load_config(None, ["data.seq_len=8", "model.d_model=8", "model.n_heads=2", "model.n_layers=1"])
    assert build_model(small, vocab_size=16, rngs=nnx.Rngs(0)).cfg.max_seq_len == 8
    with pytest.raises(ConfigError, match="eval.context: got 256, expected at most model.max_seq_len=128"):
        load_config(CPU_CONFIG, ["model.max_seq_len=128", "eval.context=256"])


def as_commands_load(path, overrides):
    """The config as every command loads it: the tree's checks, then the strategy tables' rules."""
    config = load_config(path, overrides)
    check_config(config)
    return config


@pytest.mark.parametrize("packer", ["fill", "grain_concat_split"])
def test_packers_that_cannot_cap_segments_refuse_max_segments_per_row(packer):
    with pytest.raises(ConfigError, match=f"data.max_segments_per_row: got 2, expected null: packer {packer}"):
        as_commands_load(None, ["data.strategy=pack", f"data.packer={packer}", "data.max_segments_per_row=2"])
    as_commands_load(None, ["data.strategy=window", f"data.packer={packer}", "data.max_segments_per_row=2"])


def test_an_error_names_where_the_value_came_from_the_command_line_or_the_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(CPU_CONFIG, ["train.lr=1e-3", "data.seq_len=abc"])
    assert str(err.value) == "data.seq_len: got 'abc', expected an integer (from the command line: data.seq_len=abc)"
    with pytest.raises(ConfigError, match=r"unknown config key 'data.seq_lne'.* \(from the command line: "):
        load_config(CPU_CONFIG, ["data.seq_lne=5"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"train.lr: got 'fast', expected a number \(in .*bad.yaml\)$"):
        load_config(bad, ["data.seq_len=64"])
    assert load_config(bad, ["train.lr=1e-3"]).train.lr == 1e-3  # a command line that fixes the file wins


def _get(tree, key):
    for part in key.split("."):
        tree = tree[part] if isinstance(tree, dict) else getattr(tree, part)
    return tree


# Every key that holds a value (model.rope_scaling is a section; its fields are the keys).
LEAVES = [k for k in all_keys() if "." in k and "[]" not in k and k != "train.allow_config_change"
          and not isinstance(_get(Config().to_dict(), k), dict)]


@pytest.mark.slow  # (the full suite: 40 draws of changed keys)
@given(st.sets(st.sampled_from(LEAVES), max_size=12))
@settings(max_examples=40, deadline=None)
def test_resume_changes_lists_exactly_the_changed_keys_each_with_its_kind(changed):
    """A checkpoint's config (a dict) differs from the current one in ``changed``: exactly those keys come back."""
    import dataclasses

    from seqjax.config.diff import resume_changes
    from seqjax.config.fields import RESUME_KINDS

    current = Config()
    saved = current.to_dict()
    for key in changed:
        section, name = key.rsplit(".", 1)
        _get(saved, section)[name] = "the checkpoint's value"
    found = {c.key: c for c in resume_changes(saved, current)}
    assert set(found) == changed
    for key, change in found.items():
        section, name = key.rsplit(".", 1)
        field = {f.name: f for f in dataclasses.fields(_get(current, section))}[name]
        assert change.kind == field.metadata.get("resume", "exact") and change.kind in RESUME_KINDS
        assert change.old == "the checkpoint's value" and change.new == _get(current, key)


def test_the_keys_that_change_the_batches_or_the_model_are_marked():
    from seqjax.config.diff import resume_changes

    saved = Config().to_dict()
    saved["data"]["batch_size"], saved["run"]["seed"], saved["model"]["d_ff"] = 32, 7, 64
    saved["train"]["steps"], saved["mesh"]["data"], saved["eval"]["mode"] = 5, 2, "blocks"
    saved["train"]["allow_config_change"] = True  # the switch itself is never a change
    kinds = {c.key: c.kind for c in resume_changes(saved, Config())}
    assert kinds == {"data.batch_size": "data", "run.seed": "data", "model.d_ff": "model", "train.steps": "exact",
                     "mesh.data": "exact", "eval.mode": "exact"}
    # A key the checkpoint's config predates is compared with its default.
    del saved["data"]["shuffle"]
    assert "data.shuffle" not in {c.key for c in resume_changes(saved, Config())}


@pytest.mark.parametrize("overrides, message", [
    # data.overlong is applied only where whole documents are arranged into rows; elsewhere it was ignored
    (["data.strategy=block", "data.overlong=drop"], r"data.overlong: got 'drop' with data.strategy=block, expected "
                                                    r"split \(the default\): only pack and length_grouped apply it"),
    (["data.strategy=block", "data.overlong=error"], r"data.overlong: got 'error' with data.strategy=block"),
    (["data.strategy=window", "data.overlong=truncate"], r"data.overlong: got 'truncate' with data.strategy=window"),
    # files given to the WikiText-2 corpus were ignored without a word
    (["data.corpus=wikitext2", "data.train_files=[mine.txt]"], r"data.train_files: got \['mine.txt'\], but "
                                                               r"corpus=wikitext2 reads WikiText-2's own files"),
    (["data.valid_files=[v.txt]"], r"data.valid_files: got \['v.txt'\], but corpus=wikitext2"),
    (["data.sources=[{name: a, corpus: wikitext2, train_files: [x.txt]}]"],
     r"data.sources\[a\].train_files: got \['x.txt'\], but corpus=wikitext2"),
])
def test_keys_a_strategy_or_corpus_would_ignore_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        as_commands_load(None, overrides)


@pytest.mark.parametrize("overrides", [["data.strategy=pack", "data.overlong=drop"],
                                       ["data.strategy=length_grouped", "data.overlong=truncate"],
                                       ["data.strategy=block", "data.overlong=split"]])
def test_overlong_is_taken_where_it_is_applied(overrides):
    as_commands_load(None, overrides)
