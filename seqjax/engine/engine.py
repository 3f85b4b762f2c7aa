"""The engine: prompts in, completions out, through a packed prefill and continuous batching over a
paged KV cache (docs/generation.md).

    engine = Engine(model, EngineConfig(slots=32))
    done = engine.run(prompts, copies=8, max_new_tokens=256, stop_ids=[eos],
                      sampling=SamplingConfig(), key=jax.random.key(0))
    # prompt-major: prompt p's completion c is done[p * 8 + c]
    engine.stats  # slot use, pages, KV bytes of the last run

One compiled program a run: the first wave's prefill (its prompts once, packed), then the decode loop
(one ``lax.while_loop``) over the cache it filled; a request of more prompt tokens than
``engine.prefill_tokens`` runs in waves, each next wave prefilled inside the loop, between decode
steps, as soon as the last wave's sequences have all started and a slot is free, into pages the
pool gives it (a prompt's pages go back once its last completion ends). A prompt longer than
``engine.prefill_tokens`` is prefilled in pieces of that many tokens, one wave each (chunked
prefill): its first packed as any wave, taking all its pages; each next one continuing it over the
pages written so far, through the decode step's paged attention. Its shapes are bucketed to
powers of two, so a run of another size usually reuses them."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.engine import EngineConfig
from seqjax.core.errors import UsageError
from seqjax.core.progress import log_once
from seqjax.engine import loop
from seqjax.engine.paged import PagedKV
from seqjax.engine.prefill import _bucket, one_a_row, pack, prefill
from seqjax.model.cache import RecurrentView
from seqjax.model.sampling import SamplingConfig

_LOG = logging.getLogger(__name__)
DEFAULT_SLOTS = 64
SHRINK_FROM_NEW_TOKENS = 64  # (engine.shrink_to applies to requests of at least this many new tokens)


@dataclasses.dataclass
class Completion:
    """One sequence's new tokens (with the stop id that ended it, if one did), whether a stop id
    ended it, and each token's log-probability under the model's logits (temperature 1: what the
    training step computes for the same tokens)."""

    tokens: list[int]
    stopped: bool
    logprobs: list[float]


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run's sizes: decode slots, page size, pages in the pool (the prompts' first), page-table
    width, and the KV cache's bytes."""

    slots: int
    page_size: int
    pages: int
    prompt_pages: int
    table: int
    kv_bytes: int
    shrink_to: int = 0
    attention: str = "xla"
    pieces: bool = False  # (some prompt is prefilled in pieces: the wave's program takes both forms)


class Engine:
    """Generation for one model (its state placed as it is, or ``state``: the same graph's state
    placed on a mesh) under ``config`` (``engine.*``)."""

    def __init__(self, model, config: EngineConfig | None = None, *, state=None):
        self.model, self.config = model, config or EngineConfig()
        self.config.check()
        if model.cfg.layer_types and set(model.cfg.layer_types) == {"linear"}:
            raise UsageError("the engine: a model whose every layer is linear (model.layer_types) "
                             "has no attention layer to page; expected at least one full or sliding "
                             "layer")
        self.graphdef, own = nnx.split(model)
        self.state = own if state is None else state
        self.stats: dict = {}

    def plan(self, lengths: Sequence[int], copies: int, max_new: int, memory: bool = True,
             waves: Sequence["Wave"] = ()) -> Plan:
        """The sizes for prompts of ``lengths``, ``copies`` completions each, prefilled in ``waves``
        (first, end) (none: one), refused in one line when a prompt can never fit or
        (``memory``) the cache cannot fit in the memory free here."""
        cfg, size = self.model.cfg, self.config.page_size
        limit, longest = cfg.max_seq_len, int(np.argmax(lengths))
        for i, n in enumerate(lengths):  # (a prompt alone too long: the prompt is what must change)
            if n >= limit:
                raise UsageError(f"prompt {i}: {n} tokens (with its opening token), but "
                                 f"model.max_seq_len={limit} leaves no room for a new token; "
                                 f"expected at most {limit - 1}: shorten it")
        if lengths[longest] + max_new > limit:
            raise UsageError(f"--max-new-tokens: got {max_new}, expected at most "
                             f"{limit - lengths[longest]}: prompt {longest} takes "
                             f"{lengths[longest]} of model.max_seq_len={limit} tokens")
        sequences = len(lengths) * copies
        slots = min(sequences, self.config.slots or DEFAULT_SLOTS)
        waves = list(waves) or [Wave(0, len(lengths))]
        # (the largest wave's prompts; with more waves, room for the next one's beside it)
        prompt_pages = max(sum(-(-n // size) for n in lengths[w.first:w.end]) for w in waves)
        need = max(int(n % size + max_new + size - 1) // size for n in lengths)
        least = prompt_pages + need
        held = prompt_pages * min(2, len(waves))
        pages = self.config.kv_pages or _eighths(held + slots * need, least=64)
        if pages < least:
            raise UsageError(
                f"engine.kv_pages: got {pages}, expected at least {least}: the prompts' "
                f"{prompt_pages} pages and one sequence's {need} (engine.page_size={size})")
        table = _eighths(-(-(max(lengths) + max_new) // size))
        attention = sum(cfg.mixer_of(i) == "attention" for i in range(cfg.n_layers))
        itemsize = jnp.dtype(cfg.compute_dtype).itemsize
        per_page = 2 * attention * size * cfg.kv_heads * cfg.head_dim * itemsize
        # (each slot's, and each prompt's of a wave kept)
        states = (slots + max(w.end - w.first for w in waves)) * _state_bytes(cfg)
        # (each cut is one more compiled loop body: worth it where the tail it saves can be long)
        shrink_to = self.config.shrink_to if max_new >= SHRINK_FROM_NEW_TOKENS else 0
        plan = Plan(slots, size, pages, prompt_pages, table, pages * per_page + states, shrink_to,
                    decode_attention(self.config.attention), pieces=any(w.start for w in waves))
        free = _free_bytes() if memory else None
        if free is not None and plan.kv_bytes > free:
            raise UsageError(
                f"engine.kv_pages: {pages} pages of {size} tokens ({plan.kv_bytes / 1e9:.2f} GB of "
                f"keys and values over {cfg.n_layers} layers) exceed the {free / 1e9:.2f} GB free "
                f"on {jax.local_devices()[0].platform}; expected fewer engine.slots or "
                f"engine.kv_pages, or a smaller engine.prefill_tokens (prompts prefilled at once)")
        return plan

    def run(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
            sampling: SamplingConfig, key: jax.Array, copies: int = 1, images: dict | None = None,
            on_done: Callable[[int, Completion], None] | None = None,
            stop_sequences: Sequence[Sequence[int]] = ()) -> list[Completion]:
        """``copies`` completions of every prompt, prompt-major, each up to ``max_new_tokens`` and
        ending at the first of ``stop_ids`` or once it ends with one of ``stop_sequences`` (kept).
        ``images``: the prompts' image fields, one row each as
        :func:`seqjax.data.image_rows.image_batch` lays them out. ``on_done(index, completion)``:
        called on the host as each sequence ends, while the others decode."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UsageError("the engine: expected at least one prompt, each with at least one "
                             "token")
        if max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens: got {max_new_tokens}, expected at least 1")
        lengths = [len(p) for p in prompts]
        waves = [Wave(0, len(prompts))] if images else _waves(lengths, self.config.prefill_tokens)
        plan = self.plan(lengths, copies, max_new_tokens, waves=waves)
        rows, filled = self.rows(prompts, waves, plan, images)
        pool = loop.Pool(jnp.arange(plan.pages - 1, -1, -1, dtype=jnp.int32), jnp.int32(plan.pages), jnp.int32(0))
        _LISTENERS.append(on_done)
        try:
            out = _generate(self.graphdef, self.state, rows, pool, plan, len(prompts), copies, max_new_tokens,
                            jnp.asarray(list(stop_ids) or [-1], jnp.int32), sampling.arrays(), key,
                            on_done is not None, _right_aligned(stop_sequences))
            tokens, logprobs, lengths_out, stopped = (np.asarray(a) for a in out[:4])
        finally:
            _LISTENERS.pop()
        slot_steps, token_steps = int(out.slot_steps), int(out.token_steps)
        self.stats = {"sequences": len(tokens), "slots": plan.slots, "page_size": plan.page_size,
                      "pages": plan.pages, "prompt_pages": sum(-(-n // plan.page_size) for n in lengths),
                      "kv_bytes": plan.kv_bytes, "prefill_rows": filled,
                      "slot_steps": slot_steps, "token_steps": token_steps,
                      "slot_use": token_steps / max(slot_steps, 1), "new_tokens": int(lengths_out.sum()),
                      "waves": len(waves), "waves_beside_decode": int(out.waves_beside_decode),
                      "waves_without_a_step": int(out.waves_without_a_step),
                      "pieces": sum(w.stop is not None for w in waves)}
        return [Completion(tokens[i, :lengths_out[i]].tolist(), bool(stopped[i]),
                           logprobs[i, :lengths_out[i]].tolist()) for i in range(len(tokens))]

    def lower(self, lengths: Sequence[int], *, copies: int, max_new_tokens: int,
              sampling: SamplingConfig) -> tuple[jax.stages.Lowered, Plan]:
        """The program :meth:`run` compiles for prompts of ``lengths`` (``copies`` completions each, a
        stop id), lowered from shapes alone (nothing runs, no memory is checked), with its plan; the loop
        at its full width (``engine.shrink_to``'s narrower bodies hold less, and each compiles the step
        again). scripts/plan_memory.py reads its memory, the tests its compiled program."""
        waves = _waves(lengths, self.config.prefill_tokens)
        plan = dataclasses.replace(self.plan(lengths, copies, max_new_tokens, memory=False, waves=waves),
                                   shrink_to=0)
        rows, _ = self.rows([[1] * n for n in lengths], waves, plan, None)
        shape = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)  # noqa: E731
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        pool = loop.Pool(jax.ShapeDtypeStruct((plan.pages,), jnp.int32), scalar, scalar)
        return _generate.lower(self.graphdef, self.state, jax.tree.map(shape, rows), pool, plan, len(lengths),
                               copies, max_new_tokens, jax.ShapeDtypeStruct((1,), jnp.int32), sampling.arrays(),
                               jax.eval_shape(lambda: jax.random.key(0))), plan

    def rows(self, prompts, waves: Sequence["Wave"], plan: Plan, images: dict | None) -> tuple["Rows", int]:
        """Each wave's prefill rows (packed; one prompt a row with images; a piece's tokens in one
        row), stacked and padded to one shape, its prompts' page tables counting from 0 (the pages
        it is given replace them on the device); and how many rows hold prompts, over the waves."""
        if images and "linear" in self.model.cfg.layer_types:
            raise UsageError("the engine: images with linear layers (model.layer_types); expected "
                             "a model of attention layers for image prompts")
        if plan.pieces != any(w.start for w in waves):
            raise ValueError("Engine.rows: the plan was made for other waves (its pieces: "
                             f"{plan.pieces}); expected Engine.plan(..., waves=) of these")
        lengths = [len(p) for p in prompts]
        width = min(_eighths(max(-(-n // plan.page_size) for n in lengths)), plan.table)
        parts = [self._wave_rows(prompts, w, _prompt_tables(lengths[w.first:w.end], plan, width), plan, images)
                 for w in waves]
        count = _bucket(len(waves), 1)  # (few shapes to compile for: waves past the last are empty)
        r, t = (max(np.shape(part["inputs"])[i] for part in parts) for i in (0, 1))
        m = max(len(part["lengths"]) for part in parts)

        def stacked(name: str, fill, dims: tuple) -> jax.Array:
            out = np.full((count, *dims), fill, np.asarray(parts[0][name]).dtype)
            for w, part in enumerate(parts):
                out[(w, *(slice(0, d) for d in np.shape(part[name])))] = part[name]
            return jnp.asarray(out)

        def per_wave(values, fill=0) -> jax.Array:
            return jnp.asarray(np.pad(values, (0, count - len(waves)), constant_values=fill), jnp.int32)

        rows = Rows(stacked("inputs", 0, (r, t)), stacked("positions", 0, (r, t)),
                    stacked("segment_ids", 0, (r, t)), stacked("slots", plan.pages * plan.page_size, (r, t)),
                    stacked("last", 0, (m, 2)), stacked("tables", plan.pages, (m, width)),
                    stacked("lengths", 0, (m,)), stacked("next_position", 0, (m,)),
                    per_wave([w.first for w in waves], len(prompts)),
                    per_wave([part["count"] for part in parts]), per_wave([part["pages"] for part in parts]),
                    per_wave([w.start for w in waves]), {k: jnp.asarray(v) for k, v in (images or {}).items()})
        return rows, sum(part["filled"] for part in parts)

    def _wave_rows(self, prompts, wave: "Wave", tables: np.ndarray, plan: Plan, images: dict | None) -> dict:
        """One wave's rows, last places, tables, lengths, next positions, the sequences it starts
        and the pages it takes (numpy). A prompt's first piece is packed as a wave of its own and
        takes every page of the prompt; its later pieces take none, and its last starts its
        sequences."""
        prompts = prompts[wave.first:wave.end]
        if wave.start:
            return _piece_rows(prompts[0], wave, tables.shape[1], plan)
        if wave.stop is not None:  # (a first piece: its pages the whole prompt's, in ``tables``)
            prompts = [prompts[0][:wave.stop]]
        if images:
            inputs, positions, segment_ids, slots, last = _image_rows(prompts, tables, plan)
            next_position = np.asarray(images["positions_3d"])[..., 0][last[:, 0], last[:, 1]] + 1
        else:
            packed = pack(prompts, tables, plan.page_size, plan.pages)
            inputs, positions, segment_ids, slots = packed.inputs, packed.positions, packed.segment_ids, packed.slots
            last = packed.starts + np.asarray([[0, len(p) - 1] for p in prompts])
            next_position = np.asarray([len(p) for p in prompts])
        return {"inputs": inputs, "positions": positions, "segment_ids": segment_ids, "slots": slots,
                "last": last, "tables": tables, "lengths": np.asarray([len(p) for p in prompts], np.int32),
                "next_position": np.asarray(next_position, np.int32),
                "count": 0 if wave.stop is not None else len(prompts),
                "pages": int((tables < plan.pages).sum()), "filled": int((segment_ids.max(axis=1) > 0).sum())}


class Rows(NamedTuple):
    """Every wave's prefill rows [W, R, T] (inputs, positions, segment ids, each token's place in
    the wave's pages), each prompt's last token (row, column) [W, M, 2], page table (the wave's
    pages counted from 0), length and first new position [W, M]; each wave's first prompt, count of
    prompts whose sequences it starts, page count and first place in its prompt (0 but for a
    prompt's later pieces) [W]; and image fields (one wave)."""

    inputs: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    slots: jax.Array
    last: jax.Array
    tables: jax.Array
    lengths: jax.Array
    next_position: jax.Array
    first: jax.Array
    count: jax.Array
    pages: jax.Array
    offset: jax.Array
    images: dict


class Wave(NamedTuple):
    """One prefill: prompts [first, end) whole, or (``stop`` set) the piece [start, stop) of the one
    prompt ``first``, longer than engine.prefill_tokens."""

    first: int
    end: int
    start: int = 0
    stop: int | None = None


def _waves(lengths: Sequence[int], budget: int) -> list[Wave]:
    """The request's prompts cut, in order, into waves of at most ``budget`` prompt tokens each (0:
    one wave of all); a longer prompt alone, in pieces of ``budget`` tokens (chunked prefill).

    >>> _waves([9, 3, 14, 5, 7], 12)  # doctest: +NORMALIZE_WHITESPACE
    [Wave(first=0, end=2, start=0, stop=None), Wave(first=2, end=3, start=0, stop=12),
     Wave(first=2, end=3, start=12, stop=14), Wave(first=3, end=5, start=0, stop=None)]
    """
    waves, first, total = [], 0, 0
    for i, n in enumerate(lengths):
        if budget and i > first and total + n > budget:
            waves.append(Wave(first, i))
            first, total = i, 0
        if budget and n > budget:
            waves += [Wave(i, i + 1, start, min(start + budget, n)) for start in range(0, n, budget)]
            first = i + 1
            continue
        total += n
    return waves + [Wave(first, len(lengths))] * (first < len(lengths))


def _piece_rows(prompt, wave: Wave, width: int, plan: Plan) -> dict:
    """A later piece of a prompt as one row from its start: its tokens at their positions in the
    prompt; no page of its own (it writes into the pages its first piece took, which the device
    knows); the prompt's sequences started by its last piece."""
    n, t = wave.stop - wave.start, _bucket(wave.stop - wave.start, 16)
    inputs, positions, segment_ids = (np.zeros((1, t), np.int32) for _ in range(3))
    inputs[0, :n], segment_ids[0, :n] = prompt[wave.start:wave.stop], 1
    positions[0, :n] = np.arange(wave.start, wave.stop)
    return {"inputs": inputs, "positions": positions, "segment_ids": segment_ids,
            "slots": np.full((1, t), plan.pages * plan.page_size, np.int64), "last": np.asarray([[0, n - 1]]),
            "tables": np.full((1, width), plan.pages, np.int32), "lengths": np.asarray([len(prompt)], np.int32),
            "next_position": np.asarray([len(prompt)], np.int32), "count": int(wave.stop == len(prompt)),
            "pages": 0, "filled": 1}


def _eighths(n: int, least: int = 1) -> int:
    """n rounded up to a multiple of an eighth of its power of two (a step of at least ``least``):
    at most 12.5% more than asked (a page table's width, which decode attends over whole; the
    pool's pages, 64 at least a step), and few sizes to compile for."""
    step = max(least, _bucket(n, 1) // 8)
    return -(-n // step) * step


def _prompt_tables(lengths: Sequence[int], plan: Plan, width: int) -> np.ndarray:
    """Each prompt's pages, counted from 0 in order: [prompts, width] (no page: ``plan.pages``)."""
    size = plan.page_size
    tables = np.full((len(lengths), width), plan.pages, np.int32)
    first = 0
    for i, n in enumerate(lengths):
        count = -(-n // size)
        tables[i, :count] = np.arange(first, first + count)
        first += count
    return tables


def _image_rows(prompts, tables: np.ndarray, plan: Plan):
    """Prompts with images: one to a row, right-padded, as their image fields were laid out."""
    rows = one_a_row(prompts, tables, plan.page_size, plan.pages, width=max(len(p) for p in prompts),
                     rows=len(prompts))
    last = np.asarray([[i, len(p) - 1] for i, p in enumerate(prompts)])
    return rows.inputs, rows.positions, rows.segment_ids, rows.slots, last


# The running stream's on_done (Engine.run's), which the decode loop's host callback calls.
_LISTENERS: list = []


def _stream(sequence, tokens, logprobs, lengths, stopped) -> None:
    """loop.decode's ``emit``: each sequence that ended this step, as a Completion, to the listener."""
    for i in np.flatnonzero(np.asarray(sequence) >= 0):
        n = int(lengths[i])
        _LISTENERS[-1](int(sequence[i]), Completion(np.asarray(tokens[i, :n]).tolist(), bool(stopped[i]),
                                                    np.asarray(logprobs[i, :n]).tolist()))


def _right_aligned(sequences: Sequence[Sequence[int]]) -> jax.Array | None:
    """Stop sequences as one array [S, L], each right-aligned, -1 to its left (None: none)."""
    sequences = [list(map(int, s)) for s in sequences if len(s)]
    if not sequences:
        return None
    width = _bucket(max(map(len, sequences)), 1)  # (few shapes to compile for)
    return jnp.asarray([[-1] * (width - len(s)) + s for s in sequences], jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 11))
def _generate(graphdef, state, rows: Rows, pool, plan: Plan, prompts: int, copies: int, max_new: int, stops,
              settings, key, stream: bool = False, stop_sequences=None):
    """One program: the cache made, the first wave's prompts prefilled into it, the decode loop over
    it, which prefills each next wave between its steps (the cache lives inside, never an argument
    copied into the loop); ``stream``: each sequence handed to the host as it ends."""
    model = nnx.merge(graphdef, state)
    cache = PagedKV.empty(model.cfg, plan.pages, plan.page_size, plan.slots, plan.table, plan.attention)

    def wave(cache: PagedKV, pool: loop.Pool, w, last=None) -> tuple[PagedKV, loop.Pool, loop.Requests]:
        if not plan.pieces or last is None:  # (the first wave is never a later piece)
            return _prefill_wave(model, cache, pool, rows, w, plan, copies)
        return jax.lax.cond(rows.offset[w] > 0, functools.partial(_continue_prompt, model, rows, w, copies),
                            lambda cache, pool, _: _prefill_wave(model, cache, pool, rows, w, plan, copies),
                            cache, pool, last)

    cache, pool, requests = wave(cache, pool, 0)
    return loop.decode(model, cache, requests, pool, copies=copies, max_new=max_new, stops=stops,
                       settings=settings, key=key, slots=plan.slots, emit=_stream if stream else None,
                       stop_sequences=stop_sequences, shrink_to=plan.shrink_to, prompts=prompts,
                       next_wave=wave if rows.first.shape[0] > 1 else None,
                       wave_pages=rows.pages, wave_starts=rows.count, waves=jnp.sum(rows.first < prompts))


def _prefill_wave(model, cache: PagedKV, pool: loop.Pool, rows: Rows, w, plan: Plan, copies: int):
    """Wave ``w``'s prompts prefilled into pages taken from the top of the pool's stack: its
    tables' and token places' page numbers (counted from 0) become those pages."""
    def at(a):
        return jax.lax.dynamic_index_in_dim(a, w, keepdims=False)

    size, pages = plan.page_size, plan.pages
    count = at(rows.pages)
    order = jnp.arange(plan.prompt_pages)
    given = jnp.where(order < count, jnp.take(pool.free, jnp.maximum(pool.top - 1 - order, 0)), pages)
    tables = at(rows.tables)
    tables = jnp.where(tables < pages, jnp.take(given, tables, mode="clip"), pages)
    slots = at(rows.slots)
    slots = jnp.where(slots < pages * size, jnp.take(given, slots // size, mode="clip") * size + slots % size,
                      pages * size)
    images = dict(rows.images)
    if images:
        images = {"positions_3d": images.pop("positions_3d"), **images}
    logits, cache, states = prefill(model, cache, at(rows.inputs), at(rows.positions), at(rows.segment_ids), slots,
                                    at(rows.last), images)
    first = at(rows.first)
    requests = loop.Requests(tables, at(rows.lengths), at(rows.next_position), logits,
                             states if any(s is not None for s in states) else (), first,
                             (first + at(rows.count)) * copies)
    return cache, pool._replace(top=pool.top - count), requests


def _continue_prompt(model, rows: Rows, w, copies: int, cache: PagedKV, pool: loop.Pool, last: loop.Requests):
    """Wave ``w``, a later piece of the prompt the last wave prefilled (the first of ``last``'s
    prompts): its tokens continue the prompt over the pages written so far (the decode step's
    paged attention, a row of many tokens), each Gated DeltaNet layer from the state and
    convolution window the last piece left; its next-token logits and states replace the last
    piece's."""
    def at(a):
        return jax.lax.dynamic_index_in_dim(a, w, keepdims=False)

    inputs, segment_ids, place = at(rows.inputs)[:1], at(rows.segment_ids)[:1], at(rows.last)[:1]
    states = tuple(None if s is None else RecurrentView(s.conv[:1], s.state[:1], None, place)
                   for s in (last.prompt_states or (None,) * len(cache.recurrent)))
    piece = dataclasses.replace(cache, page_table=last.prompt_pages[:1], lengths=at(rows.offset)[None],
                                recurrent=states)
    x, piece = model.decode(inputs, positions=at(rows.positions)[:1], segment_ids=segment_ids, cache=piece)
    logits = model.logits(x[:, place[0, 1]][:, None])[:, 0].astype(jnp.float32)

    def first_replaced(kept, new):
        return kept.at[:1].set(new.astype(kept.dtype))

    kept = tuple(None if s is None else RecurrentView(*map(first_replaced, (s.conv, s.state), (n.conv, n.state)))
                 for s, n in zip(last.prompt_states, piece.recurrent))
    first = at(rows.first)
    requests = last._replace(prompt_lengths=at(rows.lengths), prompt_next=at(rows.next_position),
                             prompt_logits=first_replaced(last.prompt_logits, logits), prompt_states=kept,
                             first=first, end=(first + at(rows.count)) * copies)
    return dataclasses.replace(cache, keys=piece.keys, values=piece.values), pool, requests


def decode_attention(name: str) -> str:
    """``engine.attention`` resolved: auto is the Pallas kernel on a GPU (it reads each slot's pages
    in place; XLA's path copies them out every step) and XLA elsewhere, logged once."""
    if name != "auto":
        return name
    backend = jax.default_backend()
    pick = "pallas" if backend == "gpu" else "xla"
    log_once(_LOG, logging.INFO, "engine.attention=auto: %s on %s (decode attention over the pages)", pick, backend)
    return pick


def _state_bytes(cfg) -> int:
    """One sequence's Gated DeltaNet state over every linear layer: its convolution window (compute
    dtype) and its float32 recurrent state."""
    net = cfg.deltanet
    layers = sum(cfg.mixer_of(i) == "deltanet" for i in range(cfg.n_layers))
    conv = (net.conv_width - 1) * net.qkv_width * jnp.dtype(cfg.compute_dtype).itemsize
    return layers * (conv + net.value_heads * net.key_dim * net.value_dim * 4)


def _free_bytes() -> int | None:
    """Memory free for the cache: the device's (its allocator's limit less what is in use), or on
    the CPU the machine's available memory; None when unknown."""
    device = jax.local_devices()[0]  # (this process's: another's cannot be asked)
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
