"""Attention kernel speed on a GPU: ms and TFLOP/s, forward and forward+backward, one JSON object per line.

    python scripts/bench_attention.py                      # the full grid (GPU)
    python scripts/bench_attention.py --seq-lens 8192 --head-dims 128 --impls flash,cudnn
    python scripts/bench_attention.py --levanter           # B=1, S=8192, 32/8 heads, D=128, 256-token documents
    python scripts/bench_attention.py --sweep "128,64,64,64,8,2 128,128,64,128,8,3" --seq-lens 8192
    python scripts/bench_attention.py --smoke              # CPU: tiny interpret-mode run, numbers not meaningful

FLOPs (stated in every record): a causal attention forward over one sequence of length L is
``4 * H * L**2 * D / 2`` (two matmuls of 2*L*L*D each, halved because causal keeps half the pairs); the
backward counts as 2.5x the forward, so forward+backward is 3.5x. For a dense row L = T. For packed rows the
useful work is the sum over the row's documents, so records carry both ``flops_dense`` (as if each row were
one document) and ``flops_useful`` (per document); TFLOP/s is useful FLOPs / time.

Inputs, all with batch x T = --tokens (16k) tokens and H x D = --width (2048):
  dense   one document per row (all segment ids 1);
  packed  rows packed with documents of about --doc-len tokens (uniform in [doc_len/4, 7*doc_len/4], or exactly
          doc_len with --fixed-doc-len), cut at row ends, each piece its own segment;
  varlen  the same pieces as separate rows (padded with segment 0 to a 128 multiple, padding tiles skipped):
          the "ideal varlen" time, what flash-attn's cu_seqlens kernel would pay.

Implementations (what a user would otherwise pick, side by side):
  flash       seqjax's Pallas kernel (Triton lowering), block ranges from the segment ids;
  xla         the reference: materialises [B, H, T, T] (may run out of memory at long T: recorded as an error);
  cudnn       jax.nn.dot_product_attention(implementation="cudnn", is_causal=True), no segments: the dense upper
              bound, dense input only;
  cudnn_mask  cuDNN with the dense [B, 1, T, T] segment mask: what a user without a segment-aware kernel does;
  bundled     JAX's bundled Pallas GPU mha with segment_ids (masks but never skips a tile; no GQA);
  kvax        kvax's Triton kernel (segment ids + positions, block masks that skip empty tiles);
  tokamax     tokamax's Pallas Mosaic GPU kernel with k_start masks (per-query first allowed key) and causal;
  mgpu_fa3    JAX's bundled Pallas Mosaic GPU FlashAttention-3 (warp-specialized, wgmma + TMA), causal, no
              segments, float16: what Mosaic GPU reaches on dense rows (forward only: its causal backward is
              not implemented). On the H100 of 2026-11-23 its causal output disagreed with every other
              kernel (rel_err_vs_flash 6-21), so its times are not comparable; kept for the next jax.
The peers are imported only when asked for; one that does not import is recorded with the reason. Three shims
let the released peers import on this jax, none of which touches their kernels: kvax 0.1.0 reads a type alias
``jax.experimental.shard_map.Specs`` that jax 0.11 dropped (set to ``typing.Any``) and calls
``jax_triton.cdiv``, which jax-triton 0.4 dropped (ceil division); tokamax imports ``xprof`` for its own
benchmarking helpers only (a stub module when xprof is absent).

Per-call preparation (seqjax's block metadata, kvax's block masks, tokamax's k_start, cuDNN's dense mask) is
computed once per batch in a model, so it is timed separately (``prep_ms``), not inside the kernel's time.
Each record also carries ``rel_err_vs_flash``: ||out - flash|| / ||flash|| over real (non-padding) queries, so
a peer that computes a different function is visible.

Without a GPU the script prints one JSON object saying so and exits 0 (with --smoke it also times a tiny case
in Pallas interpret mode, flagged ``"meaningful": false``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import sys
import time
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.model.attention import _cudnn_attention, _cudnn_packed_attention, packed_offsets, reference_attention
from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata, full_blocks, visited_blocks
from seqjax.model.kernels.flash import flash_attention
from seqjax.model.kernels.mosaic import mosaic_attention, mosaic_blocks

FORMULA = "forward = sum over documents of 4*H*L^2*D/2 (causal); forward+backward = 3.5 x forward (backward = 2.5 x)"
# the Mosaic kernel's variants: (slots, consumers, overlap, key_block) (seqjax.model.kernels.mosaic.Variant)
MOSAIC_VARIANTS = {"mosaic": (2, 1, False, 64), "mosaic_s3": (3, 1, False, 64), "mosaic_s4": (4, 1, False, 64),
                   "mosaic_pp": (2, 2, False, 64), "mosaic_pp_s3": (3, 2, False, 64), "mosaic_ov": (2, 1, True, 64),
                   "mosaic_pp_ov": (2, 2, True, 64), "mosaic_k128": (2, 1, False, 128),
                   "mosaic_pp_ov_k128": (2, 2, True, 128)}
IMPLS = ("flash", *MOSAIC_VARIANTS, "xla", "cudnn", "cudnn_mask", "cudnn_packed", "cudnn_packed_t",
         "bundled", "kvax", "tokamax", "mgpu_fa3")
INPUTS = ("dense", "packed", "varlen")
BLOCK_FIELDS = ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps", "num_stages", "block_q_dq",
                "block_k_dq", "num_warps_bwd", "num_stages_bwd")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_attention", description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    names = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--seq-lens", type=ints, default=[1024, 2048, 4096, 8192, 16384], help="T values")
    p.add_argument("--tokens", type=int, default=16384, help="batch x T per case")
    p.add_argument("--head-dims", type=ints, default=[64, 128])
    p.add_argument("--width", type=int, default=2048, help="H x D (query heads = width // head_dim)")
    p.add_argument("--heads", type=int, default=None, help="query heads (overrides --width)")
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: H; bundled needs H)")
    p.add_argument("--doc-len", type=int, default=512, help="mean document length of the packed input")
    p.add_argument("--fixed-doc-len", action="store_true", help="every document exactly --doc-len tokens")
    p.add_argument("--impls", type=names, default=list(IMPLS), help=",".join(IMPLS))
    p.add_argument("--inputs", type=names, default=list(INPUTS), help=",".join(INPUTS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10, help="calls per timed repeat (dispatched back to back)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--levanter", action="store_true",
                   help="Levanter's shape: B=1, S=8192, 32 query heads, 8 kv heads, D=128, 256-token documents")
    p.add_argument("--sweep", default=None,
                   help="flash only: space-separated configs, each comma-separated field=value pairs over "
                        "BlockSizes.for_head_dim, e.g. 'num_stages=3 block_k=128,num_warps=8'")
    p.add_argument("--out", type=Path, default=None, help="also append each record to this JSONL file")
    for name in BLOCK_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help="override the kernel's BlockSizes.for_head_dim")
    p.add_argument("--smoke", action="store_true", help="off-GPU: a tiny interpret-mode timing (not meaningful)")
    args = p.parse_args(argv)
    if args.levanter:
        args.seq_lens, args.tokens, args.head_dims, args.heads, args.kv_heads = [8192], 8192, [128], 32, 8
        args.doc_len, args.fixed_doc_len, args.inputs = 256, True, ["packed", "varlen"]
    return args


def block_sizes(args, head_dim: int, **changes: int) -> BlockSizes:
    """BlockSizes.for_head_dim with the command line's overrides, then ``changes``."""
    base = dataclasses.asdict(BlockSizes.for_head_dim(head_dim))
    if base["block_q_dq"] == base["block_q_bwd"] and base["block_k_dq"] == base["block_k_bwd"]:
        base["block_q_dq"] = base["block_k_dq"] = None  # dQ keeps following the dK/dV tiles unless set
    base.update({f: getattr(args, f) for f in BLOCK_FIELDS if getattr(args, f) is not None}, **changes)
    return BlockSizes(**base)


def sweep_configs(args, head_dim: int, spec: str) -> list[BlockSizes]:
    """'num_stages=3 block_k=128,num_warps=8' -> one BlockSizes per space-separated group ('default' = none)."""
    configs = []
    for group in spec.split():
        pairs = [item.split("=") for item in group.split(",") if item != "default"]
        unknown = [k for k, _ in pairs if k not in BLOCK_FIELDS]
        if unknown:
            raise SystemExit(f"--sweep: unknown field(s) {unknown}; expected among {', '.join(BLOCK_FIELDS)}")
        configs.append(block_sizes(args, head_dim, **{k: int(v) for k, v in pairs}))
    return configs


# ------------------------------------------------------------------------------------------------ inputs


def document_pieces(tokens: int, seq_len: int, doc_len: int, rng: np.random.Generator, fixed: bool = False):
    """Per row, the lengths of the document pieces packed into it (documents cut at row ends)."""
    rows, row, left = [], [], seq_len
    while len(rows) < tokens // seq_len:
        n = doc_len if fixed else int(rng.integers(doc_len // 4, 7 * doc_len // 4 + 1))
        while n > 0 and len(rows) < tokens // seq_len:
            piece = min(n, left)
            row.append(piece)
            n, left = n - piece, left - piece
            if left == 0:
                rows.append(row)
                row, left = [], seq_len
    return rows


def segment_rows(pieces: list[list[int]], seq_len: int) -> np.ndarray:
    out = np.zeros((len(pieces), seq_len), np.int32)
    for r, lengths in enumerate(pieces):
        ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)
        out[r, : len(ids)] = ids
    return out


def make_input(kind: str, tokens: int, seq_len: int, doc_len: int, rng, fixed: bool = False):
    """(segment_ids [rows, length], document lengths) for one input kind."""
    if kind == "dense":
        rows = tokens // seq_len
        return np.ones((rows, seq_len), np.int32), [seq_len] * rows
    pieces = document_pieces(tokens, seq_len, doc_len, rng, fixed)
    docs = [n for row in pieces for n in row]
    if kind == "packed":
        return segment_rows(pieces, seq_len), docs
    longest = -(-max(docs) // 128) * 128
    return segment_rows([[n] for n in docs], longest), docs


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T]: the index of the first token of each token's segment (contiguous runs)."""
    t = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    change = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return jax.lax.cummax(jnp.where(change, index, 0), axis=1)


# ------------------------------------------------------------------------------------------------ implementations


class Unavailable(Exception):
    """A peer that does not import or does not take these inputs: recorded, not fatal."""


def implementation(impl: str, scale: float, blocks: BlockSizes, interpret: bool, segment_ids: jax.Array):
    """(prepare, attend): ``prepare(segment_ids) -> aux`` (timed apart), ``attend(q, k, v, aux) -> out``."""
    if impl == "flash":
        return (lambda s: (s, block_metadata(s, blocks)),
                lambda q, k, v, a: flash_attention(q, k, v, a[0], scale=scale, metadata=a[1], interpret=interpret))
    if impl in MOSAIC_VARIANTS:  # seqjax's Mosaic GPU kernel: 64 x 64 tiles, the same ranges; _s3, _s4: the
        # deeper TMA pipelines, _pp: two consumers in ping-pong, _ov: the softmax overlapped with the next QK^T,
        # _k128: 128-key forward tiles
        slots, consumers, overlap, key_block = MOSAIC_VARIANTS[impl]
        return (lambda s: (s, block_metadata(s, mosaic_blocks(key_block))),
                lambda q, k, v, a: mosaic_attention(q, k, v, a[0], scale=scale, metadata=a[1], interpret=interpret,
                                                    slots=slots, consumers=consumers, overlap=overlap,
                                                    key_block=key_block))
    if impl in ("cudnn_packed", "cudnn_packed_t"):  # cuDNN's packed layout: offsets computed once per batch
        # M, the most segments a row may hold: the batch's own most (what data.max_segments_per_row gives a run),
        # or T (cudnn_packed_t: what model.attention=cudnn_packed passed on the H200, 2026-11-27, where the
        # backward asked for 1.02 TiB and the forward ran at a quarter of cuDNN's dense speed)
        ids = np.asarray(segment_ids)
        starts = (ids != 0) & np.concatenate([np.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
        m = ids.shape[1] if impl == "cudnn_packed_t" else max(1, int(starts.sum(1).max()))
        return (lambda s: (s, packed_offsets(s, m))), (lambda q, k, v, a: _cudnn_packed_attention(
            q, k, v, a[0], scale=scale, offsets=a[1]))
    if impl == "xla":
        return (lambda s: s), (lambda q, k, v, s: reference_attention(q, k, v, s, scale=scale))
    if impl == "cudnn":
        return (lambda s: s), (lambda q, k, v, s: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn"))
    if impl == "cudnn_mask":
        return (lambda s: s), (lambda q, k, v, s: _cudnn_attention(q, k, v, s, scale=scale))
    if impl == "bundled":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as bundled
        return (lambda s: s), (lambda q, k, v, s: bundled.mha(q, k, v, s, sm_scale=scale, causal=True,
                                                             interpret=interpret))
    if impl == "kvax":
        return kvax_implementation(scale)
    if impl == "tokamax":
        return tokamax_implementation(scale)
    if impl == "mgpu_fa3":
        try:
            from jax.experimental.pallas.ops.gpu import attention_mgpu
        except Exception as err:  # noqa: BLE001
            raise Unavailable(f"JAX's Mosaic GPU attention does not import: {type(err).__name__}: {err}") from err
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        # Its scale is fixed at D**-0.5 (the default every case uses); it stages tiles as float16 (see case_record).
        return (lambda s: s), (lambda q, k, v, s: attention_mgpu.attention(q, k, v, config))
    raise ValueError(f"--impls: unknown implementation {impl!r}, expected one of {', '.join(IMPLS)}")


def kvax_implementation(scale: float):
    """kvax: segment ids (padding = -1) and per-segment positions; block masks built once per batch."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import jax.experimental.shard_map as legacy_shard_map

            if not hasattr(legacy_shard_map, "Specs"):  # a type alias kvax 0.1.0 reads; gone from jax 0.11
                legacy_shard_map.Specs = typing.Any
            import jax_triton

            if not hasattr(jax_triton, "cdiv"):  # kvax 0.1.0 calls jax_triton.cdiv, gone from jax-triton 0.4
                jax_triton.cdiv = lambda a, b: -(-a // b)
            import kvax.ops as kvax_ops
            from kvax.utils import attention_specs
            from kvax.utils.common import get_default_flash_attention_params as kvax_defaults
    except Exception as err:  # noqa: BLE001  (a peer that does not import is a result to record)
        raise Unavailable(f"kvax does not import: {type(err).__name__}: {err}") from err
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1), ("data",))
    specs = dict(query_specs=("data", None, None, None), kv_specs=("data", None, None, None))

    def prepare(s):
        ids = jnp.where(s == 0, -1, s - 1)
        pos = jnp.arange(s.shape[1])[None, :] - segment_starts(s)
        with warnings.catch_warnings(), attention_specs(**specs):
            warnings.simplefilter("ignore", DeprecationWarning)
            # kvax 0.1.0 reads bwd_params without filling in its default when calc_bwd_mask=True: pass both.
            masks = kvax_ops.create_attention_mask(
                pos, ids, pos, ids, fwd_params=kvax_defaults(backward=False), bwd_params=kvax_defaults(backward=True),
                calc_bwd_mask=True, mesh=mesh)
        return ids, pos, masks

    def attend(q, k, v, aux):
        ids, pos, masks = aux
        with warnings.catch_warnings(), attention_specs(**specs):
            warnings.simplefilter("ignore", DeprecationWarning)
            return kvax_ops.flash_attention(q, k, v, pos, ids, pos, ids, masks, scale=scale,
                                            fwd_params=kvax_defaults(backward=False),
                                            bwd_params=kvax_defaults(backward=True),
                                            assume_sequential_positions=True, mesh=mesh)

    return prepare, attend


def tokamax_implementation(scale: float):
    """tokamax's Mosaic GPU kernel: causal plus k_start (each query's segment start), which skips empty tiles."""
    try:
        import importlib.machinery
        import importlib.util

        if "xprof" not in sys.modules and importlib.util.find_spec("xprof") is None:
            for name in ("xprof", "xprof.cli", "xprof.cli.tools"):  # only tokamax's benchmarking helpers use it
                sys.modules[name] = types.ModuleType(name)
                sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
        from tokamax._src.ops.attention import base as tokamax_base
        from tokamax._src.ops.attention import pallas_mosaic_gpu
    except Exception as err:  # noqa: BLE001
        raise Unavailable(f"tokamax (Mosaic GPU) does not import: {type(err).__name__}: {err}") from err
    op = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()

    def prepare(s):
        # Padding queries start past the end: they see no key (their output is not compared).
        return jnp.where(s == 0, s.shape[1], segment_starts(s))[:, None, :]

    def attend(q, k, v, k_start):
        return op(q, k, v, mask=tokamax_base.Mask(k_start=k_start, is_causal=True), logits_scale=scale)

    return prepare, attend


# ------------------------------------------------------------------------------------------------ timing


def time_ms(fn: Callable, args: tuple, warmup: int, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (dispatch overlapped)."""
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def relative_error(out, want, real) -> float:
    diff = jnp.where(real[:, :, None, None], out.astype(jnp.float32) - want.astype(jnp.float32), 0.0)
    ref = jnp.where(real[:, :, None, None], want.astype(jnp.float32), 0.0)
    return float(jnp.linalg.norm(diff) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


# The flash output of each (input, T, D) case, run first, which the peers' outputs are compared with.
_FLASH_OUT: dict[tuple, jax.Array] = {}


def case_record(args, impl, kind, seq_len, head_dim, blocks, interpret) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    heads = args.heads or args.width // head_dim
    kv_heads = args.kv_heads or heads
    segment_ids, docs = make_input(kind, args.tokens, seq_len, args.doc_len, rng, args.fixed_doc_len)
    rows, length = segment_ids.shape
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(keys[0], (rows, length, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (rows, length, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (rows, length, kv_heads, head_dim), dtype)
    if impl == "mgpu_fa3":  # JAX's Mosaic GPU FA3 stages q/k/v in float16 shared memory: give it float16
        q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
    forward_flops = sum(4 * heads * n * n * head_dim / 2 for n in docs)
    record: dict[str, Any] = {
        "impl": impl, "input": kind, "seq_len": seq_len, "rows": rows, "row_length": length, "head_dim": head_dim,
        "heads": heads, "kv_heads": kv_heads, "dtype": jnp.dtype(q.dtype).name, "documents": len(docs),
        "doc_len": args.doc_len if kind != "dense" else seq_len, "fixed_doc_len": bool(args.fixed_doc_len),
        "flops_dense": 4 * rows * heads * length**2 * head_dim / 2, "flops_useful": forward_flops,
    }
    segs = jnp.asarray(segment_ids)
    if impl == "flash":
        metadata = block_metadata(segs, blocks)
        n_q, n_k = metadata.fwd_kv.shape[1], metadata.seq_len // blocks.block_k
        triangle = sum(min(n_k, -(-(i + 1) * blocks.block_q // blocks.block_k)) for i in range(n_q)) * rows
        record.update(block_sizes=dataclasses.asdict(blocks),
                      fwd_tiles_visited=int(visited_blocks(metadata.fwd_kv, n_k).sum()),
                      fwd_tiles_unmasked=int(full_blocks(metadata.fwd_kv, n_k).sum()),
                      fwd_tiles_causal_triangle=triangle)
    try:
        prepare, attend = implementation(impl, head_dim**-0.5, blocks, interpret, segs)
        prepare = jax.jit(prepare)
        aux = jax.block_until_ready(prepare(segs))
        record["prep_ms"] = time_ms(prepare, (segs,), 1, args.iters, args.repeats)
        forward = jax.jit(attend)
        record["fwd_ms"] = time_ms(forward, (q, k, v, aux), args.warmup, args.iters, args.repeats)
        out = forward(q, k, v, aux)
        if impl == "flash":
            _FLASH_OUT[(kind, seq_len, head_dim)] = out
        elif (kind, seq_len, head_dim) in _FLASH_OUT:
            record["rel_err_vs_flash"] = relative_error(out, _FLASH_OUT[(kind, seq_len, head_dim)], segs != 0)
        del out
    except Unavailable as err:
        return {**record, "error": str(err)}
    except Exception as err:  # noqa: BLE001  (an OOM or an unsupported shape is a result to record, not a crash)
        return {**record, "error": _one_line(err)}
    record["fwd_tflops"] = forward_flops / record["fwd_ms"] / 1e9
    try:
        loss = lambda q, k, v, a: attend(q, k, v, a).astype(jnp.float32).sum()  # noqa: E731
        forward_backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        record["fwd_bwd_ms"] = time_ms(forward_backward, (q, k, v, aux), args.warmup, args.iters, args.repeats)
    except Exception as err:  # noqa: BLE001  (a forward-only peer still has its forward figures)
        return {**record, "fwd_bwd_error": _one_line(err)}
    record["fwd_bwd_tflops"] = 3.5 * forward_flops / record["fwd_bwd_ms"] / 1e9
    return record


def _one_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
def environment() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "bench": "attention", "device": getattr(device, "device_kind", str(device)), "platform": jax.default_backend(),
        "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "command": " ".join(["python", *sys.argv]), "formula": FORMULA,
    }


def skip_reason(impl: str, kind: str, heads: int, kv_heads: int, head_dim: int = 64, seq_len: int = 8192
                ) -> str | None:
    """Why a combination is not run (None: run it)."""
    if impl in MOSAIC_VARIANTS and MOSAIC_VARIANTS[impl][1] == 2 and seq_len % 128:
        return "two consumers take two 64-query blocks a CTA: T a multiple of 128"
    if impl == "cudnn" and kind != "dense":
        return "cuDNN without a mask takes no segment ids: it is the dense upper bound only"
    if impl == "bundled" and (kind == "varlen" or kv_heads != heads):
        return "the bundled kernel has no GQA; varlen is seqjax's ideal"
    if impl in MOSAIC_VARIANTS and head_dim not in (64, 128):
        return "the Mosaic kernel's wgmma tiles take D = 64 or 128"
    if impl in ("xla", "cudnn_mask", "cudnn_packed", "cudnn_packed_t", *MOSAIC_VARIANTS, "kvax", "tokamax",
                "mgpu_fa3") and \
            kind == "varlen":
        return "varlen is the ideal of seqjax's kernel on separate rows"
    if impl == "mgpu_fa3" and kind != "dense":
        return "JAX's Mosaic GPU FA3 takes no segment ids: dense only"
    return None


def main(argv=None) -> None:
    args = parse_args(argv)
    env = environment()
    if env["platform"] != "gpu":
        print(json.dumps({**env, "status": "needs_gpu", "reason": (
            f"jax.default_backend() is {env['platform']!r}; the kernel's speed can only be measured on an NVIDIA GPU "
            "(run this script there; --smoke gives a tiny interpret-mode timing here)")}), flush=True)
        if not args.smoke:
            return
        args.seq_lens, args.tokens, args.head_dims, args.width, args.heads = [64], 128, [64], 128, None
        args.impls = [i for i in args.impls if i in ("flash", *MOSAIC_VARIANTS, "xla")] or ["flash"]
        args.inputs, args.warmup, args.iters, args.repeats = ["dense", "packed"], 1, 1, 1
        args.doc_len, args.block_q, args.block_k, args.block_q_bwd, args.block_k_bwd = 16, 16, 16, 16, 16
        if args.sweep:
            args.sweep = "default num_stages=1"
    interpret = env["platform"] != "gpu"
    out = args.out.open("a") if args.out else None
    for head_dim in args.head_dims:
        configs = sweep_configs(args, head_dim, args.sweep) if args.sweep else [block_sizes(args, head_dim)]
        impls = ["flash"] if args.sweep else args.impls
        heads = args.heads or args.width // head_dim
        kv_heads = args.kv_heads or heads
        for seq_len in args.seq_lens:
            for kind in args.inputs:
                for blocks in configs:
                    for impl in impls:
                        if skip_reason(impl, kind, heads, kv_heads, head_dim, seq_len):
                            continue
                        record = {**env, **case_record(args, impl, kind, seq_len, head_dim, blocks, interpret)}
                        if args.sweep:
                            record["sweep"] = True
                        if interpret:
                            record["meaningful"] = False  # Pallas interpret mode on a CPU: correctness path only
                        line = json.dumps(record)
                        print(line, flush=True)
                        if out:
                            out.write(line + "\n")
                            out.flush()


if __name__ == "__main__":
    main()
