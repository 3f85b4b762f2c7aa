"""The mixture-of-experts layer (``model.experts``): a router picks ``top_k`` experts for each
token, every token reaches them (no capacity, nothing dropped), and each expert is a gated MLP of
its own.

Parameters (E experts, D d_model, F the experts' d_ff), each with its logical axes:

====================  ============  =========================  ================================================
path                  shape         axes                       what
====================  ============  =========================  ================================================
mlp.router            [D, E]        (embed, experts)           the router's logits x @ router (+ router_bias [E])
mlp.w_gate, w_up      [E, D, F]     (experts, embed, ff)       each expert's gate and up projections
mlp.w_down            [E, F, D]     (experts, ff, embed)       each expert's down projection
mlp.b_gate, b_up      [E, F]        (experts, ff)              with ``model.experts.bias`` (gpt-oss)
mlp.b_down            [E, D]        (experts, embed)
====================  ============  =========================  ================================================

Three tables make a family's layer: :data:`ROUTERS` (the top k and its weights), :data:`ACTIVATIONS`
(an expert's gated activation) and :data:`DISPATCH` (how tokens reach their experts: sorted by
expert and run as one grouped matmul, ``jax.lax.ragged_dot``, or every expert on every token, the
reference).

Packing: a token's route, its experts' outputs and its share of the router's losses depend on
that token alone, so a packed row routes each document as it would be alone. The side terms
(:class:`RouterTerms`) count real tokens only (segment id > 0): padding never enters the
load-balancing loss or the router's statistics."""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from seqjax.config.model import ModelConfig
from seqjax.core.progress import log_once
from seqjax.model.lora import ExpertAdapters
from seqjax.model.quant import weight
from seqjax.model.sharding import EXPERT_AXIS

log = logging.getLogger(__name__)


class RouterTerms(NamedTuple):
    """One layer's router statistics over a batch's real tokens, as sums: ``counts`` [E] the
    tokens routed to each expert (a token counts once for each of its k experts), ``probs`` [E]
    the router's full softmax summed, ``tokens`` the real tokens, ``z`` the sum of
    logsumexp(logits)^2. The load-balancing loss pools them over layers
    (:func:`load_balancing_loss`)."""

    counts: jax.Array
    probs: jax.Array
    tokens: jax.Array
    z: jax.Array

    @staticmethod
    def zeros(experts: int) -> "RouterTerms":
        zero = jnp.zeros((), jnp.float32)
        return RouterTerms(jnp.zeros((experts,), jnp.float32), jnp.zeros((experts,), jnp.float32), zero, zero)


def load_balancing_loss(terms: RouterTerms, top_k: int, pooled: RouterTerms | None = None) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` with its attention mask, from per-layer sums [L,
    E]: the share of (token, choice) pairs each expert got times its mean router probability, pooled
    over every layer and real token before the product, times the expert count: ``E * sum_e
    (counts_e / N) * (probs_e / N)``, N = layers x real tokens (each token's k choices all count).

    ``pooled``: the routes of a larger batch ``terms`` is part of (a step's micro-batches,
    summed): the counts and N are its, the probabilities ``terms``' own, so the parts' losses add
    up to the whole's, value and gradient (the counts carry none)."""
    pooled = terms if pooled is None else pooled
    experts = terms.counts.shape[-1]
    tokens = jnp.maximum(jnp.sum(pooled.tokens), 1.0)
    counts = jnp.sum(pooled.counts.reshape(-1, experts), 0)
    probs = jnp.sum(terms.probs.reshape(-1, experts), 0)
    return experts * jnp.sum((counts / tokens) * (probs / tokens))


def router_z_loss(terms: RouterTerms, pooled: RouterTerms | None = None) -> jax.Array:
    """The mean over layers and real tokens of logsumexp(router logits)^2 (ST-MoE's router z-loss);
    ``pooled`` as :func:`load_balancing_loss`'s (its token count the denominator)."""
    pooled = terms if pooled is None else pooled
    return jnp.sum(terms.z) / jnp.maximum(jnp.sum(pooled.tokens), 1.0)


# -- routers: (logits float32 [N, E], k, cfg) -> (weights [N, k] float32, experts [N, k] int32)


def _softmax_topk(logits: jax.Array, k: int, cfg) -> tuple[jax.Array, jax.Array]:
    weights, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, chosen


def _topk_softmax(logits: jax.Array, k: int, cfg) -> tuple[jax.Array, jax.Array]:
    values, chosen = jax.lax.top_k(logits, k)
    return jax.nn.softmax(values, axis=-1), chosen


ROUTERS: dict[str, Callable] = {"softmax_topk": _softmax_topk, "topk_softmax": _topk_softmax}


# -- the experts' gated activations: (gate, up) -> hidden


def _swiglu(gate: jax.Array, up: jax.Array, cfg=None) -> jax.Array:
    return jax.nn.silu(gate) * up


def _clamped_swiglu(gate: jax.Array, up: jax.Array, cfg=None) -> jax.Array:
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * gate * jax.nn.sigmoid(cfg.swiglu_alpha * gate)


ACTIVATIONS: dict[str, Callable] = {"swiglu": _swiglu, "clamped_swiglu": _clamped_swiglu}


# -- dispatch: (x [N, D], chosen [N, k], expert weights, activation, the adapters' scale) -> each
# (token, choice)'s output [N, k, D]. ``w`` holds w_gate, w_up, w_down (and b_* with biases), and an
# adapted layer's stacked factors experts_gate_up_a/_b, experts_down_a/_b
# (seqjax.model.lora.ExpertAdapters). A pair whose ``chosen`` is E (one past the last expert:
# another device's, under mesh.expert) is in no group: ragged_dot's grouped kernel never computes
# it, and the caller masks its output.


def _expert_mlp(rows: jax.Array, w: dict, act: Callable, scale: float, matmul: Callable, bias: Callable):
    """One (token, choice) row per expert row through its expert's gated MLP with its adapters:
    ``matmul(h, weight)`` the expert's projection of each row (float32), ``bias(name)`` each
    row's expert's bias."""
    def project(h, name):
        out = matmul(h, w[name])
        b = bias(name.replace("w_", "b_"))
        return out if b is None else out + b.astype(jnp.float32)

    def low_rank(h, target):
        if f"{target}_a" not in w:
            return None
        return scale * matmul(matmul(h, w[f"{target}_a"]).astype(h.dtype), w[f"{target}_b"])

    gate, up = project(rows, "w_gate"), project(rows, "w_up")
    adapted = low_rank(rows, "experts_gate_up")
    if adapted is not None:  # (gate's columns, then up's)
        gate, up = gate + adapted[:, :gate.shape[1]], up + adapted[:, gate.shape[1]:]
    hidden = act(gate.astype(rows.dtype), up.astype(rows.dtype))
    out = project(hidden, "w_down")
    adapted = low_rank(hidden, "experts_down")
    return (out if adapted is None else out + adapted).astype(rows.dtype)


def _ragged(x: jax.Array, chosen: jax.Array, w: dict, act: Callable, scale: float = 0.0) -> jax.Array:
    """Every (token, choice) pair sorted by expert, the experts run as grouped matmuls over the
    sorted rows (``jax.lax.ragged_dot``), and the rows put back in place."""
    n, k = chosen.shape
    experts = w["w_gate"].shape[0]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    expert = flat[order]
    out = _expert_mlp(
        x[order // k], w, act, scale,
        lambda h, weight: jax.lax.ragged_dot(h, weight.astype(h.dtype), sizes, preferred_element_type=jnp.float32),
        lambda name: None if name not in w else w[name][jnp.minimum(expert, experts - 1)])
    return jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)


def _dense(x: jax.Array, chosen: jax.Array, w: dict, act: Callable, scale: float = 0.0) -> jax.Array:
    """Every expert on every token, each (token, choice) taking its expert's output: the
    reference form."""
    def run(e):
        weights = {name: value[e] for name, value in w.items()}
        return _expert_mlp(
            x, weights, act, scale,
            lambda h, weight: jnp.matmul(h, weight.astype(h.dtype), preferred_element_type=jnp.float32),
            lambda name: weights.get(name))

    everyone = jax.vmap(run)(jnp.arange(w["w_gate"].shape[0]))  # [E, N, D]
    return jnp.take_along_axis(everyone.transpose(1, 0, 2), chosen[..., None], axis=1)


BLOCK = 64  # rows a block of the blocked dispatch holds


def _blocked(x: jax.Array, chosen: jax.Array, w: dict, act: Callable, scale: float = 0.0) -> jax.Array:
    """The (token, choice) pairs sorted by expert, each expert's group padded to whole blocks of
    :data:`BLOCK` rows, and every block run through its one expert as a batched matmul over
    blocks (each block's weights gathered): the sorted grouped matmul's work (plus at most a
    block of padding an expert) without a ragged kernel. A pair of no group is left out (zeros)."""
    n, k = chosen.shape
    experts = w["w_gate"].shape[0]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = jnp.minimum(flat[order], experts - 1)
    sizes = jnp.bincount(flat, length=experts)
    padded = (sizes + BLOCK - 1) // BLOCK * BLOCK
    ends = jnp.cumsum(padded)
    blocks = -(-n * k // BLOCK) + experts  # (a static bound: each expert pads less than a block)
    place = ends[expert] - padded[expert] + jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[expert]
    place = jnp.where(flat[order] < experts, place, blocks * BLOCK)  # (no group: past the last row, dropped)
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * BLOCK, side="right"), experts - 1)
    rows = jnp.zeros((blocks * BLOCK, x.shape[1]), x.dtype).at[place].set(x[order // k], mode="drop")
    per_row = jnp.repeat(owner, BLOCK)

    def matmul(h, weight):
        h = h.reshape(blocks, BLOCK, -1)
        out = jnp.einsum("bri,bio->bro", h, weight.astype(h.dtype)[owner], preferred_element_type=jnp.float32)
        return out.reshape(blocks * BLOCK, -1)

    out = _expert_mlp(rows, w, act, scale, matmul, lambda name: None if name not in w else w[name][per_row])
    back = jnp.take(out, place, axis=0, mode="fill", fill_value=0)
    return back[jnp.argsort(order)].reshape(n, k, -1)


DISPATCH: dict[str, Callable] = {"ragged_dot": _ragged, "blocked": _blocked, "dense": _dense}


@jax.custom_vjp
def _gather_tokens(x: jax.Array) -> jax.Array:
    """x's rows from every device of the expert axis (an all-gather in x's dtype), whose backward adds the
    devices' cotangents in float32 (a reduce-scatter): a bfloat16 sum over the axis would round n partial
    gradients, and XLA's CPU compiler fails on a bfloat16 reduce-scatter inside this program."""
    return jax.lax.all_gather(x, EXPERT_AXIS, axis=0, tiled=True)


def _gather_forward(x):
    return _gather_tokens(x), None


def _gather_backward(_, g):
    total = jax.lax.psum_scatter(g.astype(jnp.float32), EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return (total.astype(g.dtype),)


_gather_tokens.defvjp(_gather_forward, _gather_backward)


def expert_parallel(mesh, x: jax.Array, chosen: jax.Array, weights: jax.Array, params: dict, act: Callable,
                    dispatch: Callable, scale: float = 0.0) -> jax.Array:
    """The experts' weighted sum of x [N, D] with the experts split over ``mesh.expert`` (n
    devices, E / n experts each) and the tokens too: each device gathers its expert group's
    tokens (an all-gather over the axis), runs its own experts on the (token, choice) pairs
    routed to them (the others are in no group of its dispatch: a grouped kernel skips them), and
    the partial sums go back to the devices that hold the tokens (a reduce-scatter). Exact: a
    pair's output is its expert's wherever that expert lives, and each token's k contributions
    add up once."""
    def local(x, chosen, weights, w):
        gather = functools.partial(jax.lax.all_gather, axis_name=EXPERT_AXIS, axis=0, tiled=True)
        x, chosen, weights = _gather_tokens(x), gather(chosen), _gather_tokens(weights)
        own = w["w_gate"].shape[0]
        first = jax.lax.axis_index(EXPERT_AXIS) * own
        mine = (chosen >= first) & (chosen < first + own)
        outputs = dispatch(x, jnp.where(mine, chosen - first, own), w, act, scale)
        outputs = jnp.where(mine[..., None], outputs.astype(jnp.float32), 0.0)
        partial = jnp.einsum("nk,nkd->nd", jnp.where(mine, weights, 0.0), outputs)
        return jax.lax.psum_scatter(partial, EXPERT_AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)

    spec = P(EXPERT_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, jax.tree.map(lambda _: spec, params)),
                         out_specs=spec, axis_names={EXPERT_AXIS}, check_vma=False)(x, chosen, weights, params)


def resolve_dispatch(dispatch: str) -> str:
    """``model.experts.dispatch``: ``auto`` is ``blocked`` on the CPU, where XLA's ragged_dot is
    a dense fallback and the blocked form measured 6-16x faster (BENCHMARKS.md, "Mixture of
    experts"), and the grouped matmul (``jax.lax.ragged_dot``) on a GPU or TPU, where XLA lowers
    it to a grouped kernel (on a GPU not yet measured against blocked: the GPU suite's ``moe``
    stage does). Said once, as the attention's auto says its pick."""
    if dispatch != "auto":
        return dispatch
    picked = "blocked" if jax.default_backend() == "cpu" else "ragged_dot"
    log_once(log, logging.INFO, "experts auto: using %s on platform %s", picked, jax.default_backend())
    return picked


def _param(rngs: nnx.Rngs, shape, std: float, dtype, axes) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), axes=axes)


class Settings(NamedTuple):
    """What a layer's routing and experts compute (``model.experts``' keys of those names)."""

    count: int
    top_k: int
    router: str
    norm_topk_prob: bool
    bias: bool
    activation: str
    swiglu_limit: float
    swiglu_alpha: float


class Experts(nnx.Module):
    """``model.experts``: the router and its E gated experts (the module's docstring has the
    parameters)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        ex = cfg.experts
        e, d, f = ex.count, cfg.d_model, ex.d_ff or cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.router = _param(rngs, (d, e), cfg.init_std, pdt, ("embed", "experts"))
        self.w_gate = _param(rngs, (e, d, f), cfg.init_std, pdt, ("experts", "embed", "ff"))
        self.w_up = _param(rngs, (e, d, f), cfg.init_std, pdt, ("experts", "embed", "ff"))
        self.w_down = _param(rngs, (e, f, d), out_std, pdt, ("experts", "ff", "embed"))
        self.lora = ExpertAdapters(cfg, e, d, f, rngs=rngs)
        if ex.bias:
            self.router_bias = nnx.Param(jnp.zeros((e,), pdt), axes=("experts",))
            self.b_gate = nnx.Param(jnp.zeros((e, f), pdt), axes=("experts", "ff"))
            self.b_up = nnx.Param(jnp.zeros((e, f), pdt), axes=("experts", "ff"))
            self.b_down = nnx.Param(jnp.zeros((e, d), pdt), axes=("experts", "embed"))
        # (static graph data: hashable, so the model's graph definition keys jit's caches)
        self.cfg = Settings(ex.count, ex.top_k, ex.router, ex.norm_topk_prob, ex.bias, ex.activation,
                            ex.swiglu_limit, ex.swiglu_alpha)
        self.dispatch = resolve_dispatch(ex.dispatch)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router logits [N, E] float32, each token's expert weights [N, k], its experts [N, k])
        of x [N, D]."""
        logits = jnp.matmul(x, weight(self.router, x.dtype), preferred_element_type=jnp.float32)
        if self.cfg.bias:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        weights, chosen = ROUTERS[self.cfg.router](logits, self.cfg.top_k, self.cfg)
        return logits, weights, chosen

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 dropout_key: jax.Array | None = None) -> tuple[jax.Array, RouterTerms]:
        """x [B, T, D] -> (the experts' weighted sum [B, T, D], this layer's :class:`RouterTerms`
        over the real tokens, segment id > 0; every token real without ``segment_ids``)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        logits, weights, chosen = self.route(flat)
        dt = x.dtype
        params = {name: weight(getattr(self, name), dt) for name in ("w_gate", "w_up", "w_down")}
        if self.cfg.bias:
            params |= {name: getattr(self, name)[...] for name in ("b_gate", "b_up", "b_down")}
        factors = self.lora.factors()
        scale = factors.pop("scale", 0.0)
        params |= factors
        act = functools.partial(ACTIVATIONS[self.cfg.activation], cfg=self.cfg)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty and segment_ids is not None:  # (a jit given shardings, no mesh context: the batch's mesh)
            mesh = jax.typeof(segment_ids).sharding.mesh
        if not mesh.empty and mesh.shape.get(EXPERT_AXIS, 1) > 1 and EXPERT_AXIS not in mesh.manual_axes:
            y = expert_parallel(mesh, flat, chosen, weights, params, act, DISPATCH[self.dispatch], scale)
        else:
            outputs = DISPATCH[self.dispatch](flat, chosen, params, act, scale)
            y = jnp.einsum("nk,nkd->nd", weights, outputs.astype(jnp.float32)).astype(dt)
        real = jnp.ones((b * t,), jnp.float32) if segment_ids is None else (segment_ids.reshape(-1) > 0).astype(
            jnp.float32)
        return y.reshape(b, t, d), self.terms(logits, real)

    def terms(self, logits: jax.Array, real: jax.Array) -> RouterTerms:
        """This layer's router sums over the real tokens (``real`` [N] 1 or 0): transformers'
        load-balancing loss takes the top k of the full softmax whatever the family routes by
        (the same experts: a softmax keeps the logits' order)."""
        probs = jax.nn.softmax(logits, axis=-1)
        _, chosen = jax.lax.top_k(probs, self.cfg.top_k)
        hits = jnp.sum(jax.nn.one_hot(chosen, self.cfg.count, dtype=jnp.float32), axis=1)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return RouterTerms(jax.lax.stop_gradient(jnp.sum(hits * real[:, None], axis=0)),
                           jnp.sum(probs * real[:, None], axis=0), jnp.sum(real), jnp.sum(lse * lse * real))
