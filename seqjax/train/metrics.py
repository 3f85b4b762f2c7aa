"""Where a run's numbers go: metrics.jsonl (one line per step, plus validation lines), the trackers
(the plots drawn from it: seqjax.train.plots).

``run.trackers`` chooses the trackers: ``jsonl`` (always on), ``tensorboard``
(needs ``seqjax[tensorboard]``) and ``wandb`` (needs ``seqjax[wandb]``). One
that is asked for but not installed stops the run before any work.

metrics.jsonl is the record the resume test compares, so a resumed run first
cuts the file back to the restored step: lines a killed run wrote after its
last checkpoint are replaced by the resumed run's identical recomputation,
never duplicated. It is cut only when a resume happens: a run that starts
from step 0 in a folder holding an old metrics.jsonl moves it aside
(``metrics.<time>.jsonl``). A line cut short by a kill is reported, and a
missing row of the checkpoint's own step is restored from the checkpoint.
Besides step rows, a resume writes one ``{"step": s, "event": "resume", ...}``
row saying what changed (config keys, processes, devices, a data restart).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from seqjax.config.tree import Config
from seqjax.core.errors import ConfigError
from seqjax.core.files import json_text, write_text_atomic
from seqjax.train.flops import mfu

METRICS_FILE = "metrics.jsonl"

log = logging.getLogger(__name__)


def unigram_perplexity(train_tokens: np.ndarray, eval_tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity of a unigram model (train token frequencies, add-one smoothed) on ``eval_tokens``.

    The baseline a language model must beat: it knows how common each token is
    but nothing about context. Both arrays are token streams in the store
    layout; the first token has no context and is not scored (as in eval), so
    ``len(eval_tokens) - 1`` tokens are predicted.
    """
    counts = np.bincount(np.asarray(train_tokens[1:], np.int64), minlength=vocab_size).astype(
        np.float64) + 1.0
    log_probs = np.log(counts) - np.log(counts.sum())
    scored = np.asarray(eval_tokens[1:], np.int64)
    return float(np.exp(-log_probs[scored].mean()))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a run's metrics.jsonl (a line cut short by a kill is ignored)."""
    return _read_rows(Path(run_dir) / METRICS_FILE)[0]


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(the rows of every complete line, the 1-based numbers of lines that are not JSON: cut short
    by a kill)."""
    rows, cut = [], []
    if path.is_file():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                cut.append(number)
    return rows, cut


# The package each of config.TRACKERS needs (None: nothing beyond seqjax); the extra
# seqjax[<tracker>] installs it.
TRACKER_PACKAGES = {"jsonl": None, "tensorboard": "tensorboardX", "wandb": "wandb"}


def check_trackers(names: Sequence[str]) -> None:
    """Refuse, before any work, a tracker in ``run.trackers`` whose package is not installed."""
    for name in names:
        module = TRACKER_PACKAGES[name]
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"run.trackers: {name!r} needs the {module} package, which is not installed; "
                f"pip install 'seqjax[{name}]' or drop it from run.trackers"
            )


class _TensorBoard:
    """Scalars to TensorBoard event files under ``<run.dir>/tensorboard``."""

    def __init__(self, run_dir: Path, resume_step: int, config: Config | None):
        # optional dependency (seqjax[tensorboard]), imported only when asked for
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, row: dict[str, Any], prefix: str) -> None:
        for key, value in _scalars(row):
            self.writer.add_scalar(f"{prefix}/{key}", value, row["step"])

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """Scalars to Weights & Biases: one wandb run per ``run.dir`` (a resumed seqjax run continues
    it)."""

    def __init__(self, run_dir: Path, resume_step: int, config: Config | None):
        # optional dependency (seqjax[wandb]), imported only when asked for
        import wandb

        # the same folder, the same run
        run_id = hashlib.sha256(str(run_dir.absolute()).encode()).hexdigest()[:16]
        self.run = wandb.init(project=config.run.wandb_project if config else "seqjax",
                              name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
                              config=config.to_dict() if config else None)

    def write(self, row: dict[str, Any], prefix: str) -> None:
        self.run.log({f"{prefix}/{key}": value for key, value in _scalars(row)}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


_TRACKER_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb}


def _scalars(row: dict[str, Any], prefix: str = ""):
    """The finite numbers of a row, without its step (the trackers' x axis); nested ones (a
    mixture's ``val_sources``) as ``val_sources/<name>/loss``."""
    for key, value in row.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            yield prefix + key, value


class MetricsWriteError(RuntimeError):
    """metrics.jsonl could not be written (full disk, read-only folder): the run stops at that step
    in one line."""


class MetricsLog:
    """Appends rows to metrics.jsonl (always) and to the other trackers ``run.trackers`` names.

    Only one process of a multi-host run writes (``enabled``). ``config`` (the
    resolved config) goes to the trackers that record it (wandb).
    """

    def __init__(
        self,
        run_dir: str | Path,
        resume_step: int,
        enabled: bool = True,
        trackers: Sequence[str] = ("jsonl",),
        config: Config | None = None,
        checkpoint_row: dict[str, Any] | None = None,
    ):
        """``resume_step`` 0 starts a new log; above 0 the log is cut back to it
        (``checkpoint_row``: that step's row as the checkpoint kept it, put back if the file lost
        it)."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.trackers: list[Any] = []
        if not enabled:
            return
        path = self.run_dir / METRICS_FILE
        rows, cut = _read_rows(path)
        if resume_step == 0:
            # a new run in an old folder: keep the old history, not cut it
            if path.exists() and (rows or cut):
                aside = path.with_name(f"metrics.{time.strftime('%Y%m%dT%H%M%S')}.jsonl")
                path.rename(aside)
                log.warning(
                    "%s holds %d rows but no checkpoint to resume: it was moved to %s and a new "
                    "log started",
                    path, len(rows), aside.name)
            kept = []
        else:
            if cut:
                log.warning("%s: line(s) %s were cut short (a kill while writing) and are dropped",
                            path, ", ".join(map(str, cut)))
            kept = [row for row in rows if row.get("step", 0) <= resume_step]
            if checkpoint_row and not any(r.get("step") == resume_step and "loss" in r for r in kept):
                at = sum(1 for r in kept if r.get("step", 0) < resume_step)
                kept.insert(at, checkpoint_row)
                log.warning(
                    "%s had no row for step %d, the checkpoint's own; it was restored from the "
                    "checkpoint",
                    path, resume_step)
        # Cut back to the resumed step atomically: a kill here must not lose the run's history.
        path = write_text_atomic(path, "".join(json_text(row) + "\n" for row in kept))
        self.file = path.open("a")
        check_trackers(trackers)
        self.trackers = [_TRACKER_CLASSES[name](self.run_dir, resume_step, config)
                         for name in dict.fromkeys(trackers) if name != "jsonl"]

    def write(self, row: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.note(row)
        for tracker in self.trackers:
            tracker.write(row, prefix)

    def note(self, row: dict[str, Any]) -> None:
        """A row for metrics.jsonl only (an event such as a resume; no tracker plots it). NaN is
        written as null.

        A write the disk refuses (full, read-only) stops the run with one line:
        :class:`MetricsWriteError`.
        """
        if not self.enabled:
            return
        try:
            self.file.write(json_text(row) + "\n")
            self.file.flush()
        except OSError as err:
            self._drop_file()
            raise MetricsWriteError(
                f"{self.run_dir / METRICS_FILE} could not be written at step {row.get('step')}: "
                f"[Errno {err.errno}] {err.strerror}. The run stops here; once there is room, run "
                "the same command again: it resumes from the newest checkpoint") from None

    def _drop_file(self) -> None:
        """Close the log, dropping what its buffer still holds (the disk refused it; close must not
        retry)."""
        try:
            self.file.close()
        except OSError:
            pass
        self.file = None

    def close(self) -> None:
        if not self.enabled:
            return
        if self.file is not None:
            self.file.close()
        for tracker in self.trackers:
            tracker.close()


class StepWindow:
    """The steps dispatched since the last host sync, and the throughput of the windows flushed so
    far.

    The loop adds each step's metrics (device arrays) without waiting for them;
    :meth:`fetch` brings the whole window to the host in one ``device_get``
    (the one CPU-GPU sync point per ``train.log_every`` steps) and gives each
    step the window's mean wall time. Throughput leaves out the first step of a
    process (compilation) and any time the loop restarts the window after
    (validation).
    """

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []  # (step, row length, rows) per dispatched step
        self._metrics: list[Any] = []
        self._start = time.perf_counter()
        self.train_seconds = 0.0
        self.train_tokens = 0
        self.step_seconds: list[float] = []

    def restart(self) -> None:
        self._start = time.perf_counter()

    def add(self, step: int, metrics: Any, shape: tuple[int, ...]) -> None:
        self.steps.append((step, shape[1], shape[0]))
        self._metrics.append(metrics)

    def fetch(self) -> tuple[list[dict[str, Any]], float]:
        """(host metrics per step, mean seconds per step over the window); blocks until the window
        ran."""
        fetched = jax.device_get(self._metrics)
        now = time.perf_counter()
        seconds = (now - self._start) / max(len(fetched), 1)
        self._start = now
        return fetched, seconds

    def count(self, tokens: int, seconds: float, first: bool) -> None:
        if not first:
            self.train_seconds += seconds
            self.train_tokens += tokens
            self.step_seconds.append(seconds)

    def clear(self) -> None:
        self.steps, self._metrics = [], []

    def tokens_per_s(self) -> float | None:
        return self.train_tokens / self.train_seconds if self.train_seconds else None

    def median_step_seconds(self) -> float | None:
        return float(np.median(self.step_seconds)) if self.step_seconds else None

    def mfu(self, flops_per_token: float, num_devices: int, peak: float | None) -> float | None:
        rate = self.tokens_per_s()
        return None if rate is None or peak is None else rate * flops_per_token / (num_devices * peak)


def peak_memory_bytes() -> int | None:
    """The largest peak of device memory in use over this process's devices (None where unreported,
    e.g. CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


class NonFiniteLoss(RuntimeError):
    """A step produced a NaN/inf loss or gradient under ``train.nonfinite=stop``, or every step of a
    window did."""


def nonfinite_what(loss: float, grad_norm: float) -> str:
    """Which of a step's numbers was not finite, named first: ``non-finite gradient (grad norm nan;
    loss 6.238)``."""
    if not math.isfinite(loss):
        return f"non-finite loss {loss} (grad norm {grad_norm})"
    return f"non-finite gradient (grad norm {grad_norm}; loss {loss:.4g})"


class StepLogger:
    """The loop's one reporter of steps: the window of un-fetched metrics, their rows, the bar, the
    NaN check.

    ``add`` after each dispatched step (no host sync); ``flush`` fetches the window in one
    ``device_get``, checks each step (a non-finite one raises :class:`NonFiniteLoss` before anything
    can save it, under ``nonfinite=stop``; under ``skip`` a window in which every step was skipped
    stops the run, since nothing is learning), writes a row per step to the metrics log and moves
    the bar. Where the bar is off (:func:`seqjax.core.progress.on_terminal`), a plain log line every
    ``log_every`` steps takes its place.
    """

    def __init__(self, log: MetricsLog, *, steps: int, start_step: int, tokens_seen: int,
                 log_every: int, learning_rates: np.ndarray, flops_per_token: Any,
                 peak: float | None, z_loss: bool, nonfinite: str, last_good: Any,
                 primary: bool = True):
        """``flops_per_token(row_length)`` for MFU; ``last_good()`` names the newest checkpoint for
        the NaN message."""
        from seqjax.core.progress import on_terminal, progress_bar  # (tqdm: only the loop needs it)

        self.log, self.steps, self.start_step, self.tokens_seen = log, steps, start_step, tokens_seen
        self.log_every, self.learning_rates, self.flops_per_token = log_every, learning_rates, flops_per_token
        self.peak, self.z_loss, self.nonfinite, self.last_good = peak, z_loss, nonfinite, last_good
        self.window = StepWindow()
        self.last_row: dict[str, Any] = {}
        self.last_reward: tuple[float, float] | None = None  # an RL run's newest generation's (mean, std)
        self.skipped_in_a_row = 0
        self.plain = primary and not on_terminal()
        self.bar = progress_bar(total=steps, initial=start_step, desc="train", unit="step",
                                enabled=primary, plain=False)  # (its own plain lines: flush)

    def __enter__(self) -> StepLogger:
        self.window.restart()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def add(self, step: int, metrics: Any, shape: tuple[int, ...]) -> None:
        self.window.add(step, metrics, shape)

    def restart(self) -> None:
        """Time spent since the last flush is not training (validation): leave it out of
        throughput."""
        self.window.restart()

    def due(self, step: int) -> bool:
        """Flush now? Every ``log_every`` steps, at the end, and the first step alone (mostly
        compilation)."""
        return step == self.start_step + 1 or step % self.log_every == 0 or step == self.steps

    def flush(self, step: int) -> None:
        """Fetch the window's metrics in one host sync, then check, count and log each step."""
        fetched, seconds = self.window.fetch()
        for (s, length, rows), m in zip(self.window.steps, fetched):
            self._row(s, length, rows, m, seconds)
        self.window.clear()
        self.bar.update(step - self.bar.n)
        row = self.last_row
        rewards = row and "rewards/accuracies" in row and "rewards/margins" in row
        # (an RL run's reward: its newest generation's mean and std, as TRL's console shows them)
        reward = self.last_reward
        if row:
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                 **({"acc": f"{row['rewards/accuracies']:.2f}"} if rewards else {}),
                                 **({"reward": f"{reward[0]:.3f}±{reward[1]:.3f}"} if reward else {}),
                                 refresh=False)
        if self.plain and row and (step % self.log_every == 0 or step == self.steps):
            # (a preference objective's reward accuracy and margin, as TRL's console shows them)
            log.info("step %d/%d: loss %.4f, %s%s%.0f tokens/s", step, self.steps, row["loss"],
                     f"reward accuracy {row['rewards/accuracies']:.3f}, margin "
                     f"{row['rewards/margins']:.4f}, "
                     if rewards else "",
                     f"reward {reward[0]:.3f} (std {reward[1]:.3f}), " if reward else "", row["tokens_per_s"])

    def _row(self, step: int, length: int, rows: int, m: dict[str, Any],
             seconds: float) -> dict[str, Any]:
        if not bool(m["finite"]) and self.nonfinite == "stop":
            raise NonFiniteLoss(
                f"{nonfinite_what(float(m['loss']), float(m['grad_norm']))} at step "
                f"{step}; stopping without saving it. Last good checkpoint: {self.last_good()}. "
                "Lower train.lr or set train.nonfinite=skip.")
        tokens = int(m["tokens"])
        self.tokens_seen += tokens
        self.window.count(tokens, seconds, first=step == self.start_step + 1)
        tokens_per_s = tokens / seconds
        row = {
            "step": step, "loss": float(m["loss"]),
            "learning_rate": float(self.learning_rates[step]), "grad_norm": float(m["grad_norm"]),
            "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, self.flops_per_token(length),
                                                     jax.device_count(),
                                                     self.peak), "tokens_seen": self.tokens_seen,
            "padding_fraction": 1.0 - tokens / (rows * length), "seconds": seconds
        }
        if self.z_loss:
            row["objective"] = float(m["objective"])
        # what the objective reports (train.objective's rows: TRL's rewards/*, ...), already divided
        # by its count
        row.update({name: float(value) for name, value in m.get("reported", {}).items()})
        if not bool(m["finite"]):
            row["skipped"] = True
        self.log.write(row)
        self.last_row = row
        if row.get("reward") is not None and math.isfinite(row["reward"]):
            self.last_reward = (row["reward"], row.get("reward_std", 0.0))
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if row.get("skipped") else 0
        if self.skipped_in_a_row >= max(self.log_every, 2):
            # skip is for the odd spike; a whole log window of them means nothing is being learned
            raise NonFiniteLoss(
                f"the last {self.skipped_in_a_row} steps (to step {step}) were all non-finite and "
                f"skipped (train.nonfinite=skip): stopping, as nothing is being learned. Last good "
                f"checkpoint: {self.last_good()}. Check the data and the initial weights, or lower "
                "train.lr.")
