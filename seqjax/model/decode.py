"""KV-cache decoding: one prefill over the prompts, then one jitted step per generated token.

    inputs, positions, segment_ids = prompt_batch(prompts)    # right-padded, [B, T]
    logits, cache = prefill(model, inputs, positions, segment_ids, max_len=T + new_tokens)
    for _ in range(new_tokens):
        token = jnp.argmax(logits, axis=-1)                    # [B]; or seqjax.model.sampling.sample
        logits, cache = decode_step(model, token, cache)

:func:`generate` is that loop with sampling and a stop at end-of-text.
Both return next-token logits [B, V] (float32). Every array in the cache has
a fixed shape ([B, max_len, ...]), and the write position is a traced scalar,
so ``decode_step`` compiles once for a (model, batch, max_len) and never again
per token. Attention over the cache uses :func:`segment_mask` with row indices
(contract 2): slots not written yet carry segment id 0 and are never attended.

Prompts of different lengths go right-padded in one batch (see
:func:`prompt_batch`): padding slots keep segment id 0, every row continues its
own last segment at its own next position, and generated tokens of all rows
are written to the same slot (prompt_len + step) — a row's padding gap is
simply masked. Cache attention always runs the XLA path
(:func:`masked_attention`): a step has one query per row, where the training
kernels have nothing to skip. Decoding past ``max_len`` slots yields NaN
logits (loud, not a silently overwritten cache): size ``max_len`` as prompt
length + new tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.core.errors import UsageError
from seqjax.model.cache import KVCache
from seqjax.model.sampling import SamplingConfig, sample
from seqjax.model.transformer import TransformerLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeCache:
    """Decoding state: the per-layer KV cache plus, per row, the position and segment id of the next
    token."""

    kv: KVCache
    positions: jax.Array  # [B] int32
    segment_ids: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.kv.segment_ids.shape[1]


def prompt_batch(prompts: Sequence[Sequence[int]],
                 pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pad token lists into (inputs, positions, segment_ids), int32 [B, max prompt length];
    one segment each."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompt_batch: expected at least one prompt, each with at least one token")
    length = max(len(p) for p in prompts)
    inputs = np.full((len(prompts), length), pad_id, np.int32)
    segment_ids = np.zeros_like(inputs)
    positions = np.zeros_like(inputs)
    for row, prompt in enumerate(prompts):
        inputs[row, : len(prompt)] = prompt
        segment_ids[row, : len(prompt)] = 1
        positions[row, : len(prompt)] = np.arange(len(prompt))
    return inputs, positions, segment_ids


def prefill(
    model: TransformerLM,
    inputs,
    positions=None,
    segment_ids=None,
    *,
    max_len: int,
    images: dict[str, np.ndarray] | None = None,
) -> tuple[jax.Array, DecodeCache]:
    """Run the prompts [B, T] once, filling a cache of ``max_len`` slots; return (next-token logits
    [B, V], cache).

    positions/segment_ids default to one segment per row starting at 0 (no
    padding). The logits are those of each row's last non-padding token. ``images``: the prompts'
    ``positions_3d`` and image fields (:func:`seqjax.data.image_rows.image_batch`'s, rows as the
    prompts'), for a model with a vision tower; each row then goes on from its last token's
    position (the text after an image: one past the image's largest).
    """
    inputs = jnp.asarray(inputs, jnp.int32)
    if segment_ids is None:
        segment_ids = jnp.ones_like(inputs)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[-1], dtype=jnp.int32), inputs.shape)
    model.check_batch(inputs, positions, segment_ids)
    t = inputs.shape[1]
    if not t <= max_len <= model.cfg.max_seq_len:
        raise ValueError(
            f"prefill: max_len={max_len}, expected between the prompt length {t} "
            f"and model.max_seq_len={model.cfg.max_seq_len}"
        )
    graphdef, state = nnx.split(model)
    images = {k: jnp.asarray(v) for k, v in (images or {}).items()}
    return _prefill_fn()(graphdef, state, inputs, jnp.asarray(positions, jnp.int32),
                         jnp.asarray(segment_ids, jnp.int32), max_len, images)


def decode_step(model: TransformerLM, tokens, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
    """Append one token per row ([B] int) to the cache; return (next-token logits [B, V], cache).

    Compiled once per (model structure, B, max_len); later calls reuse it.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.shape != cache.positions.shape:
        raise ValueError(
            f"decode_step: tokens has shape {tokens.shape}, expected {cache.positions.shape} (one per row)"
        )
    graphdef, state = nnx.split(model)
    return _step_fn()(graphdef, state, tokens, cache)


@functools.cache
def _prefill_fn():
    def run(graphdef, state, inputs, positions, segment_ids, max_len, images):
        model = nnx.merge(graphdef, state)
        kv = KVCache.empty(model.cfg, inputs.shape[0], max_len)
        logits, kv = model.decode(inputs, positions=positions, segment_ids=segment_ids, cache=kv, **images)
        if "positions_3d" in images:  # (the last token is text: its three positions are one)
            positions = images["positions_3d"][..., 0]
        t = inputs.shape[1]
        last = t - 1 - jnp.argmax((segment_ids != 0)[:, ::-1], axis=1)  # each row's last real token
        take = lambda a: jnp.take_along_axis(a, last[:, None], axis=1)[:, 0]  # noqa: E731
        logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        return logits, DecodeCache(kv, take(positions) + 1, take(segment_ids))

    return jax.jit(run, static_argnums=(0, 5))


@functools.cache
def _step_fn():
    def run(graphdef, state, tokens, cache: DecodeCache):
        model = nnx.merge(graphdef, state)
        overflow = cache.kv.length >= cache.max_len
        logits, kv = model.decode(tokens[:, None], positions=cache.positions[:, None],
                                  segment_ids=cache.segment_ids[:, None], cache=cache.kv)
        logits = jnp.where(overflow, jnp.nan, logits[:, 0])
        return logits, DecodeCache(kv, cache.positions + 1, cache.segment_ids)

    return jax.jit(run, static_argnums=0)


_sample = jax.jit(sample)


@dataclasses.dataclass
class Generation:
    """One row's continuation."""

    tokens: list[int]  # the new tokens, without the end-of-text that stopped them
    stopped: bool  # True: ended at end-of-text; False: ran out of max_new_tokens


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    eot_id: int | Sequence[int] | None,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(temperature=0.0),
    seed: int = 0,
    images: dict[str, np.ndarray] | None = None,
) -> list[Generation]:
    """Continue each token list in ``prompts`` (each already starting with its context) by up to
    ``max_new_tokens``. ``images``: the prompts' image fields, as :func:`prefill` takes them.

    A row stops at its first ``eot_id`` (several ids: at the first of any, e.g. a chat's end of
    turn; None: never, every row gets ``max_new_tokens``).
    """
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens: got {max_new_tokens}, expected at least 1")
    inputs, positions, segment_ids = prompt_batch(prompts)
    max_len = inputs.shape[1] + max_new_tokens
    limit = model.cfg.max_seq_len
    if inputs.shape[1] >= limit:  # the prompt alone leaves no room: the prompt is what must change
        raise UsageError(
            f"--prompt: the longest prompt is {inputs.shape[1]} tokens (with its opening token), but "
            f"model.max_seq_len={limit} leaves no room for a new token; expected at most {limit - 1}: "
            "shorten the prompt")
    if max_len > limit:
        raise UsageError(
            f"--max-new-tokens: got {max_new_tokens}, expected at most {limit - inputs.shape[1]}: the longest "
            f"prompt takes {inputs.shape[1]} of model.max_seq_len={limit} tokens")
    settings = sampling.arrays()
    stops = np.asarray([] if eot_id is None else np.atleast_1d(eot_id), np.int64)
    key = jax.random.key(seed)
    logits, cache = prefill(model, inputs, positions, segment_ids, max_len=max_len, images=images)
    new = np.zeros((len(prompts), max_new_tokens), np.int64)
    done = np.zeros(len(prompts), bool)
    length = np.full(len(prompts), max_new_tokens)
    for step in range(max_new_tokens):
        token = _sample(logits, jax.random.fold_in(key, step), **settings)
        new[:, step] = np.asarray(token)
        hit = np.isin(new[:, step], stops)
        ended = ~done & hit
        length[ended] = step
        done |= ended
        if done.all() or step == max_new_tokens - 1:
            break
        logits, cache = decode_step(model, token, cache)
    return [
        Generation(new[row, :length[row]].tolist(), bool(done[row])) for row in range(len(prompts))
    ]


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _sample_rollouts(graphdef, state, inputs, positions, segment_ids, key, max_new: int, copies: int, stops,
                     settings):
    """Prefill each prompt once, its cache and next-token logits copied to its ``copies`` rows, then a
    ``lax.while_loop`` of decode steps on the device until every row stopped or ``max_new`` tokens:
    no host round trip per token."""
    model = nnx.merge(graphdef, state)
    kv = KVCache.empty(model.cfg, inputs.shape[0], inputs.shape[1] + max_new)
    logits, kv = model.decode(inputs, positions=positions, segment_ids=segment_ids, cache=kv)
    last = inputs.shape[1] - 1 - jnp.argmax((segment_ids != 0)[:, ::-1], axis=1)
    take = lambda a: jnp.take_along_axis(a, last[:, None], axis=1)[:, 0]  # noqa: E731
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    cache = DecodeCache(kv, take(positions) + 1, take(segment_ids))
    # (rows prompt-major: a prompt's copies side by side, each sampling with its own row of the
    # key's folds)
    logits, cache = jax.tree.map(lambda a: jnp.repeat(a, copies, axis=0) if jnp.ndim(a) else a, (logits, cache))
    rows = logits.shape[0]
    tokens = jnp.zeros((rows, max_new), jnp.int32)
    length = jnp.full((rows, ), max_new, jnp.int32)
    done = jnp.zeros((rows, ), bool)

    def more(carry):
        step, _, _, _, _, done = carry
        return (step < max_new) & ~jnp.all(done)

    def body(carry):
        step, logits, cache, tokens, length, done = carry
        token = jnp.where(done, 0, sample(logits, jax.random.fold_in(key, step), **settings))
        tokens = tokens.at[:, step].set(token)
        stopped = ~done & jnp.isin(token, stops)
        length = jnp.where(stopped, step + 1, length)  # (the stop token is the completion's last, as TRL keeps it)
        done = done | stopped
        logits, kv = model.decode(token[:, None], positions=cache.positions[:, None],
                                  segment_ids=cache.segment_ids[:, None], cache=cache.kv)
        return step + 1, logits[:, 0], DecodeCache(kv, cache.positions + 1, cache.segment_ids), tokens, length, done

    carry = jax.lax.while_loop(more, body, (jnp.int32(0), logits, cache, tokens, length, done))
    return carry[3], carry[4], carry[5]


def sample_rollouts(model: nnx.Module, prompts: Sequence[Sequence[int]], *, stop_ids: Sequence[int],
                    max_new_tokens: int, sampling: SamplingConfig, key: jax.Array, copies: int = 1,
                    state=None) -> list[Generation]:
    """``copies`` completions of every prompt of ``prompts`` at once (an RL run's generation batch: ``G`` of
    each), in prompt order, by up to ``max_new_tokens`` sampled tokens; a row stops after the first
    of ``stop_ids``, which it keeps (TRL keeps the EOS in a completion and trains on it). One jitted
    program: a prefill of each prompt once (not ``G`` times), its cache copied to its rows, and a
    device-side loop of cached decode steps, for the model's shardings as they are (``state``: the
    model's state placed on the mesh, when given). Each row's randomness is the key's fold at each
    step: the same key gives the same completions."""
    inputs, positions, segment_ids = prompt_batch(prompts)
    if inputs.shape[1] + max_new_tokens > model.cfg.max_seq_len:
        raise UsageError(
            f"rl.max_completion_length: {max_new_tokens} new tokens after a prompt of {inputs.shape[1]} exceed "
            f"model.max_seq_len={model.cfg.max_seq_len}; expected prompts and completions that fit")
    graphdef, own = nnx.split(model)
    tokens, length, done = _sample_rollouts(graphdef, own if state is None else state, jnp.asarray(inputs),
                                            jnp.asarray(positions), jnp.asarray(segment_ids), key,
                                            max_new_tokens, copies, jnp.asarray(list(stop_ids), jnp.int32),
                                            sampling.arrays())
    tokens, length, done = np.asarray(tokens), np.asarray(length), np.asarray(done)
    return [Generation(tokens[row, :length[row]].tolist(), bool(done[row])) for row in range(len(tokens))]
