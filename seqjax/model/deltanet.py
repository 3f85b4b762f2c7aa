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

The rule itself, its chunked and token-by-token forms and the shared prompt's entry state, is
:mod:`seqjax.model.delta_rule`.
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
from seqjax.model.delta_rule import chunked_prompt_rule, chunked_rule, recurrent_rule
from seqjax.model.lora import Adapters
from seqjax.model.mask import conv_taps, run_starts
from seqjax.model.quant import weight

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


def prompt_taps(segment_ids: jax.Array, prefix_ids: jax.Array, positions: jax.Array,
                width: int) -> tuple[jax.Array, jax.Array]:
    """A row with a shared prompt (``prefix_ids``: the prompt segment a completion continues): for each
    token and tap j of a ``width``-tap convolution, the row index of the input it reads [B, T, width]
    and whether it may [B, T, width]. A tap inside the token's own segment reads the token j places
    back; one reaching before a completion's start reads its prompt's token at position
    ``positions - j`` (the prompt's positions start at 0 where its segment starts, and a group's
    completions follow its prompt: the latest prompt start before a completion is its prompt's), so
    each completion's first tokens see its prompt's last ones, as in its own sequence."""
    t = segment_ids.shape[1]
    index = jnp.arange(t)[None, :]
    start = run_starts(segment_ids)
    prompt = (start == index) & (prefix_ids == 0) & (segment_ids != 0)
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
              project=None, shared: tuple[jax.Array, jax.Array] | None = None,
              kernel: str = "xla") -> tuple[jax.Array, RecurrentView]:
    """:func:`gated_deltanet` continuing each row from ``view`` (its convolution window and state, read
    where the row's first token continues the segment ``view.carry`` names; all None: fresh), in the
    chunked form or (``recurrent``: decoding) token by token; (out, the view after the row's last
    token: its last K - 1 convolution inputs, its state). ``project(name, h)``: h through the
    projection ``name`` of :data:`DELTANET_TARGETS` (default: h @ params[name]; the layer's adds its
    adapters). ``shared``: (prefix_ids, positions) of a row with a shared prompt, each completion
    continuing its prompt's convolution inputs and state (:func:`prompt_taps`,
    :func:`chunked_prompt_rule`). ``kernel``: the chunked form's scan
    (:func:`seqjax.model.delta_rule.chunked_rule`'s)."""
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
        o, state = chunked_prompt_rule(q, k, v, g, beta, segment_ids, shared[0], chunk=chunk)
    elif view.ends is not None:
        o, state = chunked_rule(q, k, v, g, beta, segment_ids, chunk=chunk, state=view.state,
                                before=before, ends=view.ends, kernel=kernel)
    else:
        chunked = functools.partial(chunked_rule, chunk=chunk, kernel=kernel)
        rule = recurrent_rule if recurrent else chunked
        o, state = rule(q, k, v, g, beta, segment_ids, state=view.state, before=before)
    z = project("in_proj_z", x).reshape(b, t, value_heads, dv)
    o = gated_rms_norm(o, z, params["norm"].astype(dtype), eps).astype(dtype)
    out = project("out_proj", o.reshape(b, t, value_heads * dv))
    if view.ends is not None:
        return out, RecurrentView(_windows_at(view.ends, extended, ids, width), state, None)
    window = extended[:, -(width - 1):] if width > 1 else history
    return out, RecurrentView(window, state, None)


def _windows_at(ends: jax.Array, inputs: jax.Array, segment_ids: jax.Array,
                width: int) -> jax.Array:
    """The convolution window after each token ``ends`` [E, 2] (row, place) names: the last
    ``width`` - 1 inputs [E, width - 1, C] up to it, oldest first, zeros before its segment's start
    (a fresh row's window, as its document gets alone). ``inputs`` and ``segment_ids`` lead with
    the row's window before the call (``width`` - 1 places, the segment it continues: a later
    piece of a prompt reaches into it; a fresh row's, segment 0, never)."""
    row, place = ends[:, 0], ends[:, 1] + width - 1
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
                           project=self._projector(x.dtype, self.lora.key(dropout_key)),
                           shared=shared, kernel=net.scan)
        return out

    def decode(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: RecurrentView,
               rope_freq=None, window=None) -> tuple[jax.Array, RecurrentView]:
        """x [B, T, D] continuing each row from its cache view (seqjax.model.cache.RecurrentView:
        a prefill's fresh rows in the chunked form, a decode step's single tokens in the recurrent
        one); (out, the view after the call, its ``carry`` kept)."""
        net = self.net
        out, view = continued(self._params(), x, segment_ids, cache, key_heads=net.key_heads,
                              value_heads=net.value_heads, eps=self.eps, chunk=net.chunk,
                              recurrent=x.shape[1] == 1, project=self._projector(x.dtype),
                              kernel=net.scan)
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
