"""``engine.*``: the generation engine's sizes (seqjax.engine; docs/generation.md): how many
sequences decode at once, the KV cache's pages, and the attention over them. None of them changes
a sampled token: sampling is a function of (seed, prompt, completion, position) only."""

from __future__ import annotations

from dataclasses import dataclass

from seqjax.config.fields import setting
from seqjax.core.errors import ConfigError

PAGED_ATTENTION = ("auto", "xla", "pallas")


@dataclass
class EngineConfig:
    slots: int = setting(
        0, "sequences decoded at once; a slot whose sequence stops takes the next waiting one at once "
        "(0: every sequence of the request, up to 64)", min=0)
    page_size: int = setting(16, "tokens a KV page holds", min=1)
    kv_pages: int = setting(
        0, "the KV cache's size in pages, every layer (0: the prompts once, plus every slot's longest "
        "possible completion: no sequence ever waits for a page)", min=0)
    shrink_to: int = setting(
        4, "once no sequence waits, the step cuts its rows to two thirds each time the decoding slots fit (the "
        "decoding slots moved up, their pages left in place), down to this many (0: never): the last "
        "long completions do not carry idle slots; no sampled token changes (requests of 64 new tokens or "
        "more: each cut compiles one more loop body; 32 slots: 32, 21, 14, 9, 6, 4)", min=0)
    prefill_tokens: int = setting(
        65536, "prompt tokens a request prefills at once: a request with more runs in waves of "
        "whole prompts, in order, each next one prefilled between decode steps once the last one's "
        "sequences have all started, so a prompts file of any length fits the KV cache; a longer "
        "prompt is prefilled in pieces of this many tokens, a decode step between two (chunked "
        "prefill) (0: every prompt at once); no sampled token changes",
        min=0)
    attention: str = setting(
        "auto", "decode attention over the pages: xla (each slot's pages gathered, the paged mask; "
        "every backend), pallas (the pages read in place by a Pallas kernel: compiled on a GPU, "
        "interpreted elsewhere, slowly); auto: pallas on a GPU, xla elsewhere, and says which",
        choices=PAGED_ATTENTION)

    def check(self) -> None:
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"engine.page_size: got {self.page_size}, expected a power of two")
