"""The gated delta rule over packed rows, the state reset at every segment start
(:func:`seqjax.model.mask.state_carries`): the recurrence of Qwen3.5's Gated DeltaNet layers
(:mod:`seqjax.model.deltanet`).

The rule, per head, with a state S [d_k, d_v] carried along the row:

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Two forms, one reset rule:

- :func:`chunked_rule` (training, prefill): chunks of C tokens; within a chunk the UT transform
  (one triangular solve) and the chunk's own attention, both under the segment mask; across
  chunks a scan carrying S. A segment start inside a chunk is exact: a token reads the carried
  state only if its segment continues from before the chunk, and only the chunk's last segment
  writes the state it passes on.
- :func:`recurrent_rule` (decode): token by token, the state zeroed where it does not carry.

A shared prompt (``prefix_ids``) adds one entry state: a completion's segment starts from its
prompt's final state, token by token in :func:`prompt_rule` (the definition) and in chunks in
:func:`chunked_prompt_rule` (training), which the rule's linearity in that state makes exact.

Both compute in float32, as transformers does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seqjax.model.mask import allowed, run_starts, state_carries

HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x over the root of its squared sum plus ``eps`` (FLA's and transformers' form)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta):
    """Float32; q and k repeated to v's heads (each key head serves consecutive value heads),
    L2-normed, q scaled by 1 / sqrt(d_k)."""
    group = v.shape[2] // k.shape[2]
    q, k = (jnp.repeat(a, group, axis=2) if group > 1 else a for a in (q, k))
    q, k, v, g, beta = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_rule(q, k, v, g, beta, segment_ids, *, state=None, before=None):
    """The gated delta rule token by token: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g and beta
    [B, T, H], ``state`` [B, H, Dk, Dv] carried in from the token before the row, whose segment
    is ``before`` [B] (default: none). (out [B, T, H, Dv] in v's dtype, the state after the
    row's last token)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, _, h, dk = k.shape
    carries = state_carries(segment_ids, before).astype(jnp.float32)
    real = (segment_ids != 0).astype(jnp.float32)
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t, carry_t, real_t = xs
        s = s * (jnp.exp(g_t) * carry_t[:, None])[..., None, None]
        seen = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - seen) * (beta_t * real_t[:, None])[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST) * real_t[:, None, None]

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, carries, real))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def chunked_rule(q, k, v, g, beta, segment_ids, *, chunk: int = 64, state=None, before=None,
                 ends=None, kernel: str = "xla"):
    """The gated delta rule in chunks of ``chunk`` tokens (shapes as :func:`recurrent_rule`; the
    row zero-padded to a multiple of it, the padding continuing the row's last segment with no
    decay and no write, so the state returned is the one after the row's last token). ``ends``
    [E, 2] (row, place) pairs: the state returned is instead the one after each of those tokens
    [E, H, Dk, Dv] (:func:`_states_at`: a packed prefill's prompts, each ending mid-row).
    ``kernel``: the scan over chunks as one ``lax.scan`` (xla) or one Pallas kernel (pallas:
    :mod:`seqjax.model.kernels.delta_scan`)."""
    dtype, t = v.dtype, segment_ids.shape[1]
    c = _Chunks(q, k, v, g, beta, segment_ids, chunk, before)
    state = c.zero if state is None else state.astype(jnp.float32)
    terms = (c.values, c.k_read, c.q_read, c.inner, c.k_write, c.keep)

    def step(s, xs):
        values_i, k_read_i, q_read_i, inner_i, k_write_i, keep_i = xs
        new = values_i - _dot(k_read_i, s)
        out = _dot(q_read_i, s) + _attend(inner_i, new)
        s_next = s * keep_i + jnp.einsum("bhcd,bhce->bhde", k_write_i, new, precision=HIGHEST)
        return s_next, (out, (s, new) if ends is not None else None)

    if kernel == "pallas":
        out, kept, state = _kernel_scan(terms, state)
    else:
        state, (out, kept) = jax.lax.scan(step, state, terms)
    if ends is not None:
        state = _states_at(ends, *kept, c.k, c.cum, c.same, c.carries, chunk)
    return c.unchunk(out)[:, :t].astype(dtype), state


def _kernel_scan(terms, state):
    """:func:`chunked_rule`'s scan by the Pallas kernel: the terms [N, B, H, C, ...] laid out
    [B, H, N * C, ...] for it, and its outputs back: (out, (entering states, new), last state)."""
    from seqjax.model.kernels.delta_scan import delta_scan  # (Pallas's import only where it runs)

    n, chunk = terms[0].shape[0], terms[0].shape[3]

    def rows(a):
        a = jnp.moveaxis(a, 0, 2)
        return a.reshape(*a.shape[:2], -1, a.shape[-1])

    def chunks(a, per):
        a = a.reshape(*a.shape[:2], n, per, a.shape[-1])
        return jnp.moveaxis(a, 2, 0)

    keep = jnp.moveaxis(terms[-1][..., 0, 0], 0, 2)  # [N, B, H, 1, 1] -> [B, H, N]
    out, states, new, last = delta_scan(*map(rows, terms[:-1]), keep, state)
    return chunks(out, chunk), (chunks(states, state.shape[-2]), chunks(new, chunk)), last


def _dot(a: jax.Array, s: jax.Array) -> jax.Array:
    """[B, H, C, Dk] rows times the states [B, H, Dk, Dv]: [B, H, C, Dv]."""
    return jnp.einsum("bhcd,bhde->bhce", a, s, precision=HIGHEST)


def _attend(m: jax.Array, x: jax.Array) -> jax.Array:
    """A chunk's [B, H, C, C] weights over its tokens' [B, H, C, Dv] values."""
    return jnp.einsum("bhij,bhje->bhie", m, x, precision=HIGHEST)


class _Chunks:
    """:func:`chunked_rule`'s terms, chunk by chunk [N, B, H, C, ...]: the row's tokens in chunks,
    the segment mask within each (``same``), which tokens read the state carried into their chunk
    (``carries``), the UT transform's solved values and state reads, the chunk's own attention
    (``inner``), and what the chunk's last segment writes to the state it passes on."""

    def __init__(self, q, k, v, g, beta, segment_ids, chunk: int, before=None):
        q, k, v, g, beta = _prepare(q, k, v, g, beta)
        b, t, h, dk = k.shape
        self.b, self.pad, self.chunk = b, -t % chunk, chunk
        self.n = (t + self.pad) // chunk
        self.zero = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
        seg = self.padded(segment_ids)
        before = jnp.zeros((b,), seg.dtype) if before is None else before.astype(seg.dtype)
        before = jnp.concatenate([before[:, None], seg[:, chunk - 1:-1:chunk]], axis=1)  # [B, N]
        self.q, self.k, v, g, beta = (self.chunks(a) for a in (q, k, v, g, beta))
        self.seg, before = self.ints(seg), before.T  # [N, B, C], [N, B]
        place = jnp.arange(chunk)
        self.same = allowed(self.seg[..., :, None], self.seg[..., None, :], place[:, None], place[None, :])[:, :, None]
        self.carries = allowed(self.seg, before[..., None], 1, 0)[:, :, None, :, None]  # [N, B, 1, C, 1]
        # (the chunk's last segment)
        last = allowed(self.seg[..., -1:], self.seg, chunk - 1, place)[:, :, None, :, None]
        self.cum = cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
        self.decay = jnp.where(self.same, jnp.exp(jnp.where(self.same, cum[..., :, None] - cum[..., None, :], 0.0)),
                               0.0)
        self.k_beta = self.k * beta[..., None]
        system = jnp.einsum("...id,...jd->...ij", self.k_beta, self.k, precision=HIGHEST) * self.decay
        self.solve = functools.partial(jax.lax.linalg.triangular_solve, system, left_side=True, lower=True,
                                       unit_diagonal=True)  # (I + strictly-lower(system))^-1 rhs
        grown = jnp.exp(cum)[..., None]
        self.values = self.solve(v * beta[..., None])
        self.k_read = self.solve(jnp.where(self.carries, self.k_beta * grown, 0.0))
        self.q_read = jnp.where(self.carries, self.q * grown, 0.0)
        self.inner = jnp.einsum("...id,...jd->...ij", self.q, self.k, precision=HIGHEST) * self.decay
        to_end = jnp.exp(jnp.where(last, cum[..., -1:, None] - cum[..., None], 0.0))
        self.k_write = jnp.where(last, self.k * to_end, 0.0)
        self.keep = jnp.where(self.carries[..., -1, 0], jnp.exp(cum[..., -1]), 0.0)[..., None, None]  # [N, B, H, 1, 1]

    def padded(self, a: jax.Array) -> jax.Array:
        """[B, T] ids, the padding continuing the row's last."""
        return jnp.concatenate([a, jnp.repeat(a[:, -1:], self.pad, axis=1)], axis=1)

    def ints(self, a: jax.Array) -> jax.Array:
        """[B, T + pad] -> [N, B, C]."""
        return jnp.moveaxis(a.reshape(self.b, self.n, self.chunk), 1, 0)

    def chunks(self, a: jax.Array) -> jax.Array:
        """[B, T, H, ...] -> [N, B, H, C, ...], zero-padded."""
        a = jnp.pad(a, ((0, 0), (0, self.pad)) + ((0, 0),) * (a.ndim - 2))
        a = a.reshape(self.b, self.n, self.chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    def unchunk(self, out: jax.Array) -> jax.Array:
        """[N, B, H, C, Dv] -> [B, T + pad, H, Dv]."""
        return jnp.moveaxis(jnp.moveaxis(out, 3, 2), 0, 1).reshape(self.b, self.n * self.chunk, out.shape[2], -1)


def _states_at(ends, entering, new, k, cum, same, carries, chunk: int):
    """The state after each token ``ends`` [E, 2] (row, place) names, from :func:`chunked_rule`'s
    chunks [N, B, ...]: the state ``entering`` its chunk, decayed to the token where its segment
    continues from before the chunk, plus the writes ``new`` of the chunk's tokens up to it in its
    segment, each decayed from its own place; what the chunk's end does for its last segment, at
    any place. [E, H, Dk, Dv]."""
    row, place = ends[:, 0], ends[:, 1]
    c, i = place // chunk, place % chunk

    def at(a):  # [N, B, ...] -> [E, ...]: the end's chunk and row
        return a[c, row]

    cum_e = at(cum)  # [E, H, C]
    # [E, C]: its segment's tokens up to it
    mine = jnp.take_along_axis(at(same)[:, 0], i[:, None, None], axis=1)[:, 0]
    here = jnp.take_along_axis(cum_e, i[:, None, None], axis=2)  # [E, H, 1]
    decayed = jnp.exp(jnp.where(mine[:, None], here - cum_e, 0.0))
    weight = jnp.where(mine[:, None], decayed, 0.0)  # [E, H, C]
    written = jnp.einsum("ehc,ehcd,ehcv->ehdv", weight, at(k), at(new), precision=HIGHEST)
    continues = jnp.take_along_axis(at(carries)[:, 0, :, 0], i[:, None], axis=1)[:, 0]  # [E]
    keep = jnp.where(continues[:, None], jnp.exp(here[..., 0]), 0.0)  # [E, H]
    return at(entering) * keep[..., None, None] + written


def prompt_rule(q, k, v, g, beta, segment_ids, prefix_ids):
    """:func:`recurrent_rule` over a row with a shared prompt: a completion's segment starts from the
    state its prompt ended with (kept in a register the prompt's tokens write, the completions never),
    so each completion continues its prompt as in its own sequence; any other segment starts at
    zero. (out [B, T, H, Dv] in v's dtype, the state after the row.)"""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, _, h, dk = k.shape
    previous = jnp.concatenate([jnp.zeros((b, 1), segment_ids.dtype), segment_ids[:, :-1]], axis=1)
    from_prompt = (segment_ids != previous) & (prefix_ids != 0)
    carries = state_carries(segment_ids).astype(jnp.float32)
    prompt = (prefix_ids == 0) & (segment_ids != 0)
    real = (segment_ids != 0).astype(jnp.float32)
    zero = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)

    def step(carry, xs):
        s, register = carry
        q_t, k_t, v_t, g_t, beta_t, carry_t, from_prompt_t, prompt_t, real_t = xs
        s = jnp.where(from_prompt_t[:, None, None, None], register, s * carry_t[:, None, None, None])
        s = s * jnp.exp(g_t)[..., None, None]
        seen = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        s = s + k_t[..., :, None] * ((v_t - seen) * (beta_t * real_t[:, None])[..., None])[..., None, :]
        register = jnp.where(prompt_t[:, None, None, None], s, register)
        return (s, register), jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST) * real_t[:, None, None]

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, carries, from_prompt, prompt, real))
    (state, _), out = jax.lax.scan(step, (zero, zero), xs)
    return jnp.moveaxis(out, 0, 1).astype(dtype), state


def chunked_prompt_rule(q, k, v, g, beta, segment_ids, prefix_ids, *, chunk: int = 64):
    """:func:`prompt_rule` in chunks, exact: a completion whose segment starts inside a chunk enters
    with its prompt's final state, as a continuing segment enters with the carried one. The rule
    is linear in the state a segment enters with, so each such token reads that state through the
    UT transform as :func:`chunked_rule`'s carried tokens read theirs. A prompt that ended before
    the chunk left its state in a register the scan carries; one that ends inside it is the
    chunk's own state at its last token, the carried state decayed plus its tokens' writes, and
    its completions read those writes as a second attention over the chunk (``m_k``, ``m_q``).
    (out [B, T, H, Dv] in v's dtype, the state after the row.)"""
    dtype, t = v.dtype, segment_ids.shape[1]
    c = _Chunks(q, k, v, g, beta, segment_ids, chunk)

    def step(carry, xs):
        s, r = carry
        values, k_read, k_s, k_r, q_s, q_r, m_k, m_q, inner, k, k_write, keep, w_end, a_end, ends, enters = xs
        base = values - _dot(k_read, s)  # (a prompt's tokens' and every token's but a completion's entry)
        new = base - _dot(k_s, s) - _dot(k_r, r) - _attend(m_k, base)
        out = _dot(q_s, s) + _dot(q_r, r) + _attend(inner, new) + _attend(m_q, base)
        at_end = s * a_end[..., None, None] + jnp.einsum("bhc,bhcd,bhce->bhde", w_end, k, new, precision=HIGHEST)
        r = jnp.where(ends[:, None, None, None], at_end, r)
        s = s * keep + jnp.einsum("bhcd,bhce->bhde", k_write, new, precision=HIGHEST) + enters[..., None, None] * r
        return (s, r), out

    (state, _), out = jax.lax.scan(step, (c.zero, c.zero), _prompt_terms(c, segment_ids, prefix_ids))
    return c.unchunk(out)[:, :t].astype(dtype), state


def _prompt_terms(c: _Chunks, segment_ids: jax.Array, prefix_ids: jax.Array) -> tuple:
    """:func:`chunked_prompt_rule`'s scan inputs, chunk by chunk: a completion token entering in
    its chunk (``fresh``) reads its prompt's state through ``k_entry`` / ``q_entry``, from the
    register (``k_r``, ``q_r``: the prompt ended before the chunk) or from the chunk's own state at
    the prompt's last token ``e`` (the carried state through ``k_s`` / ``q_s``, the prompt's
    writes through ``m_k`` / ``m_q``); ``w_end`` / ``a_end`` give the state at the chunk's last
    prompt token (``ends``), and ``enters`` decays the register into the chunk's last segment when
    that is a completion entering in it."""
    seg, pre = c.padded(segment_ids), c.padded(prefix_ids)
    b, width = seg.shape
    index = jnp.broadcast_to(jnp.arange(width), (b, width))
    first = index - index % c.chunk  # each token's chunk's first index
    start = run_starts(seg)
    prompt = (pre == 0) & (seg != 0)
    last_prompt = jax.lax.cummax(jnp.where(prompt, index, -1), axis=1)
    fresh = (pre != 0) & (seg != 0) & (start >= first) & (last_prompt >= 0)
    inside = fresh & (last_prompt >= first)
    e, since, fresh, inside = (c.ints(a) for a in (jnp.where(inside, last_prompt - first, 0),
                                                     jnp.where(fresh, start - first, 0), fresh, inside))
    end = jnp.max(jnp.where(c.ints(prompt), jnp.arange(c.chunk), -1), axis=-1)  # [N, B]

    def take(a, i):  # a [N, B, H, C] at places i [N, B, C] (or [N, B, 1])
        return jnp.take_along_axis(a, jnp.broadcast_to(i[:, :, None], a.shape[:3] + i.shape[-1:]), axis=-1)

    def decay_rows(i):  # the decay [N, B, H, C, C]'s rows at places i [N, B, C] (or [N, B, 1])
        shape = c.decay.shape[:3] + (i.shape[-1], c.chunk)
        return jnp.take_along_axis(c.decay, jnp.broadcast_to(i[:, :, None, :, None], shape), axis=-2)

    cum = c.cum
    from_start = jnp.exp(cum - jnp.where(since[:, :, None] > 0, take(cum, jnp.maximum(since - 1, 0)), 0.0))
    fresh4 = fresh[:, :, None, :, None]
    k_entry = c.solve(jnp.where(fresh4, c.k_beta * from_start[..., None], 0.0))
    q_entry = jnp.where(fresh4, c.q * from_start[..., None], 0.0)
    carried = c.carries[..., 0].astype(jnp.float32)  # [N, B, 1, C]
    a_e = jnp.where(inside[:, :, None], jnp.exp(take(cum, e)) * take(carried, e), 0.0)[..., None]
    rows = jnp.where(inside[:, :, None, :, None], decay_rows(e), 0.0)  # row t: the decay from each token to e(t)
    m_k, m_q = (jnp.einsum("...td,...jd->...tj", a, c.k, precision=HIGHEST) * rows for a in (k_entry, q_entry))
    outside = (fresh & ~inside)[:, :, None, :, None]
    at = jnp.maximum(end, 0)[..., None]  # [N, B, 1]
    w_end = jnp.where((end >= 0)[:, :, None, None], decay_rows(at)[..., 0, :], 0.0)
    a_end = jnp.where((end >= 0)[:, :, None], (jnp.exp(take(cum, at)) * take(carried, at))[..., 0], 0.0)
    enters = jnp.where(fresh[:, :, None, -1], from_start[..., -1], 0.0)  # [N, B, H]
    return (c.values, c.k_read, k_entry * a_e, jnp.where(outside, k_entry, 0.0), c.q_read + q_entry * a_e,
            jnp.where(outside, q_entry, 0.0), m_k, m_q, c.inner, c.k, c.k_write, c.keep, w_end, a_end, end >= 0,
            enters)
