"""Shared test fixtures: where WikiText-2 is, and a small tokenizer-free store for the data layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from seqjax.config.tree import DATA_DIR_ENV


def wikitext_dir() -> Path | None:
    """The folder holding wikitext-2/ and wikitext-2-raw/, or None when the data is not on this machine."""
    value = os.environ.get(DATA_DIR_ENV)
    if value and (Path(value) / "wikitext-2").is_dir():
        return Path(value)
    return None


@pytest.fixture(scope="session")
def wikitext() -> Path:
    path = wikitext_dir()
    if path is None:
        pytest.skip(f"WikiText-2 not found: set {DATA_DIR_ENV} to the folder holding wikitext-2/ (CI sets it)")
    return path


@pytest.fixture(scope="session")
def wikitext_config(wikitext, tmp_path_factory):
    """A config pointing at WikiText-2 with a session-private cache and a small vocabulary (fast to train)."""
    from seqjax.config.load import load_config

    cache = tmp_path_factory.mktemp("wikitext_cache")
    return load_config(None, [f"data.dir={wikitext}", f"data.cache_dir={cache}", "tokenizer.vocab_size=2048"])


@pytest.fixture(scope="session")
def wikitext_prepared(wikitext_config):
    """Tokenizer and token stores for all three WikiText-2 splits, built once per test session."""
    from seqjax.store.build import prepare

    return prepare(wikitext_config)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """A tiny JSONL corpus and its cache, shared by the training tests (see test_train_support.py)."""
    from test_train_support import make_tiny_root

    return make_tiny_root(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def reference(tiny_root) -> dict[int, float]:
    """The per-step losses of one uninterrupted tiny run, the yardstick of the resume, mesh and multi-process tests."""
    from test_train_support import reference_losses

    return reference_losses(tiny_root)
