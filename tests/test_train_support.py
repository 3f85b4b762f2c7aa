"""Shared helpers for the training tests: a tiny JSONL corpus, a tiny config, CLI runs in subprocesses.

Subprocesses, because meshes of forced host devices, multi-process runs and
kill signals all need a fresh Python (the XLA device count is fixed when JAX
starts). The tiny corpus's tokenizer and stores are built once per session
under pytest's base temp folder and reused by every run (prepare's cache).

The runs use a constant schedule after warmup, so the first 20 losses of the
60-step reference run are also the losses of any 20-step run.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from seqjax.core.devices import with_host_devices

REPO = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 60
# The session's persistent XLA cache (conftest.compilation_cache) for its subprocesses: a restarted run reuses the
# compiled step.
_JAX_CACHE: list[Path] = []


def tiny_overrides(root: Path, run_dir: Path, **extra) -> list[str]:
    """A 2-layer model on a 300-token BPE of a synthetic corpus: compiles and steps fast on a CPU."""
    settings = {
        "run.dir": str(run_dir),
        "data.corpus": "jsonl",
        "data.train_files": f"[{root / 'train.jsonl'}]",
        "data.valid_files": f"[{root / 'valid.jsonl'}]",
        "data.cache_dir": str(root / "cache"),
        "data.seq_len": 32,
        "data.batch_size": 16,
        "tokenizer.vocab_size": 300,
        "model.d_model": 32,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.d_ff": 64,
        "model.max_seq_len": 64,
        "model.attention": "xla",
        "train.steps": REFERENCE_STEPS,
        "train.schedule": "constant",
        "train.warmup_steps": 5,
        "train.lr": 3e-3,
        "train.checkpoint_every": 10,
        "train.keep_checkpoints": 3,
        "train.eval_every": 0,
        "train.eval_batches": 2,
        "eval.mode": "blocks",
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def write_corpus(root: Path) -> None:
    rng = random.Random(0)
    words = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()
    for name, docs in (("train", 600), ("valid", 40)):
        lines = []
        for _ in range(docs):
            n = rng.randint(4, 50)
            lines.append(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}))
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def with_devices(devices: int) -> str:
    """XLA_FLAGS forcing this many host devices, keeping the tests' own (conftest.TEST_XLA_FLAGS)."""
    return with_host_devices(os.environ.get("XLA_FLAGS", ""), devices)


def cli_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQJAX_") or k == "SEQJAX_DATA_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO)
    if _JAX_CACHE:
        env["JAX_COMPILATION_CACHE_DIR"] = str(_JAX_CACHE[0])
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    if devices:
        env["XLA_FLAGS"] = with_devices(devices)
    env.update(extra)
    return env


def run_cli(overrides: list[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "seqjax.train", *overrides],
        cwd=REPO,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_losses(run_dir: Path) -> dict[int, float]:
    from seqjax.train.metrics import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDERR:\n{proc.stderr[-4000:]}"


def make_tiny_root(base: Path) -> Path:
    """The corpus and cache folder shared by all training tests (created once, under a file lock)."""
    root = base / "train_tiny"
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "valid.jsonl").exists():
            write_corpus(root)
    return root


def reference_losses(tiny_root: Path) -> dict[int, float]:
    """Losses of one uninterrupted single-device 60-step run (computed once per session)."""
    run_dir = tiny_root / "reference"
    with open(tiny_root / ".reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run_dir / "summary.json").exists():
            assert_ok(run_cli(tiny_overrides(tiny_root, run_dir)))
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


def start_cli(overrides: list[str], **env) -> subprocess.Popen:
    """The training CLI started in the background (stderr piped, stdout dropped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "seqjax.train", *overrides],
        cwd=REPO, env=cli_env(**env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder`` with its size, modification time and contents: equal snapshots, untouched files.

    ``run.lock`` is left out: it describes the last run that took the lock, refused ones included.
    """
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "run.lock"}


def copy_reference(tiny_root: Path, to: Path) -> Path:
    """A private copy of the finished 60-step reference run, to resume or damage."""
    shutil.copytree(tiny_root / "reference", to)
    return to
