"""The reward functions of an RL run (``rl.reward_funcs``): built-in verifiable ones, or any Python
function with TRL's signature, combined with ``rl.reward_weights`` as TRL's GRPOTrainer combines
them.

==============  ==================================================================================================
``accuracy``    1 when the completion's answer equals the record's ``rl.answer_field``, else 0: the answer is the
                last ``\\boxed{...}``, else the last number, else the whole text; compared as
                numbers when both read as one, else as text with case, spaces and a trailing period
                left out
``format``      1 when the completion matches ``rl.format_pattern`` (TRL's ``think_format_reward``'s by
                default), else 0
``length``      DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``): 0 up to
                ``rl.max_completion_length - buffer`` tokens, falling linearly to -1 at the limit
``module:func`` ``func(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_extra=...,
                log_metric=..., **the record's other columns)`` -> one float or None per completion, as TRL 1.16
                calls a reward function (``module`` importable, or a ``.py`` path)
==============  ==================================================================================================

A completion is its text (a standard prompt) or ``[{"role": "assistant", "content": text}]`` (a
conversational one), as TRL passes it. ``trainer_state`` has TRL's ``TrainerState`` fields a reward
reads (``global_step``, ``max_steps``, ``epoch``, ``num_input_tokens_seen``); ``log_extra(column,
values)`` adds a column to the completions table (``rl.log_completions_every``), ``log_metric(name,
value)`` a metric to the generation's row. None (or NaN) is no score: a completion no function
scores gets no advantage, and is a warning naming the functions, as TRL warns; a function that
scores none of the completions is one too. A function that raises (its file and line named), returns
another number of rewards, something that is not a number, or an infinity, is one line naming it. A
function still running after 10 s says so.

The advantages come from :data:`ADVANTAGES`, the estimator a loss type names
(``seqjax.objectives.rl``)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import math
import re
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import SeqjaxError

log = logging.getLogger(__name__)

BOXED = re.compile(r"\\boxed\{")
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


class RewardError(SeqjaxError):
    """A reward function that failed, or answered with the wrong number of rewards."""


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    found = None
    for match in BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i]
                break
    return found


def extract_answer(text: str) -> str:
    """The answer a completion gives: its last ``\\boxed{}``, else its last number, else its
    stripped text."""
    inside = boxed(text)
    if inside is not None:
        return inside.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def _as_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").strip()
    try:
        if "/" in text:
            top, bottom = text.split("/", 1)
            return float(top) / float(bottom)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str, expected: Any) -> bool:
    """Numbers compared as numbers (``1,000`` is ``1000.0``), anything else as text with case,
    spaces and a trailing period left out."""
    a, b = _as_number(given), _as_number(str(expected))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)

    def norm(x):
        return re.sub(r"\s+", "", str(x)).rstrip(".").lower()

    return norm(given) == norm(expected)


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


@dataclass
class Reward:
    """A reward function and the name its metrics take (``rewards/<name>/mean``)."""

    name: str
    fn: Callable[..., list]


def _accuracy(config: Config) -> Callable[..., list]:
    field = config.rl.answer_field

    def accuracy(prompts, completions, completion_ids, **columns):
        answers = columns.get(field)
        if answers is None:
            raise RewardError(f"reward accuracy: the prompts have no column {field!r} "
                              "(rl.answer_field); expected each record's right answer there")
        return [None if a is None else float(same_answer(extract_answer(_text(c)), a))
                for c, a in zip(completions, answers)]

    return accuracy


def _format(config: Config) -> Callable[..., list]:
    pattern = re.compile(config.rl.format_pattern, re.DOTALL | re.MULTILINE)  # (TRL's flags)
    return lambda prompts, completions, completion_ids, **_: [
        1.0 if pattern.match(_text(c)) else 0.0 for c in completions]


def _length(config: Config) -> Callable[..., list]:
    limit = config.rl.max_completion_length
    buffer = config.rl.overlong_buffer or max(1, limit // 4)

    def length(prompts, completions, completion_ids, **_):
        out = []
        for ids in completion_ids:
            n = len(ids)
            start = limit - buffer
            out.append(0.0 if n <= start else (start - n) / buffer if n <= limit else -1.0)
        return out

    return length


BUILT_IN = {"accuracy": _accuracy, "format": _format, "length": _length}


def load_rewards(config: Config) -> list[Reward]:
    """``rl.reward_funcs`` as callables; a name that is neither built in nor an importable
    ``module:function`` is one line."""
    out = []
    for i, name in enumerate(config.rl.reward_funcs):
        if name in BUILT_IN:
            out.append(Reward(name, BUILT_IN[name](config)))
            continue
        module_name, _, attr = name.rpartition(":")
        if not module_name or not attr:
            raise ConfigError(f"rl.reward_funcs[{i}]: got {name!r}, expected one of "
                              f"{', '.join(BUILT_IN)} or module:function")
        try:
            if module_name.endswith(".py"):
                spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(module_name)
            fn = getattr(module, attr)
        except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as err:
            raise ConfigError(f"rl.reward_funcs[{i}]: {name!r} could not be loaded "
                              f"({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); expected an "
                              "importable module:function") from None
        if not callable(fn):
            raise ConfigError(f"rl.reward_funcs[{i}]: {name!r} is not callable; expected a "
                              "function")
        out.append(Reward(attr, fn))
    return out


@dataclass
class TrainerState:
    """What a reward function reads of the run as TRL's ``trainer_state``: the optimizer steps
    taken before this generation, the run's steps, the epochs of prompts taken, and the prompt
    and completion tokens generated so far (TRL's ``num_input_tokens_seen``)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_input_tokens_seen: int = 0


@dataclass
class RewardLogs:
    """What the reward functions asked to log through ``log_extra`` and ``log_metric`` while
    scoring one generation batch: extra columns of the completions table, and each metric's
    values."""

    columns: dict[str, list] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(str(column), []).extend(list(values))

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def means(self) -> dict[str, float]:
        return {name: float(np.mean(values)) for name, values in self.metrics.items() if values}


SLOW_S = 10.0  # a reward function running longer says so once


def _where(err: BaseException) -> str:
    """The file and line a user's function raised at (its innermost frame outside seqjax)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/seqjax/" not in f.filename.replace("\\", "/")]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def score(rewards: list[Reward], weights: list[float], prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list], state: TrainerState | None = None,
          logs: RewardLogs | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(each function's rewards [N, F], NaN for None; the weighted sum [N], NaN where no function
    scored) of N completions, as TRL's ``_calculate_rewards`` and its nansum."""
    table = np.full((len(completions), len(rewards)), np.nan)
    logs = logs if logs is not None else RewardLogs()
    extra = {"trainer_state": state if state is not None else TrainerState(), "log_extra": logs.log_extra,
             "log_metric": logs.log_metric}
    for j, reward in enumerate(rewards):
        slow = threading.Timer(SLOW_S, log.info, ("reward %s: still running after %.0f s (%d "
                                                  "completions)",
                                                  reward.name, SLOW_S, len(completions)))
        slow.daemon = True
        slow.start()
        try:
            got = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                            **extra)
        except SeqjaxError:
            raise
        except Exception as err:  # noqa: BLE001  (a user's function: any failure is one line naming it)
            raise RewardError(f"reward {reward.name}: raised {type(err).__name__}{_where(err)}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}") from None
        finally:
            slow.cancel()
        got = list(got) if not isinstance(got, list) else got
        if len(got) != len(completions):
            raise RewardError(f"reward {reward.name}: returned {len(got)} rewards for "
                              f"{len(completions)} completions; expected one float (or None) per "
                              "completion")
        try:
            table[:, j] = [np.nan if r is None else float(r) for r in got]
        except (TypeError, ValueError):
            raise RewardError(f"reward {reward.name}: returned {got[:3]!r}...; expected floats or "
                              "None") from None
        if np.isinf(table[:, j]).any():
            k = int(np.flatnonzero(np.isinf(table[:, j]))[0])
            raise RewardError(f"reward {reward.name}: returned {table[k, j]} for completion {k}; "
                              "expected a finite float, or None for no score")
        if np.isnan(table[:, j]).all():
            log.warning("reward %s: returned None (or NaN) for all %d completions: it scores none "
                        "of them",
                        reward.name, len(completions))
    weight = np.asarray(weights or [1.0] * len(rewards), np.float64)
    total = np.nansum(table * weight[None, :], axis=1)
    unscored = np.isnan(table).all(axis=1)
    total[unscored] = np.nan
    if unscored.any() and not np.isnan(table).all():  # (all of them unscored: each function said so above)
        k = int(np.flatnonzero(unscored)[0])
        log.warning("%d of %d completions got no reward from any of %s (the first: completion %d "
                    "of prompt %r): they get advantage 0; expected at least one reward function "
                    "to score each", int(unscored.sum()),
                    len(completions), ", ".join(r.name for r in rewards), k, _short(prompts[k]))
    return table, total


def _short(prompt: Any) -> str:
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
    return text if len(text) <= 60 else text[:57] + "..."


# -- advantages: each completion's, from the weighted rewards of its group (TRL's estimators)


@contextlib.contextmanager
def quiet():
    """numpy's warnings about empty slices silenced: a group none scored has NaN statistics on
    purpose (the scoring's own warnings say what happened)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _grouped(total: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    grouped = total.reshape(-1, group)
    with quiet():
        return np.repeat(np.nanmean(grouped, axis=1), group), np.repeat(_nanstd(grouped), group)


def _group_scaled(total: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    mean, std = _grouped(total, group)
    return (total - mean) / (std + 1e-4), std


def _batch_scaled(total: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    mean, _ = _grouped(total, group)
    std = np.full_like(total, _nanstd(total[None, :])[0])
    return (total - mean) / (std + 1e-4), std


def _centred(total: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    mean, std = _grouped(total, group)
    return total - mean, std


def _leave_one_out(total: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """RLOO's: each reward less the mean of its group's other scored rewards (TRL 1.16's
    RLOOTrainer)."""
    grouped = total.reshape(-1, group)
    scored = np.sum(~np.isnan(grouped), axis=1, keepdims=True)
    with quiet():
        baseline = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scored - 1)
    return (grouped - baseline).reshape(-1), _grouped(total, group)[1]


# name -> (weighted rewards [N], group size) -> (advantages [N], NaN where unscored; the std whose
# zero frac_reward_zero_std counts)
ADVANTAGES: dict[str, Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]] = {
    "group": _group_scaled,  # TRL's GRPOTrainer, scale_rewards=group (its default)
    "batch": _batch_scaled,  # scale_rewards=batch: the generation batch's std
    "none": _centred,  # scale_rewards=none (Dr. GRPO): the group's mean subtracted only
    "leave_one_out": _leave_one_out,  # TRL's RLOOTrainer
}


def advantages(total: np.ndarray, group: int, estimator: str,
               normalize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], whether each completion's std is zero [N]) from the weighted rewards
    ``total`` [N], grouped ``group`` at a time, by :data:`ADVANTAGES` ``[estimator]``;
    ``normalize``: then over the whole generation batch to mean 0 and std 1 (+ 1e-4), as
    RLOOTrainer's ``normalize_advantages``. An unscored completion gets 0."""
    out, std = ADVANTAGES[estimator](total, group)
    if normalize:
        with quiet():
            out = (out - np.nanmean(out)) / (_nanstd(out[None, :])[0] + 1e-4)
    return np.nan_to_num(out, nan=0.0), np.isclose(std, 0.0)


def _nanstd(rows: np.ndarray) -> np.ndarray:
    """TRL's ``nanstd``: the unbiased std of each row's non-NaN values; NaN for fewer than two."""
    count = np.sum(~np.isnan(rows), axis=1)
    with quiet():
        mean = np.nanmean(rows, axis=1, keepdims=True)
    variance = np.nansum((rows - mean) ** 2, axis=1) / np.maximum(count - 1, 1)
    return np.where(count > 1, np.sqrt(variance), np.nan)
