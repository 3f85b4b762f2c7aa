"""``rl.rollouts_file``: completions sampled elsewhere, replayed by an RL run instead of sampling
(docs/rl.md), read and checked whole before any step.

One JSONL line per prompt: ``{"index": its number in the prompts (from 0), "completions": [text
or token ids, ...]}``, each prompt once, at least ``rl.num_generations`` completions, text
tokenized as a continuation or ids of the vocabulary. A completion longer than
``rl.max_completion_length`` is cut there, as sampling cuts it (it then counts as truncated), in
one line; any other fault is one line naming the file and line."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from seqjax.config.tree import Config
from seqjax.core.errors import DataError
from seqjax.store.prompts import Prompt

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Replay:
    """``rl.rollouts_file``, read and checked whole: each prompt's completions (token ids), by
    the prompt's number, and where each came from (``file:line``)."""

    completions: dict[int, list[list[int]]]
    lines: dict[int, str]



def read_rollouts(config: Config, tokenizer, prompts: list[Prompt], stop_ids: list[int]) -> Replay:
    """``rl.rollouts_file``, read and checked whole before any step: one line per prompt (its
    number in the prompts, each once), at least ``rl.num_generations`` completions each, as text
    (tokenized as a continuation) or token ids of the vocabulary. A completion longer than
    ``rl.max_completion_length`` is cut there, as sampling cuts it (and said in one line).
    Anything else is one line naming the file and line."""
    rl = config.rl
    file = Path(rl.rollouts_file).expanduser()
    if not file.is_file():
        raise DataError(f"rl.rollouts_file: {rl.rollouts_file!r} not found; expected a JSONL file of "
                        "{\"index\": ..., \"completions\": [...]} lines")
    expected = ("expected {\"index\": the prompt's line number from 0, \"completions\": [text or token ids, ...]} "
                f"with at least rl.num_generations={rl.num_generations} completions")
    vocab = config.model.vocab_size
    out: dict[int, list[list[int]]] = {}
    lines: dict[int, str] = {}
    cut: list[tuple[int, str]] = []
    for number, raw in enumerate(file.read_bytes().splitlines(), start=1):
        where = f"{file}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{where}: byte {err.start} (0x{raw[err.start]:02x}) is not UTF-8; "
                            "expected UTF-8 JSON lines") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            index, completions = record["index"], record["completions"]
            if isinstance(index, bool) or not isinstance(index, int) or not isinstance(completions, list):
                raise ValueError(f"index {index!r}, completions of type "
                                 f"{type(completions).__name__}")
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{where}: {err}; {expected}") from None
        if not 0 <= index < len(prompts):
            raise DataError(f"{where}: index {index} names no prompt; expected 0 to "
                            f"{len(prompts) - 1} (the prompts' line numbers from 0)")
        if index in out:
            raise DataError(f"{where}: index {index} again (first at {lines[index]}); expected one "
                            "line per prompt")
        if len(completions) < rl.num_generations:
            raise DataError(f"{where}: prompt {index} has {len(completions)} completions; expected "
                            f"rl.num_generations={rl.num_generations}")
        ids = []
        for k, completion in enumerate(completions):
            ids.append(_completion_ids(completion, tokenizer, vocab, f"{where}: completion {k}"))
            if len(ids[-1]) > rl.max_completion_length:
                cut.append((len(ids[-1]), where))
                ids[-1] = ids[-1][:rl.max_completion_length]
        out[index], lines[index] = ids, where
    missing = [i for i in range(len(prompts)) if i not in out]
    if missing:
        raise DataError(f"rl.rollouts_file: {file} has no line for prompt(s) "
                        f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''} "
                        f"of {len(prompts)}; expected one line per prompt")
    if cut:
        longest = max(cut)
        log.warning("rl.rollouts_file: %d completion(s) longer than rl.max_completion_length=%d "
                    "(the longest %d tokens, at %s) cut to %d tokens, as sampling cuts them (they "
                    "count as truncated)", len(cut),
                    rl.max_completion_length, longest[0], longest[1], rl.max_completion_length)
    return Replay(out, lines)


def _completion_ids(completion: Any, tokenizer, vocab: int | None, where: str) -> list[int]:
    if isinstance(completion, str):
        try:
            completion.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"{where}: character {err.start} is a lone surrogate "
                            f"({completion[err.start]!r}), not text; expected valid text or token "
                            "ids") from None
        return tokenizer.encode_text(completion)
    if not isinstance(completion, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                   for i in completion):
        raise DataError(f"{where}: {str(completion)[:40]!r} is neither text nor a list of token "
                        "ids; expected one of them")
    bad = [i for i in completion if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise DataError(f"{where}: token id {bad[0]} is outside the vocabulary; expected ids 0 to "
                        f"{vocab - 1}")
    return list(completion)


class ReplayRollout:
    """``rl.rollouts_file``'s completions as a rollout: each prompt's first G, as the file gives
    them (a completion ending at a stop id counts as stopped); the policy's weights are not
    needed."""

    def __init__(self, replay, stop_ids):
        self.replay, self.stop_ids = replay, set(stop_ids)

    def update_params(self, model) -> None:
        return None

    def generate(self, prompts, *, copies: int, generation: int) -> list[tuple[list[int], bool]]:
        return [(ids, bool(ids) and ids[-1] in self.stop_ids)
                for prompt in prompts for ids in self.replay.completions[prompt.index][:copies]]
