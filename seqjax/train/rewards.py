"""The reward functions of an RL run (``rl.reward_funcs``): built-in verifiable ones, or any Python function with
TRL's signature, combined with ``rl.reward_weights`` as TRL's GRPOTrainer combines them.

==============  ==================================================================================================
``accuracy``    1 when the completion's answer equals the record's ``rl.answer_field``, else 0: the answer is the
                last ``\\boxed{...}``, else the last number, else the whole text; compared as
                numbers when both read as one, else as text with case, spaces and a trailing period
                left out
``format``      1 when the completion matches ``rl.format_pattern`` (TRL's ``think_format_reward``'s by
                default), else 0
``length``      DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``): 0 up to
                ``rl.max_completion_length - buffer`` tokens, falling linearly to -1 at the limit
``module:func`` ``func(prompts=..., completions=..., completion_ids=..., **the record's other columns)`` -> one float
                or None per completion, as TRL calls a reward function (``module`` importable, or a
                ``.py`` path)
==============  ==================================================================================================

A completion is its text (a standard prompt) or ``[{"role": "assistant", "content": text}]`` (a
conversational one), as TRL passes it. None is no score: a completion no function scores gets no
advantage. A function that raises, or returns another number of rewards, is one line naming it."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import SeqjaxError

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
    """The answer a completion gives: its last ``\\boxed{}``, else its last number, else its stripped text."""
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
    """Numbers compared as numbers (``1,000`` is ``1000.0``), anything else as text with case, spaces and a
    trailing period left out."""
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
            raise RewardError(f"reward accuracy: the prompts have no column {field!r} (rl.answer_field); expected "
                              "each record's right answer there")
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
    """``rl.reward_funcs`` as callables; a name that is neither built in nor an importable ``module:function``
    is one line."""
    out = []
    for i, name in enumerate(config.rl.reward_funcs):
        if name in BUILT_IN:
            out.append(Reward(name, BUILT_IN[name](config)))
            continue
        module_name, _, attr = name.rpartition(":")
        if not module_name or not attr:
            raise ConfigError(f"rl.reward_funcs[{i}]: got {name!r}, expected one of {', '.join(BUILT_IN)} or "
                              "module:function")
        try:
            if module_name.endswith(".py"):
                spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(module_name)
            fn = getattr(module, attr)
        except (ImportError, AttributeError, FileNotFoundError, SyntaxError) as err:
            raise ConfigError(f"rl.reward_funcs[{i}]: {name!r} could not be loaded ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); expected an importable "
                              "module:function") from None
        if not callable(fn):
            raise ConfigError(f"rl.reward_funcs[{i}]: {name!r} is not callable; expected a function")
        out.append(Reward(attr, fn))
    return out


def score(rewards: list[Reward], weights: list[float], prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[np.ndarray, np.ndarray]:
    """(each function's rewards [N, F], NaN for None; the weighted sum [N], NaN where no function scored) of N
    completions, as TRL's ``_calculate_rewards`` and its nansum."""
    table = np.full((len(completions), len(rewards)), np.nan)
    for j, reward in enumerate(rewards):
        try:
            got = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except SeqjaxError:
            raise
        except Exception as err:  # noqa: BLE001  (a user's function: any failure is one line naming it)
            raise RewardError(f"reward {reward.name}: raised {type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}") from None
        got = list(got) if not isinstance(got, list) else got
        if len(got) != len(completions):
            raise RewardError(f"reward {reward.name}: returned {len(got)} rewards for {len(completions)} "
                              "completions; expected one float (or None) per completion")
        try:
            table[:, j] = [np.nan if r is None else float(r) for r in got]
        except (TypeError, ValueError):
            raise RewardError(f"reward {reward.name}: returned {got[:3]!r}...; expected floats or None") from None
    weight = np.asarray(weights or [1.0] * len(rewards), np.float64)
    total = np.nansum(table * weight[None, :], axis=1)
    total[np.isnan(table).all(axis=1)] = np.nan
    return table, total


def advantages(total: np.ndarray, group: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], whether each group's std is zero [N]) from the weighted rewards ``total`` [N], grouped
    ``group`` at a time, as TRL's ``sum_then_normalize``: the group's mean subtracted, divided by
    the group's std (``group``) or the batch's (``batch``) plus 1e-4, or not (``none``); an unscored
    completion gets 0."""
    grouped = total.reshape(-1, group)
    with np.errstate(all="ignore"):
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
        group_std = np.repeat(_nanstd(grouped), group)
        std = np.full_like(total, _nanstd(total[None, :])[0]) if scale == "batch" else group_std
        out = total - mean
        if scale != "none":
            out = out / (std + 1e-4)
    return np.nan_to_num(out, nan=0.0), np.isclose(std, 0.0)


def _nanstd(rows: np.ndarray) -> np.ndarray:
    """TRL's ``nanstd``: the unbiased std of each row's non-NaN values; NaN for fewer than two."""
    count = np.sum(~np.isnan(rows), axis=1)
    mean = np.nanmean(rows, axis=1, keepdims=True)
    variance = np.nansum((rows - mean) ** 2, axis=1) / np.maximum(count - 1, 1)
    return np.where(count > 1, np.sqrt(variance), np.nan)
