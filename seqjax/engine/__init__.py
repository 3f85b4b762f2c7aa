"""The generation engine, the stage after the model: everything that samples (the RL rollouts
source, ``seqjax.generate``, evaluation tasks that generate) asks it for completions.

- **Packed prefill** (:mod:`seqjax.engine.prefill`): prompts packed into rows with segment ids, run
  through the training attention, their keys and values written into pages.
- **A paged KV cache** (:mod:`seqjax.engine.paged`): fixed-size pages and a page table per sequence;
  a group's completions share their prompt's pages.
- **Continuous batching** (:mod:`seqjax.engine.loop`): a fixed number of decode slots; a slot whose
  sequence stops takes the next at once, on the device.
- :class:`~seqjax.engine.engine.Engine` drives the three; :func:`generate` and
  :func:`sample_rollouts` are its two callers' forms, and :mod:`seqjax.engine.rollout` the protocol
  a rollout source implements.

Sampling is a function of (seed, prompt, completion, position) only (docs/generation.md).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import jax
import numpy as np

from seqjax.config.engine import EngineConfig
from seqjax.engine.engine import Completion, Engine
from seqjax.model.sampling import SamplingConfig

log = logging.getLogger("seqjax.engine")

__all__ = ["Completion", "Engine", "EngineConfig", "Generation", "generate", "sample_rollouts"]


@dataclasses.dataclass
class Generation:
    """One continuation: its new tokens and whether a stop id ended it (``generate`` leaves that
    id out; ``sample_rollouts`` keeps it, as TRL keeps the EOS in a completion)."""

    tokens: list[int]
    stopped: bool


def generate(model, prompts: Sequence[Sequence[int]], *, eot_id: int | Sequence[int] | None,
             max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(temperature=0.0), seed: int = 0,
             images: dict[str, np.ndarray] | None = None, copies: int = 1,
             engine: EngineConfig | None = None,
             on_done: Callable[[int, Generation], None] | None = None,
             stop_sequences: Sequence[Sequence[int]] = ()) -> list[Generation]:
    """Continue each prompt (token lists, each already starting with its context) by up to
    ``max_new_tokens``, stopping at the first ``eot_id`` (several: any; None: never) or once the
    tokens end with one of ``stop_sequences``; either is left out. ``copies`` continuations of
    each, prompt-major. ``images``: the prompts' image fields. ``on_done(index, generation)``: each
    continuation as it ends, while the others decode."""
    stops = [] if eot_id is None else [int(i) for i in np.atleast_1d(eot_id)]
    runner = Engine(model, engine)

    def generation(c: Completion) -> Generation:
        cut = 1 if c.stopped and c.tokens[-1] in stops else next(
            (len(s) for s in stop_sequences if c.stopped and len(s) and c.tokens[-len(s):] == list(s)), 0)
        return Generation(c.tokens[:len(c.tokens) - cut], c.stopped)

    done = runner.run(prompts, max_new_tokens=max_new_tokens, stop_ids=stops, sampling=sampling,
                      key=jax.random.key(seed), copies=copies, images=images, stop_sequences=stop_sequences,
                      on_done=None if on_done is None else lambda i, c: on_done(i, generation(c)))
    s = runner.stats
    log.info("engine: %d sequences on %d slots in %d wave(s)%s (%.0f%% of slot steps decoded a "
             "token), %d pages of %d tokens (%d hold the prompts once), %.1f MB of keys and values",
             s["sequences"], s["slots"], s["waves"],
             f", {s['pieces']} of them pieces of prompts longer than engine.prefill_tokens" if s["pieces"] else "",
             100 * s["slot_use"], s["pages"], s["page_size"], s["prompt_pages"], s["kv_bytes"] / 1e6)
    return [generation(c) for c in done]


def sample_rollouts(model, prompts: Sequence[Sequence[int]], *, stop_ids: Sequence[int], max_new_tokens: int,
                    sampling: SamplingConfig, key: jax.Array, copies: int = 1, state=None,
                    engine: EngineConfig | None = None) -> list[Completion]:
    """``copies`` completions of every prompt (an RL generation batch: G of each), prompt-major,
    each ending after the first of ``stop_ids`` (kept); ``state``: the model's state placed on
    the mesh."""
    return Engine(model, engine, state=state).run(prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                                  sampling=sampling, key=key, copies=copies)
