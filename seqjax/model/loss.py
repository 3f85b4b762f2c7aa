"""The LM loss (docs/design.md, contract 3): weights-weighted next-token cross-entropy in float32,
and the per-token log-probabilities and per-segment sums that sequence-level objectives (preference
pairs) start from.

    loss = sum(weights * nll) / sum(weights)

The sums come back too, because perplexity and gradient accumulation need
them un-divided: exp(total nll_sum / total weight_sum), never a mean of means.

:func:`token_logprobs` (and :func:`chunked_token_logprobs`, its chunked twin)
give log p(target) per token; :func:`segment_sums` adds them up per segment of
a packed row: a sequence's log-probability, however the row is packed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seqjax.model.mask import run_starts


def lm_loss(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of ``targets`` [B, T] under ``logits`` [B, T, V], weighted by ``weights`` [B,
    T].

    Returns (loss, aux) with aux = {nll_sum, weight_sum, z_loss_sum}, float32
    scalars. ``z_loss`` adds z_loss * sum(weights * log(Z)^2) / sum(weights)
    (PaLM's auxiliary term that keeps the softmax normalizer near 1). A batch
    with sum(weights) == 0 gives loss 0 and zero gradients, not NaN.
    Targets with weight 0 are never read (padding may hold any id); a target
    outside [0, V) with non-zero weight gives NaN, never a silent wrong loss.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2] or weights.shape != targets.shape:
        raise ValueError(
            f"lm_loss: logits {logits.shape}, targets {targets.shape}, weights {weights.shape}; "
            "expected [B, T, V], [B, T], [B, T]"
        )
    weights = weights.astype(jnp.float32)
    scored = weights != 0
    nll, log_z = _token_nll(logits, targets, weights)
    nll_sum = jnp.sum(nll)
    z_loss_sum = jnp.sum(jnp.where(scored, weights * jnp.square(log_z), 0.0))
    weight_sum = jnp.sum(weights)
    denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
    loss = (nll_sum + z_loss * z_loss_sum) / denom
    return loss, {"nll_sum": nll_sum, "weight_sum": weight_sum, "z_loss_sum": z_loss_sum}


def token_nll(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """``weights * nll`` of each target [B, T] (float32; 0 where the weight is 0): what
    :func:`lm_loss` sums, kept per token for the evaluation's per-example figures."""
    return _token_nll(logits, targets, weights.astype(jnp.float32))[0]


def _token_nll(logits: jax.Array, targets: jax.Array,
               weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(weighted nll [B, T], log-normalizer [B, T]); a scored target outside [0, V) gives NaN."""
    logits = logits.astype(jnp.float32)
    scored = weights != 0
    log_z = jax.nn.logsumexp(logits, axis=-1)
    ids = jnp.where(scored, targets, 0)
    # out of range -> NaN below
    ids = jnp.where((ids >= 0) & (ids < logits.shape[-1]), ids, logits.shape[-1])
    target_logit = jnp.take_along_axis(logits, ids[..., None], axis=-1, mode="fill",
                                       fill_value=jnp.nan)[..., 0]
    return jnp.where(scored, weights * (log_z - target_logit), 0.0), log_z


def chunked_lm_loss(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    chunk_tokens: int,
    z_loss: float = 0.0,
    spans: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`lm_loss` of ``hidden`` [B, T, D] @ ``head`` [D, V], without ever building the [B*T, V]
    logits.

    The tokens are cut into chunks of ``chunk_tokens``; each chunk's logits
    ([chunk, V], float32: the matmul runs in hidden's dtype with float32
    accumulation) are made, reduced to their log-normalizer and target logit,
    and dropped. The backward pass remakes them a chunk at a time (a custom
    VJP), so peak memory holds one chunk's logits, not all of them: at
    gpt2_small's 32,768 tokens x 50,304 vocabulary, 6.6 GB of float32 logits
    become ``chunk_tokens`` x 50,304 x 4 bytes. Same contract (3), same sums,
    same refusals as :func:`lm_loss`. ``spans``: a row's tokens lie in this many equal spans on
    separate devices (mesh.context, :func:`seqjax.model.context.row_spans`); chunks never cross a
    span, so each device scores its own tokens (:func:`_to_chunks`).
    """
    b, t, d = hidden.shape
    if targets.shape != (b, t) or weights.shape != (b, t) or head.shape[0] != d:
        raise ValueError(
            f"chunked_lm_loss: hidden {hidden.shape}, head {head.shape}, targets {targets.shape}, "
            f"weights {weights.shape}; expected [B, T, D], [D, V], [B, T], [B, T]")
    # (padded tokens carry weight 0: never read, never scored)
    x, ids, w = (_to_chunks(a, spans, chunk_tokens) for a in (hidden, targets, weights.astype(jnp.float32)))
    nll_sum, z_loss_sum = _chunked_sums(x, head.astype(hidden.dtype), ids, w)
    weight_sum = jnp.sum(weights.astype(jnp.float32))
    denom = jnp.where(weight_sum > 0, weight_sum, 1.0)
    loss = (nll_sum + z_loss * z_loss_sum) / denom
    return loss, {"nll_sum": nll_sum, "weight_sum": weight_sum, "z_loss_sum": z_loss_sum}


def _to_chunks(a: jax.Array, spans: int, chunk_tokens: int) -> jax.Array:
    """[B, T, ...] -> [chunks, spans, C, ...]: the loss's scan runs over the first axis.

    Each row is cut into ``spans`` equal spans of T / spans tokens (1: the whole row), the spans'
    tokens of every row are put together and cut into chunks of C = min(chunk_tokens, tokens a
    span) tokens, the last padded with zeros. A chunk never mixes spans: on a row split over
    mesh.context the span axis is the devices', so each scan step scores C of every device's own
    tokens, and nothing is gathered. Example: B = 1, T = 8, spans = 2, chunk_tokens = 2: tokens
    [0 1 2 3 | 4 5 6 7] -> step 0 takes (0 1) and (4 5), step 1 (2 3) and (6 7).
    """
    b, t, rest = a.shape[0], a.shape[1], a.shape[2:]
    if t % spans:
        raise ValueError(f"chunked loss: a row of {t} tokens does not cut into {spans} equal spans")
    per = b * t // spans
    chunk = max(1, min(chunk_tokens, per))
    a = jnp.moveaxis(a.reshape(b, spans, t // spans, *rest), 1, 0).reshape(spans, per, *rest)
    a = jnp.pad(a, ((0, 0), (0, -per % chunk)) + ((0, 0),) * len(rest))
    return jnp.moveaxis(a.reshape(spans, -1, chunk, *rest), 1, 0)


def _from_chunks(v: jax.Array, b: int, t: int) -> jax.Array:
    """Per-token values [chunks, spans, C] (:func:`_to_chunks`' layout) back to [B, T]."""
    spans = v.shape[1]
    v = jnp.moveaxis(v, 0, 1).reshape(spans, -1)[:, : b * t // spans]
    return jnp.moveaxis(v.reshape(spans, b, t // spans), 0, 1).reshape(b, t)


def _chunk_stats(x, head, ids, w, logits=None):
    """One chunk: x [..., D] -> (log_z [...], target logit [...]), float32, as lm_loss computes them
    (from ``logits`` when the caller made them)."""
    if logits is None:
        logits = jnp.einsum("...d,dv->...v", x, head, preferred_element_type=jnp.float32)
    scored = w != 0
    vocab = logits.shape[-1]
    safe = jnp.where(scored, ids, 0)
    # out of range -> NaN, as in lm_loss
    safe = jnp.where((safe >= 0) & (safe < vocab), safe, vocab)
    target = jnp.take_along_axis(logits, safe[..., None], axis=-1, mode="fill", fill_value=jnp.nan)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1), target


@jax.custom_vjp
def _chunked_sums(x, head, ids, w):
    """(sum of w * nll, sum of w * log_z^2) over chunks x [chunks, spans, C, D] of tokens."""
    return _chunked_forward(x, head, ids, w)[0]


def _chunked_forward(x, head, ids, w):
    def body(carry, chunk):
        xc, idc, wc = chunk
        log_z, target = _chunk_stats(xc, head, idc, wc)
        scored = wc != 0
        nll = jnp.sum(jnp.where(scored, wc * (log_z - target), 0.0))
        z = jnp.sum(jnp.where(scored, wc * jnp.square(log_z), 0.0))
        return (carry[0] + nll, carry[1] + z), log_z

    zero = jnp.zeros((), jnp.float32)
    sums, log_z = jax.lax.scan(body, (zero, zero), (x, ids, w))
    return sums, log_z


def _chunked_sums_fwd(x, head, ids, w):
    sums, log_z = _chunked_forward(x, head, ids, w)
    # log_z [chunks, spans, C] is kept: the backward pass need not redo the reduction
    return sums, (x, head, ids, w, log_z)


def _chunked_sums_bwd(residuals, cotangents):
    x, head, ids, w, log_z = residuals
    g_nll, g_z = cotangents

    def body(dhead, chunk):
        xc, idc, wc, lzc = chunk
        logits = jnp.einsum("...d,dv->...v", xc, head, preferred_element_type=jnp.float32)
        probs = jnp.exp(logits - lzc[..., None])
        scored = (wc != 0)[..., None]
        onehot = jax.nn.one_hot(jnp.where(wc != 0, idc, -1), logits.shape[-1], dtype=jnp.float32)
        # d(w * (log_z - logit_t)) = w * (p - onehot); d(w * log_z^2) = w * 2 log_z * p
        dlogits = jnp.where(
            scored, wc[..., None] * (g_nll * (probs - onehot) + g_z * 2.0 * lzc[..., None] * probs),
            0.0)
        # the two products below run in the compute dtype, float32 accumulation
        dlogits = dlogits.astype(xc.dtype)
        dx = jnp.einsum("...v,dv->...d", dlogits, head, preferred_element_type=jnp.float32).astype(xc.dtype)
        dhead = dhead + jnp.einsum("...d,...v->dv", xc, dlogits, preferred_element_type=jnp.float32)
        return dhead, dx

    dhead, dx = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), (x, ids, w, log_z))
    return dx, dhead.astype(head.dtype), None, None


_chunked_sums.defvjp(_chunked_sums_fwd, _chunked_sums_bwd)


# What token_stats gives per token, besides the log-probability: TRL 1.16's per-token metrics.
STATS = ("entropy", "mean_logit", "top1")


def _stats(logits: jax.Array, target_logit: jax.Array, log_z: jax.Array) -> tuple[jax.Array, ...]:
    """(entropy, mean logit, whether the target is the most likely token) per token of float32 ``logits``
    [..., V], its target's logit and its log-normalizer."""
    probs = jnp.exp(logits - log_z[..., None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return entropy, jnp.mean(logits, axis=-1), (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)


def token_stats(logits: jax.Array, targets: jax.Array, scored: jax.Array) -> dict[str, jax.Array]:
    """TRL's per-token metrics from ``logits`` [B, T, V], each [B, T] float32 and 0 where ``scored`` is False:
    ``entropy`` (of the model's next-token distribution), ``mean_logit`` (over the vocabulary: TRL's
    ``logits/*``), ``top1`` (1 where the target is the most likely token: ``mean_token_accuracy``).
    No gradient flows through them."""
    logits = jax.lax.stop_gradient(logits).astype(jnp.float32)
    ids = jnp.where(scored, targets, 0)
    target = jnp.take_along_axis(logits, jnp.clip(ids, 0, logits.shape[-1] - 1)[..., None], axis=-1)[..., 0]
    values = _stats(logits, target, jax.nn.logsumexp(logits, axis=-1))
    return {name: jnp.where(scored, value, 0.0) for name, value in zip(STATS, values)}


def token_logprobs(logits: jax.Array, targets: jax.Array, scored: jax.Array) -> jax.Array:
    """log p(targets) [B, T], float32, from ``logits`` [B, T, V]; 0 where ``scored`` is False (never
    read there).

    The same arithmetic as :func:`lm_loss` (a token's log-probability is minus its nll).
    """
    return -_token_nll(logits, targets, scored.astype(jnp.float32))[0]


def chunked_token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, scored: jax.Array, *,
                           chunk_tokens: int, stats: bool = False, spans: int = 1):
    """:func:`token_logprobs` of ``hidden`` [B, T, D] @ ``head`` [D, V], a chunk of tokens at a
    time: the [B*T, V] logits never exist whole, in the forward pass or (a custom VJP) the backward
    one. ``stats``: also :func:`token_stats`, from the same chunks' logits: ``(logp, stats)``.
    ``spans``: as :func:`chunked_lm_loss`'s (chunks never cross a device's span of the row)."""
    b, t, d = hidden.shape
    if targets.shape != (b, t) or scored.shape != (b, t) or head.shape[0] != d:
        raise ValueError(
            f"chunked_token_logprobs: hidden {hidden.shape}, head {head.shape}, targets "
            f"{targets.shape}, scored {scored.shape}; expected [B, T, D], [D, V], [B, T], [B, T]")
    x, ids, w = (_to_chunks(a, spans, chunk_tokens) for a in (hidden, targets, scored.astype(jnp.float32)))
    out = _chunked_logprobs(x, head.astype(hidden.dtype), ids, w)
    logp, values = out[0], jax.lax.stop_gradient(out[1:])

    def unchunk(v):
        return _from_chunks(v, b, t)

    if not stats:
        return unchunk(logp)
    return unchunk(logp), {name: unchunk(v) for name, v in zip(STATS, values)}


@jax.custom_vjp
def _chunked_logprobs(x, head, ids, w):
    """(log p(ids), entropy, mean logit, top1), each [chunks, spans, C], for chunks x [chunks, spans, C,
    D] (0 where w is 0); only the first has a gradient."""
    return _chunked_logprobs_fwd(x, head, ids, w)[0]


def _chunked_logprobs_fwd(x, head, ids, w):
    def body(_, chunk):
        xc, idc, wc = chunk
        logits = jnp.einsum("...d,dv->...v", xc, head, preferred_element_type=jnp.float32)
        log_z, target = _chunk_stats(xc, head, idc, wc, logits)
        scored = wc != 0
        values = (target - log_z, *_stats(logits, target, log_z))
        return None, (tuple(jnp.where(scored, v, 0.0) for v in values), log_z)

    _, (out, log_z) = jax.lax.scan(body, None, (x, ids, w))
    return out, (x, head, ids, w, log_z)


def _chunked_logprobs_bwd(residuals, cotangents):
    x, head, ids, w, log_z = residuals
    g = cotangents[0]  # (the statistics have no gradient)

    def body(dhead, chunk):
        xc, idc, wc, lzc, gc = chunk
        logits = jnp.einsum("...d,dv->...v", xc, head, preferred_element_type=jnp.float32)
        probs = jnp.exp(logits - lzc[..., None])
        onehot = jax.nn.one_hot(jnp.where(wc != 0, idc, -1), logits.shape[-1], dtype=jnp.float32)
        # d log p(t) / d logits = onehot - p, on scored tokens only
        dlogits = jnp.where((wc != 0)[..., None], gc[..., None] * (onehot - probs), 0.0).astype(xc.dtype)
        dx = jnp.einsum("...v,dv->...d", dlogits, head, preferred_element_type=jnp.float32).astype(xc.dtype)
        dhead = dhead + jnp.einsum("...d,...v->dv", xc, dlogits, preferred_element_type=jnp.float32)
        return dhead, dx

    dhead, dx = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), (x, ids, w, log_z, g))
    return dx, dhead.astype(head.dtype), None, None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)


@functools.partial(jax.jit, static_argnames="num_segments")
def segment_sums(values: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """Per-segment sums [B, S] of ``values`` [B, T]: column s - 1 adds the entries of segment id s
    (1..S) of each row; segment 0 (padding) and ids above S are dropped. The one reduction every
    sequence-level objective shares: a packed row's sums equal each sequence's sum computed alone.

    The order of the additions depends on nothing but each entry's place in its run of equal ids (a
    pairwise tree over the run: entries 0+1, 2+3, ..., then (0+1)+(2+3), ...), never on where the run
    sits in the row or on the backend's scatter order: the same values give the same float32 sum bit
    for bit at any offset, on every device (a preference pair's identical chosen and rejected sequences tie
    exactly, as TRL's, which runs them in rows of their own).

    >>> segment_sums(jnp.array([[1., 2., 3., 0.]]), jnp.array([[1, 1, 2, 0]]), 2)
    Array([[3., 3.]], dtype=float32)
    """
    b, t = values.shape
    index = jnp.arange(t)
    run_start = run_starts(segment_ids)
    starts = run_start == index
    place = index - run_start  # each entry's place in its run
    acc, shift = values, 1
    while shift < t:  # level k: an entry at a multiple of 2^(k+1) adds the partial sum 2^k after it
        later = jnp.pad(acc[:, shift:], ((0, 0), (0, shift)))
        same_run = jnp.pad(run_start[:, shift:] == run_start[:, :-shift], ((0, 0), (0, shift)))
        acc = jnp.where(same_run & (place % (2 * shift) == 0), acc + later, acc)
        shift *= 2
    # each run's first entry holds its sum: the one entry its segment's column receives (a segment
    # cut into several runs adds them)
    keep = starts & (segment_ids > 0) & (segment_ids <= num_segments)
    ids = jnp.where(keep, segment_ids - 1, num_segments)
    flat = (jnp.arange(b)[:, None] * (num_segments + 1) + ids).reshape(-1)
    sums = jax.ops.segment_sum(jnp.where(keep, acc, 0.0).reshape(-1), flat, num_segments=b * (num_segments + 1))
    return sums.reshape(b, num_segments + 1)[:, :num_segments]
