"""What an objective is: a row of the objectives table, the inputs its loss reads, the sums it
returns.

An objective's ``loss(inputs, micro)`` sees one micro-batch (a :class:`~seqjax.data.contract.Batch`)
and returns :class:`Terms`: sums, never means. The train step adds each micro-batch's sums and
divides once by the summed ``denominator`` (docs/design.md, contract 3), so k micro-batches give the
update of one big batch whatever the objective: tokens for the language-model loss, pairs for a
preference loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from seqjax.data.contract import Batch, model_fields
from seqjax.model.context import row_spans
from seqjax.model.experts import load_balancing_loss, router_z_loss
from seqjax.model.head import head_logits
from seqjax.model.loss import chunked_token_logprobs, segment_sums, token_logprobs, token_stats


class Terms(NamedTuple):
    """One micro-batch's contribution, each a float32 sum the step adds over micro-batches.

    ``value``: the objective's numerator (what is differentiated); ``denominator``: what the summed
    value is divided by; ``loss``: the numerator of the logged ``loss`` (``value`` without
    regularizers such as z-loss); ``reported``: metric name -> (sum, count), logged as sum / count
    in metrics.jsonl and the trackers; the names are the objective's ``reports``, in every
    micro-batch.
    """

    value: jax.Array
    denominator: jax.Array
    loss: jax.Array
    reported: dict[str, tuple[jax.Array, jax.Array]] = {}


@dataclasses.dataclass
class Inputs:
    """What an objective's loss reads besides the micro-batch.

    ``model``: the policy, merged (adapters and base); ``key``: the micro-batch's dropout key (None:
    no dropout); ``settings``: the ``train.*`` values the objective names; ``totals``: every
    objective's denominator over the global batch, computed once before the micro-batches (a
    weighted sum of objectives needs them); ``reference``: a function of a micro-batch giving the
    reference model's per-token log-probabilities, for the objectives that compare against one (None
    otherwise); ``policy_is_reference``: a boolean scalar, true when the reference's weights are the
    policy's (:meth:`reference_logprobs`).
    """

    model: Any
    key: jax.Array | None
    settings: Mapping[str, Any]
    totals: Mapping[str, jax.Array]
    reference: Callable[[Batch], jax.Array] | None = None
    policy_is_reference: jax.Array | bool = False
    micro_batches: int = 1  # (how many the step cuts its batch into: a per-micro-batch side term's share)
    _forward: tuple | None = dataclasses.field(default=None, repr=False)

    def forward(self, micro: Batch):
        """The policy's one forward pass of ``micro`` (:func:`model_outputs`: outputs, head, side
        terms), run once however many parts of a weighted objective read it."""
        if self._forward is None or self._forward[0] is not micro:
            self._forward = (micro, model_outputs(self.model, micro, self.key))
        return self._forward[1]

    def logprobs(self, micro: Batch, scored: jax.Array, stats: bool = False):
        """The policy's log p(targets) [B, T] of ``micro`` from its one forward
        (:func:`target_logprobs`)."""
        outputs, head, _ = self.forward(micro)
        return logprobs_of(self.model, outputs, head, micro, scored, stats)

    @property
    def side_terms(self) -> Any:
        """The side terms of the forward the objective ran (the routers' statistics), or None."""
        return None if self._forward is None else self._forward[1][2]

    def reference_logprobs(self, micro: Batch, policy: jax.Array) -> jax.Array:
        """The reference's per-token log-probabilities of ``micro``, given the policy's
        (``policy``).

        When the reference's weights are the policy's (LoRA's base with every B still 0, a frozen
        copy not yet moved from), they are the policy's own, bit for bit. Computed apart they would
        not be: XLA fuses a forward pass differently when its backward pass needs its activations,
        and the two sums then differ by an ulp or two, enough to make TRL's ``rewards/accuracies``
        count float32 noise at step 1 (TRL, in eager PyTorch, logs 0 there).
        """
        theirs = self.reference(micro)
        if self.policy_is_reference is False:
            return theirs
        return jnp.where(self.policy_is_reference, jax.lax.stop_gradient(policy), theirs)


@dataclasses.dataclass(frozen=True)
class Objective:
    """One ``train.objective``: its loss, what it divides by, and what it needs.

    ``reads``: the batch fields beyond the contract's five that it needs (a data format that lacks
    them is refused before any work); ``settings``: the ``train.*`` keys it reads; ``reference``: it
    compares the policy with a reference model (the base under LoRA, a frozen copy, or
    log-probabilities computed beforehand).
    """

    name: str
    loss: Callable[[Inputs, Batch], Terms]
    denominator: Callable[[Batch], jax.Array]
    reads: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    reference: bool = False
    doc: str = ""
    reports: tuple[str, ...] = ()  # the names of Terms.reported, every micro-batch the same
    parts: tuple["Objective", ...] = ()  # a weighted sum's objectives
    # reported names that are a smallest or largest value ("min" or "max"), not a sum: (value,
    # count)
    extremes: tuple[tuple[str, str], ...] = ()
    # an RL loss type's needs of its rollouts (seqjax.objectives.rl.LossType: its advantages, where
    # its KL goes), None for the others
    rl: Any = None
    # (model, micro-batch, dropout key) -> statistics of the policy's forward that the step sums
    # over its micro-batches before any of them trains (forward only, no gradient), given to the
    # loss as totals[STEP_FORWARD] when the step cuts its batch in more than one; None: none needed
    step_forward: Callable[[Any, Batch, Any], Any] | None = None

    def zero_terms(self) -> Terms:
        """Terms of zeros, shaped as this objective's: where the step's sums over micro-batches
        start (an extreme starts at the infinity any value replaces)."""
        zero = jnp.zeros((), jnp.float32)
        start = {name: jnp.asarray(jnp.inf if kind == "min" else -jnp.inf, jnp.float32)
                 for name, kind in self.extremes}
        return Terms(zero, zero, zero, {name: (start.get(name, zero), zero) for name in self.reports})

    def combine(self, a: Terms, b: Terms) -> Terms:
        """Two micro-batches' terms as one: sums added, extremes kept (their counts added)."""
        kinds = dict(self.extremes)
        reported = {}
        for name, (value, count) in a.reported.items():
            other, more = b.reported[name]
            kind = kinds.get(name)
            joined = value + other if kind is None else (jnp.minimum if kind == "min" else jnp.maximum)(value, other)
            reported[name] = (joined, count + more)
        return Terms(a.value + b.value, a.denominator + b.denominator, a.loss + b.loss, reported)

    def reported_values(self, reported: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
        """Each reported metric's value: a sum over its count (0 for none), an extreme as it is
        (NaN for none, as TRL's nanmin of nothing)."""
        kinds = dict(self.extremes)
        return {name: (safe_divide(total, count) if name not in kinds
                       else jnp.where(count > 0, total, jnp.nan)) for name, (total, count) in reported.items()}

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        """This objective's denominator over the global batch, and each part's:
        ``Inputs.totals``."""
        return {row.name: row.denominator(batch) for row in (self, *self.parts)}


STEP_FORWARD = "step_forward"  # (the key of Inputs.totals holding Objective.step_forward's sums)


def forward(model, micro: Batch, key: jax.Array | None):
    """The policy's forward of ``micro``: :meth:`seqjax.model.transformer.TransformerLM.forward`'s
    (features, head, side terms), under dropout ``key``."""
    args = {"positions": micro["positions"], "segment_ids": micro["segment_ids"], "dropout_key": key,
            **model_fields(micro)}
    return model.forward(micro["inputs"], **args)


def model_outputs(model, micro: Batch, key: jax.Array | None):
    """The forward pass an objective starts from: ``(features [B, T, D], head [D, V], side
    terms)`` when the model takes its loss a chunk at a time (``model.loss_chunk_tokens``), else
    ``(logits [B, T, V], None, side terms)``; the side terms are :func:`forward`'s."""
    features, head, terms = forward(model, micro, key)
    if model.cfg.loss_chunk_tokens:
        return features, head, terms
    return head_logits(features, head), None, terms


def logprobs_of(model, outputs: jax.Array, head: jax.Array | None, micro: Batch, scored: jax.Array,
                stats: bool = False):
    """log p(targets) [B, T] from :func:`model_outputs`' outputs and head (see
    :func:`target_logprobs`)."""
    if head is None:
        logp = token_logprobs(outputs, micro["targets"], scored)
        return (logp, token_stats(outputs, micro["targets"], scored)) if stats else logp
    return chunked_token_logprobs(outputs, head, micro["targets"], scored,
                                  chunk_tokens=model.cfg.loss_chunk_tokens, stats=stats,
                                  spans=row_spans(outputs))


def target_logprobs(model, micro: Batch, key: jax.Array | None, scored: jax.Array, stats: bool = False):
    """log p(targets) [B, T] float32 under ``model``, 0 where ``scored`` is False; the chunked path
    never builds the whole logits. ``stats``: ``(logp, token_stats)``, TRL's per-token metrics from
    the same logits (:func:`seqjax.model.loss.token_stats`)."""
    outputs, head, _ = model_outputs(model, micro, key)
    return logprobs_of(model, outputs, head, micro, scored, stats)


def safe_divide(total: jax.Array, count: jax.Array) -> jax.Array:
    """total / count, 0 where count is 0 (an empty batch reports 0, not NaN)."""
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def pair_sums(values: jax.Array, micro: Batch) -> tuple[jax.Array, jax.Array]:
    """Per-pair sums of ``values`` [B, T] over the scored targets: (chosen [B, P], rejected [B, P])
    with P = T // 2 pair slots per row (a pair takes at least two tokens).

    A pair whose two sequences score the same targets at the same positions (an equal pair, which
    TRL trains as it is) ties exactly: its rejected sum is its chosen one. Its two sequences sit
    at different places of a row, where attention's float32 reductions may round a token's
    log-probability apart by an ulp (a shared prompt's key gap, a kernel's tiles), and the
    margin's sign would then decide whether the pair counts as won; TRL, which runs each in a row
    of its own, gives them equal sums, a margin of 0 and no gradient."""
    slots = micro["pair_ids"].shape[1] // 2
    scored = micro["weights"] > 0
    sums = segment_sums(values * scored, micro["pair_ids"], 2 * slots)
    sums = sums.reshape(sums.shape[0], slots, 2)
    chosen, rejected = sums[..., 0], sums[..., 1]
    return chosen, jnp.where(equal_pairs(micro), chosen, rejected)


def equal_pairs(micro: Batch) -> jax.Array:
    """[B, P]: the pair slots whose chosen and rejected sequences score the same targets at the
    same positions, told apart by two 32-bit fingerprints of (target, position) over each
    sequence's scored targets, added with integer wrap-around (exact, in any order) and their
    counts."""
    return _equal_pairs(micro["pair_ids"], micro["weights"], micro["targets"], micro["positions"])


@jax.jit  # (traced once a shape: an objective asks for it in every loss and metric)
def _equal_pairs(pair_ids: jax.Array, weights: jax.Array, targets: jax.Array,
                 positions: jax.Array) -> jax.Array:
    rows, slots = pair_ids.shape[0], pair_ids.shape[1] // 2
    scored = weights > 0
    target, position = targets.astype(jnp.uint32), positions.astype(jnp.uint32)
    ids = jnp.where(scored & (pair_ids > 0), pair_ids, 0)
    flat = (jnp.arange(rows)[:, None] * (2 * slots + 1) + jnp.where(ids > 0, ids - 1, 2 * slots)).reshape(-1)

    def sums(values):
        out = jax.ops.segment_sum(jnp.where(ids > 0, values, 0).reshape(-1), flat, num_segments=rows * (2 * slots + 1))
        out = out.reshape(rows, 2 * slots + 1)[:, :2 * slots].reshape(rows, slots, 2)
        return out[..., 0] == out[..., 1]

    same = sums(scored.astype(jnp.uint32))
    for salt in (jnp.uint32(0x9E3779B9), jnp.uint32(0x85EBCA6B)):
        same &= sums(_mix(target * salt + _mix(position ^ salt)))
    return same


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (murmur3's finalizer), wrapping."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def with_router(objective: Objective, cfg) -> Objective:
    """``objective`` with the router's side terms of its one forward (a model with experts, ``cfg``
    its ModelConfig): ``model.experts.aux_loss_coef`` times the load-balancing loss and
    ``z_loss_coef`` times the router z-loss join the loss, both logged (``aux_loss``,
    ``router_z_loss``) with each layer's busiest expert's share of its routes
    (``router/max_share/<layer>``). A dense model's objective is returned as it is.

    ``aux_loss_scope: step`` with a coefficient above 0 pools the step's every micro-batch: the
    step sums their routes first (``step_forward``: a forward pass, routing only), and each
    micro-batch adds its probabilities' part of the step's loss, so the parts add up to the loss
    of the whole batch in one forward, value and gradient, however ``train.grad_accum`` cuts it.
    Otherwise each micro-batch pools its own layers and real tokens (transformers' one forward,
    Megatron's micro-batch) and the step averages them (one micro-batch: the two are one)."""
    experts = cfg.experts
    if not experts.enabled:
        return objective
    stats = tuple(f"router/max_share/{i}" for i in range(cfg.n_layers) if cfg.mlp_of(i) == "experts")
    trained = experts.aux_loss_coef > 0 or experts.z_loss_coef > 0
    pools_step = experts.aux_loss_scope == "step" and trained

    def loss(inputs: Inputs, micro: Batch) -> Terms:
        terms = objective.loss(inputs, micro)
        router, pooled = inputs.side_terms, inputs.totals.get(STEP_FORWARD)
        aux, z = load_balancing_loss(router, experts.top_k, pooled), router_z_loss(router, pooled)
        # a part of the step's loss is added whole; a micro-batch's own loss is its share of their
        # mean
        parts = 1.0 if pooled is not None else inputs.micro_batches
        extra = (experts.aux_loss_coef * aux + experts.z_loss_coef * z) * inputs.totals[objective.name] / parts
        count = jnp.asarray(1.0 if pooled is None else 1.0 / inputs.micro_batches, jnp.float32)
        counts = jax.lax.stop_gradient((router if pooled is None else pooled).counts)
        busiest = safe_divide(jnp.max(counts, axis=-1), jnp.sum(counts, axis=-1)) * count
        reported = {**terms.reported, "aux_loss": (jax.lax.stop_gradient(aux), count),
                    "router_z_loss": (jax.lax.stop_gradient(z), count),
                    **{name: (busiest[int(name.rsplit("/", 1)[1])], count) for name in stats}}
        return Terms(terms.value + extra, terms.denominator, terms.loss, reported)

    return dataclasses.replace(objective, loss=loss, step_forward=route_sums if pools_step else None,
                               reports=(*objective.reports, "aux_loss", "router_z_loss", *stats))


def route_sums(model, micro: Batch, key) -> Any:
    """A micro-batch's router sums (:class:`seqjax.model.experts.RouterTerms`), from a forward pass
    that stops before the head."""
    return forward(model, micro, key)[2]
