"""Atomic writes: an interrupted rewrite leaves the previous file whole."""

from __future__ import annotations

import os

import pytest

from seqjax.core.files import write_text_atomic


def test_a_write_interrupted_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    write_text_atomic(path, "old\n")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for a kill between writing and renaming

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new\n" * 1000)
    assert path.read_text() == "old\n"


def test_writes_create_folders_and_replace_the_contents(tmp_path):
    path = write_text_atomic(tmp_path / "a" / "b.txt", "one")
    assert write_text_atomic(path, "two").read_text() == "two"
