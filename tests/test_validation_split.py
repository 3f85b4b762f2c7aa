"""A corpus without a validation file: carve one from train (stable), or train without validation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.core.errors import CorpusError
from seqjax.store.build import prepare


def write_docs(path, n=200, seed=0):
    rng = np.random.default_rng(seed)
    words = "the cat sat on a mat while dog ran far away to big small red blue green".split()
    docs = [" ".join(rng.choice(words, int(rng.integers(3, 20)))) + f" {i}" for i in range(n)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def settings(tmp_path, *extra):
    return ["data.corpus=jsonl", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300", *extra]


def documents(prepared, split):
    store = prepared.stores[split]
    return {prepared.tokenizer.decode(store.doc(i)[:-1]) for i in range(store.num_docs)}


def test_a_carved_validation_split_is_disjoint_complete_and_the_same_in_every_run(tmp_path):
    docs = write_docs(tmp_path / "train.jsonl")
    first = prepare(load_config(None, settings(tmp_path, "data.validation_split_percentage=20")),
                    splits=("train", "valid"))
    train, valid = documents(first, "train"), documents(first, "valid")
    assert train | valid == set(docs) and not train & valid
    assert 0.1 < len(valid) / len(docs) < 0.3
    assert first.summary["train"]["carved_out"] == len(valid) and first.summary["valid"]["carved_out"] == len(train)
    # another cache, another process pool, the files' documents in another order: the same split
    shuffled = list(reversed(docs))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in shuffled))
    again = prepare(load_config(None, settings(tmp_path, "data.validation_split_percentage=20", "data.workers=2",
                                               f"data.cache_dir={tmp_path / 'other'}")), splits=("train", "valid"))
    assert documents(again, "valid") == valid and documents(again, "train") == train


def test_without_valid_files_or_a_carve_the_valid_split_is_refused_in_one_line(tmp_path):
    write_docs(tmp_path / "train.jsonl", n=20)
    with pytest.raises(CorpusError, match=r"valid_files: got \[\], expected at least one file \(or "
                                          r"data.validation_split_percentage > 0"):
        prepare(load_config(None, settings(tmp_path)), splits=("valid",))


@pytest.mark.slow  # an in-process training run, twice
def test_a_run_without_validation_data_trains_says_so_and_its_rerun_is_finished(tmp_path, caplog):
    from seqjax.train.loop import train  # (the training stage: only this test runs a loop)

    write_docs(tmp_path / "train.jsonl", n=60)
    config = load_config(None, settings(
        tmp_path, "data.seq_len=32", "data.batch_size=4", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.d_ff=64", "train.steps=2", "train.warmup_steps=0", "train.async_checkpoint=false",
        f"run.dir={tmp_path / 'run'}"))
    summary = train(config)
    assert summary["finished"] and summary["validation"] is False and summary["val_loss"] is None
    assert "training without validation" in caplog.text
    written = (tmp_path / "run" / "summary.json").read_bytes()
    assert train(config)["finished"] and (tmp_path / "run" / "summary.json").read_bytes() == written


@pytest.mark.slow  # an in-process training run
def test_a_mixture_reports_each_sources_validation_loss(tmp_path):
    from seqjax.train.loop import train  # (the training stage: only these tests run a loop)
    from seqjax.train.metrics import _scalars

    for name, seed in (("a", 1), ("b", 2)):
        write_docs(tmp_path / f"{name}.jsonl", n=40, seed=seed)
        write_docs(tmp_path / f"{name}_valid.jsonl", n=8, seed=seed + 10)
    sources = ("[{name: a, train_files: [%s], valid_files: [%s]}, {name: b, weight: 3, train_files: [%s], "
               "valid_files: [%s]}]" % (tmp_path / "a.jsonl", tmp_path / "a_valid.jsonl", tmp_path / "b.jsonl",
                                        tmp_path / "b_valid.jsonl"))
    config = load_config(None, [
        "data.corpus=jsonl", f"data.sources={sources}", f"data.cache_dir={tmp_path / 'cache'}",
        "tokenizer.vocab_size=300", "data.seq_len=32", "data.batch_size=4", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=64", "train.steps=2", "train.warmup_steps=0", "train.async_checkpoint=false",
        "eval.mode=documents", f"run.dir={tmp_path / 'run'}"])
    summary = train(config)
    per_source = summary["val_sources"]
    assert set(per_source) == {"a", "b"} and all(np.isfinite(s["loss"]) for s in per_source.values())
    # documents mode scores each document alone: the whole split's sum is the sources' sums
    total = sum(s["loss"] * s["tokens"] for s in per_source.values()) / sum(s["tokens"] for s in per_source.values())
    assert total == pytest.approx(summary["val_loss"], rel=1e-5)
    assert dict(_scalars({"step": 2, "val_sources": per_source}))["val_sources/b/loss"] == per_source["b"]["loss"]
