"""The pipeline and ``python -m seqjax.data`` on the real WikiText-2 train store."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.data.contract import FIELDS
from seqjax.data.pipeline import build_pipeline
from seqjax.data.stats import epoch_stats
from seqjax.main.data import main


def wikitext_overrides(wikitext_config) -> list[str]:
    """Point at the session's prepared cache so prepare() reuses it."""
    d = wikitext_config.data
    return [
        f"data.dir={d.dir}",
        f"data.cache_dir={d.cache_dir}",
        f"tokenizer.vocab_size={wikitext_config.tokenizer.vocab_size}",
    ]


@pytest.mark.parametrize(
    "strategy,extra",
    [
        ("pack", ["data.packer=best_fit"]),
        ("concat_chunk", []),
        ("length_grouped", []),
        ("sequential", []),
        ("block", ["data.break_mode=complete_doc"]),
    ],
)
@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_real_store_batches_keep_the_contract(wikitext_prepared, wikitext_config, strategy, extra):
    store = wikitext_prepared.stores["train"]
    cfg = load_config(
        None,
        [
            *wikitext_overrides(wikitext_config),
            f"data.strategy={strategy}",
            "data.seq_len=128",
            "data.batch_size=8",
            *extra,
        ],
    )
    tokens = np.asarray(store.tokens)
    for batch in islice(iter(build_pipeline(cfg, store)), 3):
        assert set(batch) == set(FIELDS) and batch["inputs"].shape[0] == 8
        real = batch["weights"] > 0
        # inside a segment each target is the next input; every id is a real token of the store
        same = (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]) & real[:, 1:]
        np.testing.assert_array_equal(batch["inputs"][:, 1:][same], batch["targets"][:, :-1][same])
        assert np.isin(batch["targets"][real], tokens).all()


@pytest.mark.slow  # (WikiText-2 end to end: the fast loop leaves the real corpus to the full suite)
def test_data_cli_prints_stats_and_dumps_batches(wikitext_prepared, wikitext_config, tmp_path, capsys):
    dump = tmp_path / "batches.npz"
    args = [
        *wikitext_overrides(wikitext_config),
        "data.strategy=pack",
        "data.packer=fill",
        "data.seq_len=256",
        "data.batch_size=4",
    ]
    assert main([*args, "--dump", str(dump), "--batches", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1  # stdout is the JSON line alone (| jq works); --show-config prints the config on stderr
    stats = json.loads(out[-1])
    for key in (
        "strategy",
        "rows",
        "seq_len",
        "real_tokens",
        "padding_fraction",
        "tokens_dropped",
        "documents_truncated",
        "documents_split",
        "segments_per_row_mean",
        "segments_per_row_max",
        "batches_per_epoch",
        "tokens_per_s",
    ):
        assert key in stats
    store = wikitext_prepared.stores["train"]
    assert stats["real_tokens"] == store.predicted_tokens and stats["tokens_dropped"] == 0  # fill loses nothing
    assert 0 < stats["padding_fraction"] < 1 / stats["rows"]  # only the last row is short
    saved = np.load(dump)
    assert set(saved.files) == set(FIELDS) | {"documents", "epochs"}  # where each slot came from
    assert saved["inputs"].shape == (2, 4, 256)
    cfg = load_config(None, args)
    first = next(iter(build_pipeline(cfg, store)))
    np.testing.assert_array_equal(saved["inputs"][0], first["inputs"])
    assert epoch_stats(cfg, store)["rows"] == stats["rows"]
