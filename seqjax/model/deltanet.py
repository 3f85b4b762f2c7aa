"""Gated DeltaNet over packed rows: Qwen3.5's linear-attention layer, its state reset at every
segment start (:func:`seqjax.model.mask.state_carries`) and its convolution kept inside each
segment (:func:`seqjax.model.mask.conv_taps`), so a packed row gives every document what it
gets alone.

The layer, as transformers 5.24 computes it (``Qwen3_5GatedDeltaNet``):

    qkv = silu(causal_conv1d(x W_qkv))          depthwise, width 4, the last tap the token itself
    q, k, v = split(qkv);  z = x W_z
    beta = sigmoid(x W_b);  g = -exp(A_log) * softplus(x W_a + dt_bias)
    o = gated_delta_rule(l2norm(q) / sqrt(d_k), l2norm(k), v, g, beta)
    out = (rmsnorm(o) * w * silu(z)) W_out       the output norm's weight plain, not (1 + w)

The rule, per head, with a state S [d_k, d_v] carried along the row:

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Two forms, one reset rule:

- :func:`chunked_rule` (training, prefill): chunks of C tokens; within a chunk the UT transform
  (one triangular solve) and the chunk's own attention, both under the segment mask; across
  chunks a scan carrying S. A segment start inside a chunk is exact: a token reads the carried
  state only if its segment continues from before the chunk, and only the chunk's last segment
  writes the state it passes on.
- :func:`recurrent_rule` (decode): token by token, the state zeroed where it does not carry.

Both compute in float32, as transformers does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.config.model import ModelConfig
from seqjax.model.cache import RecurrentView
from seqjax.model.lora import Adapters
from seqjax.model.mask import allowed, conv_taps, state_carries
from seqjax.model.quant import weight

HIGHEST = jax.lax.Precision.HIGHEST
# the layer's projections, by transformers' (and PEFT's) names: model.lora.targets may adapt each
DELTANET_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


def causal_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """silu(depthwise causal convolution) of x [B, T, C] with ``weight`` [C, K] (tap K - 1 the
    token itself, as torch's ``conv1d`` weight [C, 1, K] holds it), no tap reaching across a
    segment start; in float32, returned in x's dtype."""
    width = weight.shape[-1]
    taps = conv_taps(segment_ids, width)
    w = weight.astype(jnp.float32)
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(width):
        back = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :x.shape[1]].astype(jnp.float32)
        out = out + jnp.where(taps[..., j, None], back, 0.0) * w[:, width - 1 - j]
    return jax.nn.silu(out).astype(x.dtype)


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
                 ends=None):
    """The gated delta rule in chunks of ``chunk`` tokens (shapes as :func:`recurrent_rule`; the
    row zero-padded to a multiple of it, the padding continuing the row's last segment with no
    decay and no write, so the state returned is the one after the row's last token). ``ends``
    [E, 2] (row, place) pairs: the state returned is instead the one after each of those tokens
    [E, H, Dk, Dv] (:func:`_states_at`: a packed prefill's prompts, each ending mid-row)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, t, h, dk = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk
    seg = jnp.concatenate([segment_ids, jnp.repeat(segment_ids[:, -1:], pad, axis=1)], axis=1)
    before = jnp.zeros((b,), seg.dtype) if before is None else before.astype(seg.dtype)
    before = jnp.concatenate([before[:, None], seg[:, chunk - 1:-1:chunk]], axis=1)  # [B, N]

    def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
        a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        a = a.reshape(b, n, chunk, *a.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 2, 3)

    q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
    seg, before = jnp.moveaxis(seg.reshape(b, n, chunk), 1, 0), before.T  # [N, B, C], [N, B]
    place = jnp.arange(chunk)
    same = allowed(seg[..., :, None], seg[..., None, :], place[:, None], place[None, :])[:, :, None]
    carries = allowed(seg, before[..., None], 1, 0)[:, :, None, :, None]  # [N, B, 1, C, 1]
    # (the chunk's last segment)
    last = allowed(seg[..., -1:], seg, chunk - 1, place)[:, :, None, :, None]
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=HIGHEST) * decay

    def solve(rhs):  # (I + strictly-lower(system))^-1 rhs
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    grown = jnp.exp(cum)[..., None]
    values = solve(v_beta)
    k_read = solve(jnp.where(carries, k_beta * grown, 0.0))
    q_read = jnp.where(carries, q * grown, 0.0)
    inner = jnp.einsum("...id,...jd->...ij", q, k, precision=HIGHEST) * decay
    to_end = jnp.exp(jnp.where(last, cum[..., -1:, None] - cum[..., None], 0.0))
    k_write = jnp.where(last, k * to_end, 0.0)
    keep = jnp.where(carries[..., -1, 0], jnp.exp(cum[..., -1]), 0.0)[..., None, None]  # [N, B, H, 1, 1]
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s, xs):
        values_i, k_read_i, q_read_i, inner_i, k_write_i, keep_i = xs
        new = values_i - jnp.einsum("bhcd,bhde->bhce", k_read_i, s, precision=HIGHEST)
        out = (jnp.einsum("bhcd,bhde->bhce", q_read_i, s, precision=HIGHEST)
               + jnp.einsum("bhij,bhje->bhie", inner_i, new, precision=HIGHEST))
        s_next = s * keep_i + jnp.einsum("bhcd,bhce->bhde", k_write_i, new, precision=HIGHEST)
        return s_next, (out, (s, new) if ends is not None else None)

    state, (out, kept) = jax.lax.scan(step, state, (values, k_read, q_read, inner, k_write, keep))
    out = jnp.moveaxis(jnp.moveaxis(out, 3, 2), 0, 1).reshape(b, n * chunk, h, -1)[:, :t]
    if ends is not None:
        state = _states_at(ends, *kept, k, cum, same, carries, chunk)
    return out.astype(dtype), state


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


def prompt_taps(segment_ids: jax.Array, prefix_ids: jax.Array, positions: jax.Array,
                width: int) -> tuple[jax.Array, jax.Array]:
    """A row with a shared prompt (``prefix_ids``: the prompt segment a completion continues): for each
    token and tap j of a ``width``-tap convolution, the row index of the input it reads [B, T, width]
    and whether it may [B, T, width]. A tap inside the token's own segment reads the token j places
    back; one reaching before a completion's start reads its prompt's token at position
    ``positions - j`` (the prompt's positions start at 0 where its segment starts, and a group's
    completions follow its prompt: the latest prompt start before a completion is its prompt's), so
    each completion's first tokens see its prompt's last ones, as in its own sequence."""
    b, t = segment_ids.shape
    index = jnp.arange(t)[None, :]
    previous = jnp.concatenate([jnp.zeros((b, 1), segment_ids.dtype), segment_ids[:, :-1]], axis=1)
    starts = segment_ids != previous
    start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    prompt = starts & (prefix_ids == 0) & (segment_ids != 0)
    prompt_start = jax.lax.cummax(jnp.where(prompt, index, -1), axis=1)
    its_prompt = jnp.take_along_axis(segment_ids, jnp.maximum(prompt_start, 0), axis=1) == prefix_ids
    j = jnp.arange(width)[None, None, :]
    own = j <= (index - start)[..., None]
    back = positions[..., None] - j
    from_prompt = ~own & (prefix_ids != 0)[..., None] & its_prompt[..., None] & (back >= 0)
    source = jnp.where(own, index[..., None] - j, prompt_start[..., None] + back)
    return jnp.clip(source, 0, t - 1), (own | from_prompt) & (segment_ids != 0)[..., None]


def gathered_conv(x: jax.Array, weight: jax.Array, source: jax.Array, valid: jax.Array) -> jax.Array:
    """:func:`causal_conv` with each tap's input read at ``source`` where ``valid`` (:func:`prompt_taps`)."""
    width = weight.shape[-1]
    w = weight.astype(jnp.float32)
    rows = jnp.arange(x.shape[0])[:, None]
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(width):
        back = x[rows, source[..., j]].astype(jnp.float32)
        out = out + jnp.where(valid[..., j, None], back, 0.0) * w[:, width - 1 - j]
    return jax.nn.silu(out).astype(x.dtype)


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


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's gated output norm: rmsnorm(x) (float32) times a plain ``weight``, in x's dtype,
    times silu(gate) in float32."""
    f = x.astype(jnp.float32)
    normed = (f * jax.lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return (weight * normed).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))


def gated_deltanet(params: dict, x: jax.Array, segment_ids: jax.Array, *, key_heads: int, value_heads: int,
                   eps: float, chunk: int = 64, carried: RecurrentView | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """The whole layer on x [B, T, D] (``params``: transformers' tensors by name, each linear
    as [in, out], ``conv1d`` [C, K], ``A_log``, ``dt_bias``, ``norm``): (out [B, T, D], the state
    after the row). ``carried``: the rows continue from a cache's view (:func:`continued`)."""
    out, view = continued(params, x, segment_ids, RecurrentView() if carried is None else carried,
                          key_heads=key_heads, value_heads=value_heads, eps=eps, chunk=chunk)
    return out, view.state


def continued(params: dict, x: jax.Array, segment_ids: jax.Array, view: RecurrentView, *, key_heads: int,
              value_heads: int, eps: float, chunk: int = 64, recurrent: bool = False,
              project=None, shared: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, RecurrentView]:
    """:func:`gated_deltanet` continuing each row from ``view`` (its convolution window and state, read
    where the row's first token continues the segment ``view.carry`` names; all None: fresh), in the
    chunked form or (``recurrent``: decoding) token by token; (out, the view after the row's last
    token: its last K - 1 convolution inputs, its state). ``project(name, h)``: h through the
    projection ``name`` of :data:`DELTANET_TARGETS` (default: h @ params[name]; the layer's adds its
    adapters). ``shared``: (prefix_ids, positions) of a row with a shared prompt, each completion
    continuing its prompt's convolution inputs and state (:func:`prompt_taps`, :func:`prompt_rule`)."""
    b, t, _ = x.shape
    dtype = x.dtype
    if project is None:
        def project(name, h):
            return h @ params[name].astype(dtype)
    x = jnp.where((segment_ids != 0)[..., None], x, 0).astype(dtype)  # (padding contributes nothing)
    dv = params["norm"].shape[0]
    width = params["conv1d"].shape[-1]
    ids_dtype = segment_ids.dtype
    before = jnp.zeros((b,), ids_dtype) if view.carry is None else view.carry.astype(ids_dtype)
    inputs = project("in_proj_qkv", x)
    dk = (inputs.shape[-1] - value_heads * dv) // (2 * key_heads)
    history = (jnp.zeros((b, width - 1, inputs.shape[-1]), dtype) if view.conv is None
               else view.conv.astype(dtype))
    # (the window's tokens belong to segment ``before``)
    extended = jnp.concatenate([history, inputs], axis=1)
    ids = jnp.concatenate([jnp.repeat(before[:, None], width - 1, axis=1), segment_ids], axis=1)
    if shared is None:
        qkv = causal_conv(extended, params["conv1d"], ids)[:, width - 1:]
    else:
        qkv = gathered_conv(inputs, params["conv1d"], *prompt_taps(segment_ids, *shared, width))
    q, k, v = jnp.split(qkv, [key_heads * dk, 2 * key_heads * dk], axis=-1)
    q, k = q.reshape(b, t, key_heads, dk), k.reshape(b, t, key_heads, dk)
    v = v.reshape(b, t, value_heads, dv)
    beta = jax.nn.sigmoid(project("in_proj_b", x))
    a = project("in_proj_a", x).astype(jnp.float32)
    g = -jnp.exp(params["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + params["dt_bias"].astype(jnp.float32))
    if shared is not None:
        o, state = prompt_rule(q, k, v, g, beta, segment_ids, shared[0])
    elif view.ends is not None:
        o, state = chunked_rule(q, k, v, g, beta, segment_ids, chunk=chunk, state=view.state,
                                before=before, ends=view.ends)
    else:
        rule = recurrent_rule if recurrent else functools.partial(chunked_rule, chunk=chunk)
        o, state = rule(q, k, v, g, beta, segment_ids, state=view.state, before=before)
    z = project("in_proj_z", x).reshape(b, t, value_heads, dv)
    o = gated_rms_norm(o, z, params["norm"].astype(dtype), eps).astype(dtype)
    out = project("out_proj", o.reshape(b, t, value_heads * dv))
    if view.ends is not None:
        return out, RecurrentView(_windows_at(view.ends, inputs, segment_ids, width), state, None)
    window = extended[:, -(width - 1):] if width > 1 else history
    return out, RecurrentView(window, state, None)


def _windows_at(ends: jax.Array, inputs: jax.Array, segment_ids: jax.Array,
                width: int) -> jax.Array:
    """The convolution window after each token ``ends`` [E, 2] (row, place) names: the last
    ``width`` - 1 inputs [E, width - 1, C] up to it, oldest first, zeros before its segment's start
    (a fresh row's window, as its document gets alone)."""
    row, place = ends[:, 0], ends[:, 1]
    back = place[:, None] - jnp.arange(width - 2, -1, -1)[None, :]  # [E, width - 1]
    at = jnp.clip(back, 0, inputs.shape[1] - 1)
    own = (back >= 0) & (segment_ids[row[:, None], at] == segment_ids[row, place][:, None])
    return jnp.where(own[..., None], inputs[row[:, None], at], 0).astype(inputs.dtype)


class DeltaNet(nnx.Module):
    """A Gated DeltaNet layer as a block's token mixer (``model.layer_types`` ``linear``; the
    block's attention otherwise), its parameters named as transformers names them:

    ================  =====================  ==============================
    in_proj_qkv       [D, 2 Hk Dk + H Dv]    the query, key and value heads
    in_proj_z         [D, H Dv]              the output gate
    in_proj_b, _a     [D, H]                 beta's and the decay's inputs
    conv1d            [2 Hk Dk + H Dv, K]    the depthwise causal convolution
    A_log, dt_bias    [H]                    the decay's rate and bias
    norm              [Dv]                   the gated output norm's plain weight
    out_proj          [H Dv, D]
    ================  =====================  ==============================
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        net, d, pdt = cfg.deltanet, cfg.d_model, jnp.dtype(cfg.param_dtype)
        qkv, value = net.qkv_width, net.value_width

        def normal(shape, axes, std=cfg.init_std):
            return nnx.Param(std * jax.random.normal(rngs.params(), shape, pdt), axes=axes)

        self.in_proj_qkv = normal((d, qkv), ("embed", "linear_qkv"))
        self.in_proj_z = normal((d, value), ("embed", "linear_value"))
        self.in_proj_b = normal((d, net.value_heads), ("embed", "linear_heads"))
        self.in_proj_a = normal((d, net.value_heads), ("embed", "linear_heads"))
        self.conv1d = normal((qkv, net.conv_width), ("linear_qkv", "conv"), 1 / math.sqrt(net.conv_width))
        rates = jnp.linspace(1.0, 16.0, net.value_heads)  # (transformers draws them from U(0.01, 16))
        self.A_log = nnx.Param(jnp.log(rates).astype(pdt), axes=("linear_heads",))
        self.dt_bias = nnx.Param(jnp.ones((net.value_heads,), pdt), axes=("linear_heads",))
        self.norm = nnx.Param(jnp.ones((net.value_dim,), pdt), axes=("head_dim",))
        self.out_proj = normal((value, d), ("linear_value", "embed"), cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.net, self.eps = net, cfg.norm_eps
        self.lora = Adapters(cfg, {name: (getattr(self, name), 1) for name in DELTANET_TARGETS}, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, rope_freq=None, window=None,
                 metadata=None, dropout_key: jax.Array | None = None, prefix_ids: jax.Array | None = None):
        """x [B, T, D] -> [B, T, D], the state reset at every segment start (the attention's
        arguments it has no use for are taken and left: RoPE, windows). With ``prefix_ids`` (a shared
        prompt) each completion starts from its prompt's state and convolution inputs, found by
        ``positions``."""
        net = self.net
        shared = None if prefix_ids is None else (prefix_ids, positions)
        out, _ = continued(self._params(), x, segment_ids, RecurrentView(), key_heads=net.key_heads,
                           value_heads=net.value_heads, eps=self.eps, chunk=net.chunk,
                           project=self._projector(x.dtype, self.lora.key(dropout_key)), shared=shared)
        return out

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: RecurrentView,
               rope_freq=None, window=None) -> tuple[jax.Array, RecurrentView]:
        """x [B, T, D] continuing each row from its cache view (seqjax.model.cache.RecurrentView:
        a prefill's fresh rows in the chunked form, a decode step's single tokens in the recurrent
        one); (out, the view after the call, its ``carry`` kept)."""
        net = self.net
        out, view = continued(self._params(), x, segment_ids, cache, key_heads=net.key_heads,
                              value_heads=net.value_heads, eps=self.eps, chunk=net.chunk,
                              recurrent=x.shape[1] == 1, project=self._projector(x.dtype))
        return out, dataclasses.replace(view, carry=cache.carry)

    def _params(self) -> dict:
        """The layer's arrays but its projections (those go through :meth:`_projector`, each
        dequantized once under QLoRA)."""
        return {name: getattr(self, name)[...] for name in ("conv1d", "A_log", "dt_bias", "norm")}

    def _projector(self, dtype, key: jax.Array | None = None):
        """``project(name, h)`` for :func:`continued`: h through the projection with its adapter
        (``model.lora.targets`` naming it)."""
        def project(name: str, h: jax.Array) -> jax.Array:
            w = weight(getattr(self, name), dtype)
            return self.lora.apply(name, h, h @ w, w, key)

        return project
