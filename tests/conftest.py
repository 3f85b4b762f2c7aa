"""Shared test fixtures: where WikiText-2 is, and a small tokenizer-free store for the data layer."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from seqjax.config.tree import DATA_DIR_ENV

# Pallas's Mosaic GPU interpreter (tests/test_mosaic.py) needs more XLA CPU threads than a 2-core machine gives
# (seqjax/model/kernels/mosaic.py says why); set before JAX starts, here and in every subprocess the tests start.
if os.cpu_count() is not None and os.cpu_count() < 4:
    os.environ.setdefault("PJRT_NPROC", "4")


# XLA compiles without LLVM's optimizations in the tests (one place, for this process and every subprocess the tests
# start: test_train_support.cli_env keeps it). The tests compile hundreds of tiny programs and run each a few steps,
# so compile time is most of the suite; unoptimized code computes the same operations in the same order, and a test
# compares two computations compiled alike. SEQJAX_TEST_XLA_OPT=1 compiles as a user's run does.
TEST_XLA_FLAGS = "" if os.environ.get("SEQJAX_TEST_XLA_OPT") == "1" else "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def pytest_runtest_logreport(report):
    """Under SEQJAX_FAILURES_NOW=1 (the GPU suite's tests stage) a failure's report goes to stderr as it happens:
    a stage cut at its budget loses pytest's summary, and kept only a row of dots and an F (2026-11-29)."""
    if report.failed and os.environ.get("SEQJAX_FAILURES_NOW") == "1":
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


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


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory) -> Path | None:
    """One persistent XLA compilation cache for the whole test session: this process, the other pytest-xdist
    workers (their temp folders share a parent) and every CLI subprocess the tests start. The tests build the
    same tiny models again and again; a program compiled once is read back, not compiled again. Fresh per
    session, so nothing carries over between runs."""
    import jax

    if os.environ.get("SEQJAX_TEST_XLA_CACHE") == "0":
        return None
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "jax_cache"
    path.mkdir(exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from test_train_support import _JAX_CACHE

    _JAX_CACHE[:] = [path]
    return path
