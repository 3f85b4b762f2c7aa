"""Shared test fixtures: where WikiText-2 is, and a small tokenizer-free store for the data layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from seqjax.config import DATA_DIR_ENV


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
