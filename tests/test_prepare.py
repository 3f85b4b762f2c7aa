"""``python -m seqjax.prepare`` end to end: a small text corpus, a JSONL corpus, and WikiText-2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corpus_factory import make_text_corpus
from seqjax.config.load import load_config
from seqjax.main.prepare import main
from seqjax.store.corpus import count_words, read_text
from seqjax.store.lines import split_lines
from seqjax.store.tokenizer import Tokenizer
from seqjax.store.wikitext import wikitext_articles

REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"documents", "tokens", "bytes", "words", "tokens_per_word", "seconds", "skipped_empty", "reused"}


def run_cli(capsys, args):
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return out, json.loads(out[-1])


def test_cli_on_a_text_corpus_prints_saves_and_reuses(tmp_path, capsys):
    overrides = make_text_corpus(tmp_path / "corpus", tmp_path / "cache")
    out, summary = run_cli(capsys, overrides)
    assert not any(line.startswith(("# resolved config", "data:", "model:")) for line in out)  # a file, named on stderr
    assert set(summary) == {"train", "valid", "test"}
    for split, docs in {"train": 3, "valid": 2, "test": 1}.items():
        entry = summary[split]
        assert SUMMARY_KEYS <= set(entry) and entry["documents"] == docs and entry["reused"] is False
        assert entry["tokens_per_word"] == round(entry["tokens"] / entry["words"], 4)
    assert summary["train"]["skipped_empty"] == 1
    assert summary["valid"]["words"] == count_words("the cat and the dog .\n") + count_words("last line has no newline")
    assert summary["valid"]["bytes"] == len("the cat and the dog .\nlast line has no newline")
    config = load_config(None, overrides)
    assert load_config(tmp_path / "cache" / "prepare.yaml") == config
    assert load_config(Path(summary["test"]["store"]).parent / "config.yaml") == config
    _, again = run_cli(capsys, overrides)
    assert all(entry["reused"] for entry in again.values())
    assert {s: e["tokens"] for s, e in again.items()} == {s: e["tokens"] for s, e in summary.items()}


def test_cli_on_a_jsonl_corpus(tmp_path, capsys):
    for split, texts in {
        "train": ["alpha beta\ngamma\n", "", "delta"],
        "valid": ["beta gamma"],
        "test": ["alpha\n", " "],
    }.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    args = [
        "data.corpus=jsonl",
        f"data.dir={tmp_path}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "tokenizer.vocab_size=270",
        "data.train_files=[train.jsonl]",
        "data.valid_files=[valid.jsonl]",
        "data.test_files=[test.jsonl]",
        "--splits",
        "valid,test",
    ]
    _, summary = run_cli(capsys, args)
    assert list(summary) == ["valid", "test"]
    assert (summary["valid"]["documents"], summary["test"]["documents"], summary["test"]["skipped_empty"]) == (1, 1, 1)
    # tokens = every text token + one closing end-of-text per document
    manifest = json.loads((Path(summary["test"]["store"]) / "manifest.json").read_text())
    tokenizer = Tokenizer(manifest["tokenizer_path"], "<|endoftext|>")
    assert summary["test"]["tokens"] == len(tokenizer.encode("alpha\n")) + 1
    assert summary["valid"]["tokens"] == len(tokenizer.encode("beta gamma")) + 1


def test_prepare_and_eval_need_only_the_splits_they_read(tmp_path, capsys):
    """Without --splits, prepare builds the splits the config has files for (no test files: no test split, not a
    refusal); with a tokenizer given, a validation split is prepared without any train file (what eval of an
    instruction file on an imported model needs); the train split, or a tokenizer to train, still needs them."""
    from seqjax.core.errors import ConfigError, CorpusError
    from seqjax.store.build import prepare

    for split in ("train", "valid"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"text": f"alpha beta gamma {split}"}) + "\n")
    base = ["data.corpus=jsonl", f"data.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
            "tokenizer.vocab_size=270"]
    _, summary = run_cli(capsys, [*base, "data.train_files=[train.jsonl]", "data.valid_files=[valid.jsonl]"])
    assert list(summary) == ["train", "valid"]
    tokenizer = Tokenizer(json.loads((Path(summary["valid"]["store"]) / "manifest.json").read_text())[
        "tokenizer_path"], "<|endoftext|>")
    only_valid = load_config(None, [*base, "data.valid_files=[valid.jsonl]", f"tokenizer.path={tokenizer.path}"])
    assert prepare(only_valid, splits=("valid",)).stores["valid"].num_docs == 1
    with pytest.raises(ConfigError, match="data.train_files: got \\[\\], expected at least one file for "
                                          "data.corpus='jsonl': the train split reads them"):
        prepare(only_valid, splits=("train",))
    with pytest.raises(ConfigError, match="the tokenizer, trained on the train split"):
        prepare(load_config(None, [*base, "data.valid_files=[valid.jsonl]"]), splits=("valid",))
    with pytest.raises(CorpusError, match="data: test_files: got \\[\\], expected at least one file"):
        prepare(only_valid, splits=("test",))


def test_cli_errors_exit_2_with_the_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["data.corpus=text", "data.train_files=[missing.txt]", f"data.cache_dir={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "data.train_files: 'missing.txt' not found. Looked in:" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exit_:
        main(["data.seq_lne=3"])
    assert exit_.value.code == 2 and "did you mean data.seq_len?" in capsys.readouterr().err


WORDS = {"train": 2_088_628, "valid": 217_646, "test": 245_569}


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_cli_on_wikitext2_prints_the_published_counts(wikitext_prepared, wikitext_config):
    """The session fixture built the stores; the CLI, run as a user runs it, finds and reuses them."""
    args = [
        "--config",
        str(REPO / "configs" / "wikitext2_cpu.yaml"),
        f"data.dir={wikitext_config.data.dir}",
        f"data.cache_dir={wikitext_config.data.cache_dir}",
        f"tokenizer.vocab_size={wikitext_config.tokenizer.vocab_size}",
    ]
    proc = subprocess.run([sys.executable, "-m", "seqjax.prepare", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {s: e["documents"] for s, e in summary.items()} == {"train": 600, "valid": 60, "test": 60}
    assert {s: e["words"] for s, e in summary.items()} == WORDS
    assert all(e["reused"] for e in summary.values())
    for split, store in wikitext_prepared.stores.items():
        assert summary[split]["tokens"] == store.predicted_tokens
        assert (
            summary[split]["bytes"]
            == (Path(wikitext_config.data.dir) / "wikitext-2" / f"wiki.{split}.tokens").stat().st_size
        )


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_wikitext2_store_decodes_back_to_its_articles_line_by_line(wikitext_prepared, wikitext):
    tokenizer, store = wikitext_prepared.tokenizer, wikitext_prepared.stores["valid"]
    articles = wikitext_articles(read_text(wikitext / "wikitext-2" / "wiki.valid.tokens"))
    lines = [line for article in articles for line in split_lines(article)]
    assert store.num_docs == len(articles) and len(store.line_offsets) - 1 == len(lines)
    for i, article in enumerate(articles):
        assert tokenizer.decode(store.doc(i)[:-1]) == article
    bounds = store.line_offsets
    for j in (0, 1, 2, len(lines) // 2, len(lines) - 1):
        piece = store.tokens[bounds[j] : bounds[j + 1]]
        if bounds[j + 1] in store.doc_offsets:
            piece = piece[:-1]  # the closing EOT belongs to the last line
        assert tokenizer.decode(piece) == lines[j]


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_raw_variant_prepares_valid_and_test_with_an_existing_tokenizer(wikitext_prepared, wikitext_config, capsys):
    """wiki.train.raw is not shipped, so the raw splits use the tokenizer trained on the word-level train split."""
    args = [
        f"data.dir={wikitext_config.data.dir}",
        f"data.cache_dir={wikitext_config.data.cache_dir}",
        "data.variant=raw",
        f"tokenizer.path={wikitext_prepared.tokenizer.path}",
        "--splits",
        "valid,test",
    ]
    _, summary = run_cli(capsys, args)
    raw = Path(wikitext_config.data.dir) / "wikitext-2-raw"
    for split in ("valid", "test"):
        assert summary[split]["documents"] == 60 and summary[split]["words"] == WORDS[split]
        assert summary[split]["bytes"] == (raw / f"wiki.{split}.raw").stat().st_size
    assert "/wikitext2-raw/" in summary["valid"]["store"]


def test_a_cache_dir_that_is_a_file_or_read_only_is_one_line_naming_it(tmp_path, capfd, monkeypatch):
    """As root the folder's permissions do not stop a write, so a read-only file system is simulated at access()."""
    import os

    from seqjax.main.prepare import main

    corpus = tmp_path / "t.jsonl"
    corpus.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    base = ["data.corpus=jsonl", f"data.train_files=[{corpus}]", f"data.valid_files=[{corpus}]",
            "tokenizer.vocab_size=300"]
    (tmp_path / "afile").write_text("mine")
    for cache, expected in ((tmp_path / "afile", "is a file; expected a folder"),
                            (tmp_path / "ro", "is not writable; expected a writable folder")):
        if cache.name == "ro":
            cache.mkdir()
            monkeypatch.setattr(os, "access", lambda path, mode: False)
        with pytest.raises(SystemExit) as exit_:
            main([*base, f"data.cache_dir={cache}"])
        assert exit_.value.code == 2
        err = capfd.readouterr().err
        assert "Traceback" not in err and f"data.cache_dir: {cache} {expected}" in err
    assert (tmp_path / "afile").read_text() == "mine" and not any((tmp_path / "ro").iterdir())


def test_a_cache_on_a_read_only_file_system_is_one_line_from_prepare(tmp_path, monkeypatch):
    """The first write into data.cache_dir fails with EROFS (simulated: as root, permissions would not stop it)."""
    import errno
    import pathlib

    from seqjax.config.load import load_config
    from seqjax.core.errors import StoreError
    from seqjax.store.build import prepare

    corpus = tmp_path / "t.jsonl"
    corpus.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    cache = tmp_path / "ro"
    real_mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if cache in self.parents or self == cache:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    config = load_config(None, ["data.corpus=jsonl", f"data.train_files=[{corpus}]", f"data.valid_files=[{corpus}]",
                                "tokenizer.vocab_size=300", f"data.cache_dir={cache}"])
    with pytest.raises(StoreError, match=rf"data.cache_dir: cannot write {cache}.* \(Read-only file system\)"):
        prepare(config, splits=("train", "valid"))


def test_a_complete_cache_on_a_read_only_mount_is_read_without_a_lock(tmp_path, monkeypatch):
    """Issue: a complete token cache on a read-only mount was refused ("cannot write .lock") for train and eval.
    Reading takes no lock; what the cache lacks is still one line (simulated at access(), as root ignores modes)."""
    import builtins

    from seqjax.core.errors import StoreError
    from seqjax.store import build
    from seqjax.store import cache as cache_module
    from seqjax.store.build import prepare

    corpus = tmp_path / "t.jsonl"
    corpus.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    overrides = ["data.corpus=jsonl", f"data.train_files=[{corpus}]", f"data.valid_files=[{corpus}]",
                 "tokenizer.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}"]
    built = prepare(load_config(None, overrides), splits=("train", "valid"))
    real_open = builtins.open

    def no_writes(file, mode="r", *args, **kwargs):
        if str(tmp_path / "cache") in str(file) and any(m in mode for m in "wax+"):
            raise PermissionError(30, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_writes)
    monkeypatch.setattr(cache_module.os, "access", lambda path, mode: str(tmp_path / "cache") not in str(path))
    monkeypatch.setattr(build, "VERIFY_EVERY_REUSE_BYTES", 0)  # (no "verified" record is written either)
    again = prepare(load_config(None, overrides), splits=("train", "valid"))
    assert again.summary["train"]["reused"] and again.summary["valid"]["reused"]
    assert again.stores["train"].num_tokens == built.stores["train"].num_tokens
    other = tmp_path / "v.jsonl"
    other.write_text('{"text": "e f"}\n')
    with pytest.raises(StoreError, match=r"data.cache_dir: .* is read-only and holds no complete valid store for "
                                         r"this config"):
        prepare(load_config(None, [*overrides, f"data.valid_files=[{other}]"]), splits=("train", "valid"))


@pytest.mark.parametrize("identity", ["stat", "content"])
def test_a_cache_moved_with_its_sources_is_reused_under_content_identity(tmp_path, identity):
    """data.cache_identity=content: a tokenizer and store built in one folder, moved with their corpus to another
    (other paths, other modification times: another machine), are reused, no tokenizer trained again; under stat
    (path and time) they are built again."""
    import os
    import shutil

    from seqjax.store.build import prepare

    def overrides(root):
        return ["data.corpus=jsonl", f"data.train_files=[{root / 't.jsonl'}]", f"data.valid_files=[{root / 't.jsonl'}]",
                "tokenizer.vocab_size=300", f"data.cache_dir={root / 'cache'}", f"data.cache_identity={identity}"]

    first = tmp_path / "here"
    first.mkdir()
    (first / "t.jsonl").write_text("".join(f'{{"text": "a b c {i} d e"}}\n' for i in range(50)))
    built = prepare(load_config(None, overrides(first)), splits=("train",))
    moved = tmp_path / "there"
    shutil.copytree(first, moved)
    os.utime(moved / "t.jsonl", ns=(1, 1))
    shutil.rmtree(first)
    again = prepare(load_config(None, overrides(moved)), splits=("train",))
    assert again.summary["train"]["reused"] == (identity == "content")
    assert again.tokenizer.hash == built.tokenizer.hash
    tokenizers = list((moved / "cache" / "tokenizers").iterdir())
    assert len(tokenizers) == (1 if identity == "content" else 2)  # (stat: trained again under its new key)
