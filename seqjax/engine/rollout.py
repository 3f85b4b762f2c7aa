"""The one protocol for anything that gives an RL run its completions (Tunix's ``BaseRollout``,
verl's ``BaseRollout``, TRL's ``sync_weights``): the run hands it the policy's weights before each
generation batch, then asks for the groups.

    rollout.update_params(model)                       # the policy as it is now (adapters unmerged)
    groups = rollout.generate(prompts, copies=G, generation=k)   # prompt-major (ids, stopped) pairs

:class:`EngineRollout` samples them with the engine; ``rl.rollouts_file`` replays them
(seqjax.store.replay.ReplayRollout)."""

from __future__ import annotations

from typing import Protocol, Sequence

import jax

from seqjax.config.engine import EngineConfig
from seqjax.engine.engine import Engine
from seqjax.model.sampling import SamplingConfig


class Rollout(Protocol):
    def update_params(self, model) -> None:
        """The policy the next completions come from."""

    def generate(self, prompts: Sequence, *, copies: int, generation: int) -> list[tuple[list[int], bool]]:
        """``copies`` completions of each prompt (objects with ``ids`` and ``index``), prompt-major:
        (token ids, ended at a stop id)."""


class EngineRollout:
    """Completions sampled by the engine from the policy: generation ``k``'s with the key ``key``
    folded with ``k``, so a resumed run samples what the uninterrupted one did."""

    def __init__(self, key: jax.Array, stop_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig,
                 config: EngineConfig | None = None):
        self.key, self.stop_ids, self.max_new, self.sampling = key, list(stop_ids), max_new_tokens, sampling
        self.config, self.model = config, None
        self.stats: dict = {}

    def update_params(self, model) -> None:
        self.model = model

    def generate(self, prompts: Sequence, *, copies: int, generation: int) -> list[tuple[list[int], bool]]:
        engine = Engine(self.model, self.config)
        done = engine.run([p.ids.tolist() for p in prompts], max_new_tokens=self.max_new, stop_ids=self.stop_ids,
                          sampling=self.sampling, key=jax.random.fold_in(self.key, generation), copies=copies)
        self.stats = engine.stats
        return [(c.tokens, c.stopped) for c in done]
