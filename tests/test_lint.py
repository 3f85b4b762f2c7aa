"""``ruff check`` passes on the whole repository (the rules and line length are in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test_train_support import REPO


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e .[test]")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
