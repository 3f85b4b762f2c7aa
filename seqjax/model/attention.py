"""Segment-masked causal attention: the backends behind one function, and the reference path.

The mask itself (contract 2) is :func:`seqjax.model.mask.segment_mask`, one
module below this one, which the kernels import too.

:func:`attention` is the one entry point the model calls; it checks shapes and
dispatches to a backend (``model.attention``):

=========  =====================================================================
backend    what runs
=========  =====================================================================
xla        :func:`reference_attention`: einsum + float32 softmax, any platform
cudnn      ``jax.nn.dot_product_attention(implementation="cudnn")`` with the dense
           segment mask; GPU only, bfloat16/float16 only (cuDNN takes no segment ids)
cudnn_packed  cuDNN's packed layout (``q_offsets``/``kv_offsets`` and per-segment lengths from
           :func:`packed_offsets`), causal inside each segment: refused as a run's backend until a
           GPU shows it works (:data:`CUDNN_PACKED_REFUSED`); the attention benchmark still times it
pallas     ``seqjax.model.kernels.flash.flash_attention`` (GPU; interpret mode elsewhere); skips
           the tiles outside each segment and outside a sliding layer's band
pallas_mosaic  ``seqjax.model.kernels.mosaic.mosaic_attention``: the same ranges on Mosaic GPU
           (Hopper: TMA, wgmma, a producer warpgroup); interpret mode off a GPU; ``auto`` does
           not pick it until a GPU has measured it
splash     ``seqjax.model.kernels.splash.splash_attention`` (TPU); windows as a LocalMask
auto       GPU: pallas, else cudnn, else xla; TPU: splash, else xla; CPU: xla.
           Every fallback is logged with its reason.
=========  =====================================================================

On several devices the kernels (opaque custom calls to XLA's partitioner,
which could only run them by gathering q/k/v onto every device) run once per
device shard under ``jax.shard_map``: rows split over the mesh's batch axes
(``data``, ``fsdp``) and heads over ``tensor``, as seqjax.model.sharding lays
them out. The mesh is the one ``jax.set_mesh`` made current, else the one the
arguments' shardings live on (what ``jax.jit(..., in_shardings=...)`` gives).
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from seqjax.core.errors import ConfigError
from seqjax.core.progress import log_once
from seqjax.model.context import SplitRow, split_row_attention
from seqjax.model.mask import check_attention_inputs, segment_mask
from seqjax.model.sharding import BATCH_AXES, shard_axes

log = logging.getLogger(__name__)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    window: int | jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Plain XLA attention, softmax in float32. q: [B, T, H, D]; k, v: [B, T, Hkv, D]; Hkv divides
    H.

    Fully masked rows (padding queries) give zeros, never NaN. With a ``dropout_key``, attention
    probabilities are dropped at ``dropout_rate`` (training only; see :func:`masked_attention`).
    """
    return masked_attention(q, k, v, segment_mask(segment_ids, window=window), scale=scale,
                            dropout_rate=dropout_rate, dropout_key=dropout_key, sinks=sinks)


def masked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    sinks: jax.Array | None = None,
    heads_first: bool = False,
) -> jax.Array:
    """Attention under an explicit boolean mask [B, Tq, Tk] (from :func:`segment_mask`), softmax in
    float32. ``sinks`` [H] (gpt-oss): one learned logit per head taken into every query's softmax,
    after scaling and masking, and attending to nothing (its probability is dropped): a query whose
    keys score low puts most of its weight there.

    q: [B, Tq, H, D]; k, v: [B, Tk, Hkv, D] (``heads_first``: [B, Hkv, Tk, D]). The reference path
    and the KV-cache decode (queries against a longer cache) share this one softmax, so a fully
    masked row gives zeros in both. With a ``dropout_key`` (training), each probability is zeroed
    with chance ``dropout_rate`` and the rest scaled by 1 / (1 - rate); without one (evaluation,
    decoding) nothing is dropped. (Heads go ahead of the tokens before both products, and the
    output comes in their order: XLA's CPU dot then runs them directly, twice as fast.)
    """
    if not heads_first:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    b, tq, h, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of key/value heads {hkv}")
    scale = d**-0.5 if scale is None else scale
    group = h // hkv
    qg = q.reshape(b, tq, hkv, group, d).transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None, :, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1)
    if sink is not None:  # (a fully masked query still attends to nothing: its sink is not a key)
        row_max = jnp.where(jnp.isfinite(row_max), jnp.maximum(row_max, sink), row_max)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sink is not None:
        denom = jnp.where(denom > 0, denom + jnp.exp(sink - row_max), denom)
    probs = weights / jnp.where(denom == 0, 1.0, denom)
    if dropout_key is not None and dropout_rate:
        keep = jax.random.bernoulli(dropout_key, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d).astype(q.dtype)


BACKENDS = ("xla", "cudnn", "cudnn_packed", "pallas", "pallas_mosaic", "splash")
_KERNELS = {"pallas": ("seqjax.model.kernels.flash", "flash_attention"),
            "pallas_mosaic": ("seqjax.model.kernels.mosaic", "mosaic_attention"),
            "splash": ("seqjax.model.kernels.splash", "splash_attention")}
# The backends that take the per-forward BlockMetadata (each with its own tile sizes:
# block_sizes_for).
TILED = ("pallas", "pallas_mosaic")
_HALF = (jnp.bfloat16, jnp.float16)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    backend: str = "xla",
    scale: float | None = None,
    metadata=None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    window: int | jax.Array | None = None,
    prefix_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    causal: bool = True,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Segment-masked causal self-attention (contract 2) on the chosen backend.

    q: [B, T, H, D]; k, v: [B, T, Hkv, D] with Hkv dividing H (grouped-query); segment_ids: [B, T]
    int (0 = padding). Returns [B, T, H, D] in q's dtype; padding queries give zeros. ``scale``
    defaults to D**-0.5. Shapes are checked at trace time; ``backend="auto"`` is resolved by
    :func:`resolve_backend`. ``metadata``: the pallas kernel's ``BlockMetadata`` for these segment
    ids, computed once per forward by the caller (other backends ignore it), or a :class:`SplitRow`
    (seqjax.model.context: a row over mesh.context). ``dropout_rate`` /
    ``dropout_key``: attention-probability dropout (training), which only the xla backend
    implements: ``auto`` then runs xla, and any other backend refuses it rather than silently not
    dropping. Without a key (evaluation), ``auto`` keeps its fastest kernel. ``window``: a sliding
    layer's window (contract 2); a backend without windows refuses it, never attending to the whole
    segment instead (:func:`resolve_backend`). ``prefix_ids`` (with the tokens' ``positions``): a
    shared prompt that segments also attend to (:func:`seqjax.model.mask.allowed`), which the dense
    mask computes (xla), and the flash kernel without a sliding window or dropout (pallas, and auto
    where it picks pallas; ``metadata`` then from ``block_metadata(..., prefix_ids=)``); every other
    backend refuses it. ``causal=False``:
    contract 2's non-causal form (a vision encoder's images), which xla and pallas compute; every
    other backend refuses it. ``sinks`` [H]: gpt-oss's attention sinks (:func:`masked_attention`),
    on the dense path (xla, and auto where it picks xla) and the flash kernel (pallas: its output
    rescaled by the sink's share of each query's log-sum-exp, both differentiable); every other
    backend, and a row split over mesh.context, refuses them.
    """
    check_attention_inputs(q, k, v, segment_ids)
    if sinks is not None and (isinstance(metadata, SplitRow) or not causal):
        raise ConfigError("model.attention_sinks: a row split over mesh.context or non-causal "
                          "attention cannot take attention sinks; expected mesh.context=1")
    if isinstance(metadata, SplitRow):  # a row split over mesh.context (seqjax.model.context)
        return split_row_attention(q, k, v, segment_ids, metadata, scale, window, prefix_ids, positions)
    if not causal:
        return _non_causal(q, k, v, segment_ids, backend, scale, metadata)
    if prefix_ids is not None and not _flash_prompt(backend, q.dtype, window, dropout_rate, dropout_key):
        return _shared_prompt(q, k, v, segment_ids, backend, scale, dropout_rate, dropout_key, window,
                              prefix_ids, positions, sinks)
    if dropout_key is not None and dropout_rate:
        if backend not in ("xla", "auto"):
            raise ValueError("attention dropout needs model.attention=xla (or auto), got "
                             f"{backend!r}")
        return reference_attention(q, k, v, segment_ids, scale=scale, dropout_rate=dropout_rate,
                                   dropout_key=dropout_key, window=window, sinks=sinks)
    name = resolve_backend(backend, q.dtype, windows=window is not None)
    if sinks is not None and name not in SINKS:
        if backend != "auto":
            raise ConfigError(f"model.attention: got {backend!r}, which cannot take attention "
                              f"sinks (model.attention_sinks); expected one of {', '.join(SINKS)} "
                              "or auto")
        name = "xla"
    if name not in _KERNELS:
        if sinks is not None:
            return reference_attention(q, k, v, segment_ids, scale=scale, window=window, sinks=sinks)
        return _implementation(name)(q, k, v, segment_ids, scale=scale, window=window)
    return _run_kernel(name, q, k, v, segment_ids, scale, metadata, window, prefix_ids, sinks)


def _run_kernel(name, q, k, v, segment_ids, scale, metadata, window, prefix_ids, sinks) -> jax.Array:
    """A Pallas kernel's attention, its sinks applied through its log-sum-exp, under the devices'
    row and head split where the arrays have one (shard_map)."""
    kernel = _load_kernel(name)
    extra, static = _kernel_arguments(name, metadata, window, prefix_ids)
    if sinks is not None:
        extra, static = {**extra, "sinks": sinks}, {**static, "with_lse": True}

    def run(q, k, v, segment_ids, extra):
        extra = dict(extra)
        sink = extra.pop("sinks", None)
        out = kernel(q, k, v, segment_ids, scale=scale, **static, **extra)
        return out if sink is None else with_sinks(*out, sink)
    layout = _device_layout(q, k, segment_ids)
    if layout is None:
        return run(q, k, v, segment_ids, extra)
    mesh, rows, heads = layout
    per_head, per_row = P(rows, None, heads, None), P(rows)
    # a traced window: everywhere; the sinks with their heads
    extra_specs = {name: P(heads) if name == "sinks" else jax.tree.map(
        lambda b: P() if jnp.ndim(b) == 0 else per_row, a) for name, a in extra.items()}
    return jax.shard_map(run, mesh=mesh, in_specs=(per_head, per_head, per_head, per_row, extra_specs),
                         out_specs=per_head, check_vma=False)(q, k, v, segment_ids, extra)


# The backends that take attention sinks (gpt-oss): the dense softmax, and the flash kernel through
# its log-sum-exp.
SINKS = ("xla", "pallas")


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """Attention ``out`` [B, T, H, D] over the keys alone, given its natural log-sum-exp ``lse``
    [B, H, T], rescaled to a softmax that also holds each head's sink logit: exp(lse) / (exp(lse)
    + exp(sink)) = sigmoid(lse - sink) of the weight stays on the keys. A query with no key (lse
    near -inf) stays 0."""
    share = jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32)[None, :, None])
    return (out.astype(jnp.float32) * jnp.transpose(share, (0, 2, 1))[..., None]).astype(out.dtype)


def _kernel_arguments(name: str, metadata, window, prefix_ids) -> tuple[dict, dict]:
    """(extra, static): the kernel's array arguments (split per device with the rows) and the
    settings it needs as Python values (splash's static window mask)."""
    static = {}
    if name in TILED and metadata is not None:
        extra = {"metadata": metadata}  # computed for this layer's window (block_metadata's window)
    elif isinstance(window, int):
        extra, static = {}, {"window": window}
    else:
        extra = {} if window is None else {"window": window}
    if prefix_ids is not None:  # the flash kernel's shared prompt (_flash_prompt)
        extra = {**extra, "prefix_ids": prefix_ids}
    return extra, static


def _flash_prompt(backend: str, dtype, window, dropout_rate, dropout_key) -> bool:
    """Whether a shared prompt runs on the flash kernel (its second range per query block,
    ``block_metadata(..., prefix_ids=)``): pallas, or auto where auto picks it, without a sliding
    window or dropout; otherwise the dense mask computes it (:func:`_shared_prompt`)."""
    dropout = dropout_key is not None and dropout_rate
    if backend not in ("pallas", "auto") or window is not None or dropout:
        return False
    return resolve_backend(backend, dtype) == "pallas"


def _shared_prompt(q, k, v, segment_ids, backend: str, scale, dropout_rate, dropout_key, window,
                   prefix_ids, positions, sinks=None) -> jax.Array:
    """A shared prompt's mask (:func:`seqjax.model.mask.allowed`) on the dense path: xla, and auto
    where the flash kernel cannot take it."""
    if backend not in ("xla", "auto"):
        flash = backend == "pallas"
        raise ConfigError(f"model.attention: got {backend!r}, which cannot honour a shared prompt's mask "
                          "(data.shared_prompt, rl.layout=prompt_once)" + (" with a sliding "
                                                                           "window or dropout"
                                                                           if flash else "")
                          + "; expected xla or auto" + (", or pallas without those" if flash else ""))
    mask = segment_mask(segment_ids, q_index=positions, kv_index=positions, window=window,
                        q_prefix_ids=prefix_ids)
    return masked_attention(q, k, v, mask, scale=scale, dropout_rate=dropout_rate,
                            dropout_key=dropout_key if dropout_rate else None, sinks=sinks)


NON_CAUSAL = ("xla", "pallas")  # the backends that compute the non-causal form


def _non_causal(q, k, v, segment_ids, backend: str, scale, metadata) -> jax.Array:
    """Each query attends to its whole segment (no window, no dropout): the dense mask, or the flash
    kernel's non-causal form (one call: a tower runs per row)."""
    if backend not in NON_CAUSAL:
        raise ConfigError(f"model.attention: got {backend!r}, which cannot honour the non-causal "
                          "mask of a vision encoder's images; expected one of "
                          f"{', '.join(NON_CAUSAL)}")
    if backend == "xla":
        return masked_attention(q, k, v, segment_mask(segment_ids, causal=False), scale=scale)
    return _load_kernel("pallas")(q, k, v, segment_ids, scale=scale, metadata=metadata, causal=False)


def _device_layout(q: jax.Array, k: jax.Array, segment_ids: jax.Array):
    """(mesh, row axes, head axis) to run a kernel per device shard, or None when one call on the
    whole batch will do.

    Rows split over the batch axes (those of size > 1 that the batch divides
    by); heads over ``tensor`` when it divides both H and Hkv (GQA groups stay
    whole). Axes already manual (inside an outer shard_map) are left alone.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = jax.typeof(segment_ids).sharding.mesh
    if mesh.empty:
        return None
    rows, heads = shard_axes(mesh, q.shape[0], (q.shape[2], k.shape[2]))
    wanted = tuple(a for a in BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1 and a not in mesh.manual_axes)
    if wanted and not rows:
        log.warning("attention: batch of %d rows does not split over mesh axes %s (%d ways); "
                    "the kernel runs unsplit and XLA may gather its inputs", q.shape[0], wanted,
                    math.prod(mesh.shape[a] for a in wanted))
    if not rows and heads is None:
        return None
    return mesh, rows or None, heads


# The backends that honour a sliding window (contract 2). xla and cudnn run segment_mask itself;
# pallas skips the tiles outside the band and masks its edges with segment_mask; splash takes a
# LocalMask.
WINDOWED = ("xla", "cudnn", "pallas", "pallas_mosaic", "splash")  # not cudnn_packed


# cuDNN's packed layout, refused as a run's backend until a GPU shows it works
# (scripts/bench_attention.py still times it, impls cudnn_packed and cudnn_packed_t, for the next
# GPU to decide)
CUDNN_PACKED_REFUSED = (
    "model.attention: got 'cudnn_packed', refused until a GPU shows it works: on an H200 "
    "(2026-11-27) its backward asked for 1.02 TiB and its forward ran at a quarter of cuDNN's "
    "dense speed, given as many segments a row as tokens (8,192); expected pallas, cudnn, xla or "
    "auto")


def _check_explicit(backend: str, dtype) -> None:
    """A named backend this platform and dtype can run, or one line saying what is missing."""
    if backend not in BACKENDS:
        raise ValueError(f"model.attention: got {backend!r}, expected one of auto, "
                         f"{', '.join(BACKENDS)}")
    if backend in ("cudnn", "cudnn_packed") and jax.default_backend() != "gpu":
        raise ConfigError(
            f"model.attention: got {backend!r}, which needs an NVIDIA GPU; this machine's JAX "
            f"platform is {jax.default_backend()} (use xla, or auto)")
    if backend in ("cudnn", "cudnn_packed") and jnp.dtype(dtype) not in map(jnp.dtype, _HALF):
        raise ConfigError(
            f"model.attention: got {backend!r}, which needs bfloat16 or float16, got "
            f"{jnp.dtype(dtype).name} (set model.compute_dtype, or use pallas, xla or auto)")


def resolve_backend(backend: str, dtype=jnp.float32, windows: bool = False) -> str:
    """Turn ``auto`` into the fastest backend this platform can run for ``dtype``; check explicit
    names.

    GPU prefers the Pallas flash kernel (it skips the blocks packing leaves
    empty), then cuDNN (half precision only, dense mask), then XLA. TPU prefers
    splash. CPU runs XLA. Each fallback logs why, once per trace. ``windows``:
    the model has sliding-window layers, which only :data:`WINDOWED` backends
    compute; ``auto`` then picks among them, and another name is refused.
    """
    if windows and backend not in ("auto", *WINDOWED) and backend in BACKENDS:
        raise ConfigError(f"model.attention: got {backend!r}, which does not compute sliding "
                          "windows (model.sliding_window); expected one of auto, "
                          f"{', '.join(WINDOWED)}")
    if backend != "auto":
        _check_explicit(backend, dtype)
        if backend == "cudnn_packed":
            raise ConfigError(CUDNN_PACKED_REFUSED)
        return backend
    platform = jax.default_backend()
    if platform == "gpu":
        reason = _kernel_missing("pallas")
        if reason is None:
            return "pallas"
        if jnp.dtype(dtype) in map(jnp.dtype, _HALF):
            log_once(log, logging.WARNING, "attention auto: using cudnn, not pallas (%s)", reason)
            return "cudnn"
        log_once(log, logging.WARNING, "attention auto: using xla (pallas unavailable: %s; cudnn needs "
                 "bfloat16/float16, got %s)", reason, jnp.dtype(dtype).name)
        return "xla"
    if platform == "tpu":
        reason = _kernel_missing("splash")
        if reason is None:
            return "splash"
        log_once(log, logging.WARNING, "attention auto: using xla, not splash (%s)", reason)
        return "xla"
    log_once(log, logging.INFO,
             "attention auto: using xla on platform %s (the kernels need a GPU or TPU)", platform)
    return "xla"


def _kernel_missing(backend: str) -> str | None:
    """None when the backend's kernel imports, else why not."""
    try:
        _load_kernel(backend)
    except RuntimeError as err:
        return str(err)
    return None


def _load_kernel(backend: str) -> Callable:
    """Import a kernel lazily, so the model works without it and a missing one fails with a clear
    message."""
    module, name = _KERNELS[backend]
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"model.attention={backend!r} needs {module}.{name}, which is not available: {err}"
        ) from err
    return fn


def _cudnn_attention(q, k, v, segment_ids, *, scale=None, window=None):
    """cuDNN fused attention with the segment mask (and window) passed densely ([B, 1, T, T]);
    padding rows zeroed after."""
    # a GPU and half precision, or one line saying which is missing
    resolve_backend("cudnn", q.dtype)
    mask = segment_mask(segment_ids, window=window)[:, None, :, :]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(q.dtype)


def packed_offsets(segment_ids: jax.Array,
                   max_segments: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Contract 2's segment ids [B, T] as cuDNN's packed layout: (seqlen [B, M], offsets [B, M +
    1]), int32.

    Row b's k-th run of one non-zero id starts at ``offsets[b, k]`` and is ``seqlen[b, k]`` tokens
    long; entries past a row's last run are -1 (offsets end with -1), as
    ``fused_attention_stablehlo.dot_product_attention`` asks. Padding (id 0) belongs to no segment.
    M, the most segments a row may hold, is static: ``max_segments`` (``data.max_segments_per_row``
    when the packer caps it) or T. A run is a document, as the contract's contiguous runs say: an id
    that recurs after another (never written by seqjax's packers) becomes two segments here, where
    segment_mask would join them.

    Worked example: ids [[1, 1, 2, 0], [3, 3, 3, 3]], M = 3 ->
    seqlen [[2, 1, -1], [4, -1, -1]], offsets [[0, 2, -1, -1], [0, -1, -1, -1]].
    """
    b, t = segment_ids.shape
    m = t if max_segments is None else max_segments
    real = segment_ids != 0
    previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    starts = real & ((segment_ids != previous) | (jnp.arange(t) == 0))
    run = jnp.cumsum(starts, axis=1) - 1  # each token's run number in its row (-1 before the first)
    count = run[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    # scatter each start and each real token to its run; other tokens go to the dropped column m
    slot = jnp.where(starts, run, m)
    offsets = jnp.full((b, m + 1), -1, jnp.int32).at[rows, slot].set(jnp.arange(t, dtype=jnp.int32),
                                                                     mode="drop")
    seqlen = jnp.zeros((b, m + 1), jnp.int32).at[rows,
                                                 jnp.where(real, run, m)].add(1, mode="drop")[:, :m]
    seqlen = jnp.where(jnp.arange(m) < count[:, None], seqlen, -1)
    return seqlen, offsets.at[:, m].set(-1)


def _cudnn_packed_attention(q, k, v, segment_ids, *, scale=None, window=None, max_segments=None,
                            offsets=None):
    """cuDNN's fused attention on the packed layout: each segment causal on its own, padding rows
    zeroed after. ``offsets``: :func:`packed_offsets` of these ids, when the caller computed them
    once for several layers."""
    # a GPU, half precision, no window (called directly: as a run's backend it is refused,
    # CUDNN_PACKED_REFUSED)
    if window is not None:
        raise ConfigError("model.attention: got 'cudnn_packed', which does not compute sliding "
                          "windows")
    _check_explicit("cudnn_packed", q.dtype)
    try:
        # private, and only where this backend runs
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as err:
        # a private module: say so rather than fail obscurely when JAX moves it
        raise RuntimeError(
            f"model.attention='cudnn_packed' needs jax._src.cudnn.fused_attention_stablehlo: {err}")
    seqlen, offsets = packed_offsets(segment_ids, max_segments) if offsets is None else offsets
    out = cudnn.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                      kv_offsets=offsets,
                                      scale=q.shape[-1]**-0.5 if scale is None else scale,
                                      mask_type=cudnn.MaskType.CAUSAL)
    return jnp.where((segment_ids != 0)[:, :, None, None], out, 0).astype(q.dtype)


def _implementation(name: str) -> Callable:
    """The in-tree backends (the kernels are loaded by :func:`_load_kernel`)."""
    return {
        "xla": reference_attention, "cudnn": _cudnn_attention,
        "cudnn_packed": _cudnn_packed_attention
    }[name]
