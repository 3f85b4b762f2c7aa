"""Continuous batching on the device: a fixed number of decode slots, each holding one sequence;
when a sequence stops (a stop id, its own limit) its pages go back to the pool and its slot takes
the next waiting sequence in the same step, so no slot decodes after its sequence has ended. One
``lax.while_loop``: no host round trip per token.

Sequences are numbered prompt-major (prompt p's completion c is ``p * copies + c``) and start in
that order. A sequence's token at place n is drawn with the key ``fold(fold(fold(key, p), c), n)``:
the tokens are a function of (seed, prompt, completion, position) alone, whatever the number of
slots, the page size or the order in which sequences end.

Pages: a wave's prompts take theirs from the pool when it is prefilled (the first before the loop,
each next one between decode steps once the last wave's sequences have all started, a slot is free
and the pool can give its pages), and give them back once the prompt's last completion ends. A new
sequence's page table starts as its prompt's; the prompt's last, part-filled page is copied into
a page of the sequence's own before its first token is written (copy on write). A sequence starts
only when the pool can give it every page its longest completion could need beyond what running
sequences may still take, so no sequence ever waits for a page mid-way."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from seqjax.engine.paged import PagedKV
from seqjax.model.cache import RecurrentView
from seqjax.model.sampling import sample_rows


class Requests(NamedTuple):
    """The wave the loop starts sequences from: per prompt its page table [prompts, P] (no page:
    the pool's size), length [prompts], the RoPE position of its first new token [prompts] and
    its next-token logits [prompts, V], each Gated DeltaNet layer's state after it; the request's
    index of its first prompt, and the end of its sequences; ``copies`` sequences a prompt."""

    prompt_pages: jax.Array
    prompt_lengths: jax.Array
    prompt_next: jax.Array
    prompt_logits: jax.Array
    # per layer: a Gated DeltaNet's state after each prompt [prompts, ...], or None (or () for none)
    prompt_states: tuple
    first: jax.Array
    end: jax.Array


class Waves(NamedTuple):
    """The waves' bookkeeping: the wave being started from, each prompt's completions not yet
    ended and its pages [prompts (+ a wave's padding), P], the waves prefilled beside a
    decoding slot, whether a decode step ran since the last prefill, and the waves prefilled
    beside a decoding slot with no step since the last (the loop's rule: none)."""

    index: jax.Array
    refs: jax.Array
    tables: jax.Array
    beside: jax.Array
    stepped: jax.Array
    unstepped: jax.Array


class Slots(NamedTuple):
    """The decode slots' state: each slot's sequence (-1: free), the next token's RoPE position,
    the tokens it has drawn, its next-token logits, the first page-table column it owns, and the
    pages it may still take."""

    sequence: jax.Array
    position: jax.Array
    drawn: jax.Array
    logits: jax.Array
    owned_from: jax.Array
    budget: jax.Array


class Pool(NamedTuple):
    """The free pages as a stack (``free[:top]``) and the next sequence to start."""

    free: jax.Array
    top: jax.Array
    next_sequence: jax.Array


class Outputs(NamedTuple):
    tokens: jax.Array  # [N, max_new]
    logprobs: jax.Array  # [N, max_new] float32: log p(token) under the model's logits (temperature 1)
    lengths: jax.Array  # [N]
    stopped: jax.Array  # [N] bool: ended at a stop id
    slot_steps: jax.Array  # decode slot-steps run
    token_steps: jax.Array  # slot-steps that drew a real token
    waves_beside_decode: jax.Array  # waves prefilled while some slot was decoding
    waves_without_a_step: jax.Array  # of those, prefilled with no decode step since the last prefill


def worst_pages(lengths: jax.Array, max_new: int, page_size: int) -> jax.Array:
    """The pages a sequence of each prompt may take of its own: its prompt's part-filled last page
    (copied) and its completion's."""
    return (lengths % page_size + max_new + page_size - 1) // page_size


def decode(model, cache: PagedKV, requests: Requests, pool: Pool, *, copies: int, max_new: int, stops: jax.Array,
           settings: dict, key: jax.Array, slots: int, prompts: int, emit=None,
           stop_sequences: jax.Array | None = None, shrink_to: int = 0, next_wave=None, wave_pages=None,
           wave_starts=None, waves=1) -> Outputs:
    """Every one of ``prompts`` prompts' ``copies`` completions of up to ``max_new`` tokens,
    through ``slots`` decode slots (the module's docstring), from the first wave's ``requests``; a
    sequence ends at any of ``stops`` or once its tokens end with a row of ``stop_sequences`` [S, L]
    (right-aligned, -1 to its left). ``emit(sequence, tokens, logprobs, lengths, stopped)``: a
    host function called (``io_callback``) on each step some sequences end in, with each slot's
    row (``sequence`` -1 where its slot's did not end), so a caller streams completions as they
    finish. ``shrink_to``: once no sequence waits, the step cuts its rows to two thirds each time
    the decoding slots fit (:func:`widths`; moved to the front, their pages stay where they are),
    down to this many (0: never), so the last long completions do not carry idle slots.
    ``next_wave(cache, pool, w, last) -> (cache, pool, requests)``: wave ``w`` (of ``waves``, each
    taking ``wave_pages[w]`` pages and starting ``wave_starts[w]`` prompts' sequences) prefilled,
    ``last`` the requests of the wave before it (None: one wave); between two prefills the decoding
    slots take at least one step, so a long prompt's pieces never hold them up for more than one
    piece at a time."""
    n = prompts * copies
    table = cache.page_table.shape[1]
    size, pages = cache.page_size, cache.pages
    state, out, book = _empty(requests, slots, prompts, copies, max_new, pages)
    cache, state, pool = _admit(cache, state, pool, requests, copies, max_new, size, pages)

    def more(carry):
        _, state, pool, *_ = carry
        return jnp.any(state.sequence >= 0) | (pool.next_sequence < n)

    def step(carry):
        cache, state, pool, out, requests, book = carry
        active = state.sequence >= 0
        seq = jnp.maximum(state.sequence, 0)
        keys = jax.vmap(lambda s, d: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(key, s // copies), s % copies), d))(seq, state.drawn)
        token = sample_rows(state.logits, keys, **settings)
        logp = jnp.take_along_axis(jax.nn.log_softmax(state.logits, axis=-1), token[:, None], axis=1)[:, 0]
        row = jnp.where(active, seq, n)  # (a free slot writes nowhere)
        out = out._replace(tokens=out.tokens.at[row, state.drawn].set(token, mode="drop"),
                           logprobs=out.logprobs.at[row, state.drawn].set(logp, mode="drop"),
                           slot_steps=out.slot_steps + state.sequence.shape[0],
                           token_steps=out.token_steps + jnp.sum(active))
        hit = jnp.isin(token, stops)
        if stop_sequences is not None:
            hit = hit | _ends_with(out.tokens[seq], state.drawn, stop_sequences)
        stop = active & (hit | (state.drawn + 1 >= max_new))
        going = active & ~stop
        cache, state, pool = _grow(cache, state, pool, going, size, pages, table)
        hidden, cache = model.decode(token[:, None], positions=state.position[:, None],
                                     segment_ids=going.astype(jnp.int32)[:, None], cache=cache)
        logits = model.logits(hidden)[:, 0].astype(jnp.float32)
        state = state._replace(position=state.position + going, drawn=state.drawn + active,
                               logits=jnp.where(going[:, None], logits, state.logits))
        out = out._replace(lengths=out.lengths.at[jnp.where(stop, seq, n)].set(state.drawn, mode="drop"),
                           stopped=out.stopped.at[jnp.where(stop, seq, n)].set(hit, mode="drop"))
        if emit is not None:
            _emit_ended(emit, stop, seq, out)
        cache, state, pool = _release(cache, state, pool, stop, pages)
        book, pool = _prompts_ended(book, pool, stop, seq // copies, pages)
        cache, state, pool = _admit(cache, state, pool, requests, copies, max_new, size, pages)
        return cache, state, pool, out, requests, book._replace(stepped=jnp.bool_(True))

    carry = (cache, state, pool, out, requests, book)
    if next_wave is not None:
        carry = _in_waves(more, step, carry, functools.partial(_next_wave, next_wave, copies, max_new),
                          wave_pages, wave_starts, waves)
    carry = _phases(more, step, carry, slots, shrink_to, n)
    return carry[3]._replace(waves_beside_decode=carry[5].beside, waves_without_a_step=carry[5].unstepped)


def _empty(requests: Requests, slots: int, prompts: int, copies: int, max_new: int, pages: int):
    """Free slots, empty outputs, and the waves' bookkeeping with the first wave begun."""
    n, vocab = prompts * copies, requests.prompt_logits.shape[-1]
    state = Slots(jnp.full((slots,), -1, jnp.int32), jnp.zeros((slots,), jnp.int32),
                  jnp.zeros((slots,), jnp.int32), jnp.zeros((slots, vocab), jnp.float32),
                  jnp.zeros((slots,), jnp.int32), jnp.zeros((slots,), jnp.int32))
    out = Outputs(jnp.zeros((n, max_new), jnp.int32), jnp.zeros((n, max_new), jnp.float32),
                  jnp.zeros((n,), jnp.int32), jnp.zeros((n,), bool), jnp.int32(0), jnp.int32(0), jnp.int32(0),
                  jnp.int32(0))
    wide = requests.prompt_pages.shape[0]  # (a wave's prompts: its padding may run past the last prompt)
    book = Waves(jnp.int32(0), jnp.full((prompts + wide,), copies, jnp.int32),
                 jnp.full((prompts + wide, requests.prompt_pages.shape[1]), pages, jnp.int32), jnp.int32(0),
                 jnp.bool_(False), jnp.int32(0))
    return state, out, _began(book, requests)


def _began(book: Waves, requests: Requests) -> Waves:
    """The pages of the wave just prefilled, under its prompts' request indices."""
    return book._replace(tables=jax.lax.dynamic_update_slice(book.tables, requests.prompt_pages,
                                                             (requests.first, jnp.int32(0))))


def _prompts_ended(book: Waves, pool: Pool, stop, prompt, pages: int) -> tuple[Waves, Pool]:
    """One completion fewer for each stopped slot's prompt; the pages of a prompt whose last one
    ended go back on the stack."""
    refs = book.refs.at[jnp.where(stop, prompt, book.refs.shape[0])].add(-1, mode="drop")
    ended = (refs == 0) & (book.refs > 0)

    def give_back(pool: Pool) -> Pool:
        owned = (ended[:, None] & (book.tables < pages)).reshape(-1)
        place = jnp.where(owned, pool.top + jnp.cumsum(owned) - 1, pool.free.shape[0])
        free = pool.free.at[place].set(book.tables.reshape(-1), mode="drop")
        return pool._replace(free=free, top=pool.top + jnp.sum(owned))

    pool = jax.lax.cond(jnp.any(ended), give_back, lambda pool: pool, pool)
    return book._replace(refs=refs), pool


def _in_waves(more, step, carry, begin, wave_pages, wave_starts, waves):
    """The decode loop while waves remain: ``step`` until the next wave is due, and at least once
    between two prefills while a slot decodes; then ``begin`` it. (The step as it is, no branch in
    it: one compiled body.)"""
    def steps(c):
        return more(c) & (~_due(c, wave_pages, wave_starts, waves) | (~c[5].stepped & jnp.any(c[1].sequence >= 0)))

    def wave(carry):
        carry = jax.lax.while_loop(steps, step, carry)
        return jax.lax.cond(_due(carry, wave_pages, wave_starts, waves), begin, lambda c: c, carry)

    return jax.lax.while_loop(lambda c: more(c) & (c[5].index + 1 < waves), wave, carry)


def _due(carry, wave_pages, wave_starts, waves) -> jax.Array:
    """Whether the next wave is prefilled now: every sequence of this one has started, a slot is
    free (unless the wave starts none: a long prompt's pieces before its last run ahead, beside
    full slots), and the pool can give its prompts' pages beyond what the decoding slots may still
    take. ``wave_pages``, ``wave_starts`` [W]: each wave's pages, and how many prompts' sequences it starts."""
    _, state, pool, _, requests, book = carry
    following = book.index + 1
    at = jnp.minimum(following, wave_pages.shape[0] - 1)
    pages, starts = wave_pages[at], wave_starts[at]
    spare = pool.top - jnp.sum(jnp.where(state.sequence >= 0, state.budget, 0))
    return ((pool.next_sequence >= requests.end) & (following < waves)
            & (jnp.any(state.sequence < 0) | (starts == 0)) & (spare >= pages))


def _next_wave(next_wave, copies: int, max_new: int, carry):
    """The next wave prefilled (from the last one's requests where it continues its prompt) and its
    first sequences started."""
    cache, state, pool, out, last, book = carry
    following = book.index + 1
    cache, pool, requests = next_wave(cache, pool, following, last)
    decoding = jnp.any(state.sequence >= 0)
    book = _began(book, requests)._replace(index=following, beside=book.beside + decoding, stepped=jnp.bool_(False),
                                           unstepped=book.unstepped + (decoding & ~book.stepped))
    cache, state, pool = _admit(cache, state, pool, requests, copies, max_new, cache.page_size, cache.pages)
    return cache, state, pool, out, requests, book


def widths(slots: int, shrink_to: int) -> list[int]:
    """The decode step's row counts in turn: ``slots``, then two thirds of the last (rounded down),
    down to ``shrink_to`` (0: ``slots`` only). Each is one compiled loop body; a step of width w runs
    while a sequence waits or more than the next width decode, so its slots are at least two thirds
    busy (halving kept them half busy: 93% of slot-steps on bench_engine's GRPO-like workload)."""
    out = [slots]
    while shrink_to and (narrower := max(shrink_to, out[-1] * 2 // 3)) < out[-1]:
        out.append(narrower)
    return out


def _phases(more, step, carry, slots: int, shrink_to: int, n: int):
    """The decode loop (``step`` while ``more``) at each of :func:`widths` rows in turn, cut to the
    next once nothing waits and its decoding slots fit in it."""
    def fits(width: int):
        def go_on(carry):
            _, state, pool, *_ = carry
            return more(carry) & ((pool.next_sequence < n) | (jnp.sum(state.sequence >= 0) > width))
        return go_on

    for narrower in widths(slots, shrink_to)[1:]:
        carry = jax.lax.while_loop(fits(narrower), step, carry)
        carry = _shrunk(carry, narrower)
    return jax.lax.while_loop(more, step, carry)


def _shrunk(carry, width: int):
    """The first ``width`` rows after moving the decoding slots to the front: their state, page
    tables, lengths and Gated DeltaNet rows (every other slot is free and owns no page)."""
    cache, state, pool, *rest = carry
    order = jnp.argsort(state.sequence < 0, stable=True)[:width]

    def take(a):
        return None if a is None else jnp.take(a, order, axis=0)

    recurrent = tuple(None if r is None else RecurrentView(take(r.conv), take(r.state), take(r.carry))
                      for r in cache.recurrent)
    cache = dataclasses.replace(cache, page_table=take(cache.page_table), lengths=take(cache.lengths),
                                recurrent=recurrent)
    return cache, Slots(*map(take, state)), pool, *rest


def _ends_with(tokens: jax.Array, drawn: jax.Array, sequences: jax.Array) -> jax.Array:
    """Whether each row of ``tokens`` [slots, max_new], drawn up to place ``drawn`` [slots], ends
    with any row of ``sequences`` [S, L] (right-aligned; -1: no token there)."""
    length = sequences.shape[1]
    places = drawn[:, None] + jnp.arange(length)[None, :] - (length - 1)  # [slots, L]
    tail = jnp.take_along_axis(tokens, jnp.maximum(places, 0), axis=1)
    same = (sequences[None] == -1) | ((places >= 0)[:, None] & (tail[:, None] == sequences[None]))
    return jnp.any(jnp.all(same, axis=-1), axis=-1)


def _emit_ended(emit, stop, seq, out: Outputs) -> None:
    """``emit`` on the host with the sequences that ended this step (only on steps some did)."""
    def call(args):
        io_callback(emit, None, *args, ordered=True)

    rows = (jnp.where(stop, seq, -1), out.tokens[seq], out.logprobs[seq], out.lengths[seq], out.stopped[seq])
    jax.lax.cond(jnp.any(stop), call, lambda args: None, rows)


def _grow(cache: PagedKV, state: Slots, pool: Pool, going, size: int, pages: int, table: int):
    """A page from the pool for each going slot whose next place starts a page."""
    wants = going & (cache.lengths % size == 0)
    rank = jnp.cumsum(wants) - 1
    page = jnp.where(wants, jnp.take(pool.free, jnp.maximum(pool.top - 1 - rank, 0)), pages)
    column = jnp.where(wants, cache.lengths // size, table)
    page_table = cache.page_table.at[jnp.arange(going.shape[0]), column].set(page, mode="drop")
    pool = pool._replace(top=pool.top - jnp.sum(wants))
    state = state._replace(budget=state.budget - wants)
    return _with_table(cache, page_table), state, pool


def _with_table(cache: PagedKV, page_table=None, lengths=None) -> PagedKV:
    changes = {k: v for k, v in (("page_table", page_table), ("lengths", lengths)) if v is not None}
    return dataclasses.replace(cache, **changes)


def _release(cache: PagedKV, state: Slots, pool: Pool, stop, pages: int):
    """The stopped slots' own pages back on the stack; the slots free."""
    table = cache.page_table.shape[1]
    own = stop[:, None] & (jnp.arange(table)[None, :] >= state.owned_from[:, None]) & (cache.page_table < pages)
    flat, owned = cache.page_table.reshape(-1), own.reshape(-1)
    place = jnp.where(owned, pool.top + jnp.cumsum(owned) - 1, pool.free.shape[0])
    free = pool.free.at[place].set(flat, mode="drop")
    page_table = jnp.where(stop[:, None], pages, cache.page_table)
    lengths = jnp.where(stop, 0, cache.lengths)
    state = state._replace(sequence=jnp.where(stop, -1, state.sequence), budget=jnp.where(stop, 0, state.budget))
    return _with_table(cache, page_table, lengths), state, pool._replace(free=free, top=pool.top + jnp.sum(owned))


def _admit(cache: PagedKV, state: Slots, pool: Pool, requests: Requests, copies: int, max_new: int, size: int,
           pages: int):
    """The free slots take the wave's next sequences, in order, while the pool can promise each
    its pages."""
    slots = state.sequence.shape[0]
    need = worst_pages(requests.prompt_lengths, max_new, size)
    empty = state.sequence < 0
    rank = jnp.cumsum(empty) - 1
    candidate = pool.next_sequence + rank
    within = empty & (candidate < requests.end)
    prompt = jnp.clip(candidate // copies - requests.first, 0, requests.prompt_lengths.shape[0] - 1)
    cost = jnp.where(within, need[prompt], 0)
    spare = pool.top - jnp.sum(jnp.where(empty, 0, state.budget))
    admitted = within & (jnp.cumsum(cost) <= spare)
    length = requests.prompt_lengths[prompt]
    partial = admitted & (length % size != 0)
    # the part-filled last prompt page, copied into a page of the sequence's own
    prank = jnp.cumsum(partial) - 1
    own_page = jnp.where(partial, jnp.take(pool.free, jnp.maximum(pool.top - 1 - prank, 0)), pages)
    last_column = length // size
    prompt_rows = requests.prompt_pages[prompt]
    source = jnp.take_along_axis(prompt_rows, jnp.minimum(last_column, prompt_rows.shape[1] - 1)[:, None], axis=1)
    # (most steps admit nothing: skip the copy's pass over every layer's pages then)
    cache = jax.lax.cond(jnp.any(partial), lambda c: c.copy_pages(source[:, 0], own_page), lambda c: c, cache)
    width = cache.page_table.shape[1]
    rows = jnp.pad(prompt_rows, ((0, 0), (0, width - prompt_rows.shape[1])), constant_values=pages)
    rows = rows.at[jnp.arange(slots), jnp.where(partial, last_column, width)].set(own_page, mode="drop")
    page_table = jnp.where(admitted[:, None], rows, cache.page_table)
    lengths = jnp.where(admitted, length, cache.lengths)
    if requests.prompt_states:  # (a Gated DeltaNet: the sequence starts from its prompt's state)
        cache = cache.with_states(admitted, requests.prompt_states, prompt)
    state = Slots(jnp.where(admitted, candidate, state.sequence),
                  jnp.where(admitted, requests.prompt_next[prompt], state.position),
                  jnp.where(admitted, 0, state.drawn),
                  jnp.where(admitted[:, None], requests.prompt_logits[prompt], state.logits),
                  jnp.where(admitted, last_column, state.owned_from),
                  jnp.where(admitted, need[prompt] - partial, state.budget))
    pool = pool._replace(top=pool.top - jnp.sum(partial), next_sequence=pool.next_sequence + jnp.sum(admitted))
    return _with_table(cache, page_table, lengths), state, pool
