"""Attention kernel speed on a GPU: ms and TFLOP/s, forward and forward+backward, one JSON object per line.

    python scripts/bench_attention.py                      # the full grid (GPU)
    python scripts/bench_attention.py --seq-lens 8192 --head-dims 128 --impls flash,cudnn
    python scripts/bench_attention.py --smoke              # CPU: tiny interpret-mode run, numbers not meaningful

FLOPs (stated in every record): a causal attention forward over one sequence of length L is
``4 * H * L**2 * D / 2`` (two matmuls of 2*L*L*D each, halved because causal keeps half the pairs); the
backward counts as 2.5x the forward, so forward+backward is 3.5x. For a dense row L = T. For packed rows the
useful work is the sum over the row's documents, so records carry both ``flops_dense`` (as if each row were
one document) and ``flops_useful`` (per document); TFLOP/s is useful FLOPs / time.

Inputs, all with batch x T = --tokens (16k) tokens and H x D = --width (2048):
  dense   one document per row (all segment ids 1);
  packed  rows packed with documents of about --doc-len tokens (uniform in [doc_len/4, 7*doc_len/4]), cut at
          row ends, each piece its own segment;
  varlen  the same pieces as separate rows (padded with segment 0 to a 128 multiple, padding tiles skipped):
          the "ideal varlen" time, what flash-attn's cu_seqlens kernel would pay.
Implementations: flash (this repo's kernel), xla (the reference, materialises [B, H, T, T]: may run out of
memory at long T — recorded as an error), cudnn (jax.nn.dot_product_attention, is_causal, no segments: the
dense upper bound, dense input only), bundled (JAX's Pallas GPU mha with segment_ids, causal; it masks but
never skips, so it pays the full triangle on packed rows).

Without a GPU the script prints one JSON object saying so and exits 0 (with --smoke it also times a tiny case
in Pallas interpret mode, flagged ``"meaningful": false``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.model.attention import reference_attention
from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata, full_blocks, visited_blocks
from seqjax.model.kernels.flash import flash_attention

FORMULA = "forward = sum over documents of 4*H*L^2*D/2 (causal); forward+backward = 3.5 x forward (backward = 2.5 x)"
IMPLS = ("flash", "xla", "cudnn", "bundled")
INPUTS = ("dense", "packed", "varlen")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_attention", description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    names = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--seq-lens", type=ints, default=[1024, 2048, 4096, 8192, 16384], help="T values")
    p.add_argument("--tokens", type=int, default=16384, help="batch x T per case")
    p.add_argument("--head-dims", type=ints, default=[64, 128])
    p.add_argument("--width", type=int, default=2048, help="H x D (query heads = width // head_dim)")
    p.add_argument("--kv-heads", type=int, default=None, help="GQA kv heads (default: H; bundled needs H)")
    p.add_argument("--doc-len", type=int, default=512, help="mean document length of the packed input")
    p.add_argument("--impls", type=names, default=list(IMPLS), help=",".join(IMPLS))
    p.add_argument("--inputs", type=names, default=list(INPUTS), help=",".join(INPUTS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    for name in ("block-q", "block-k", "block-q-bwd", "block-k-bwd", "num-warps", "num-stages"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the kernel's BlockSizes.for_head_dim")
    p.add_argument("--smoke", action="store_true", help="off-GPU: a tiny interpret-mode timing (not meaningful)")
    return p.parse_args(argv)


def block_sizes(args, head_dim: int) -> BlockSizes:
    base = BlockSizes.for_head_dim(head_dim)
    fields = {f: getattr(args, f) for f in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "num_warps", "num_stages")}
    return BlockSizes(**{f: getattr(base, f) if v is None else v for f, v in fields.items()})


# ------------------------------------------------------------------------------------------------ inputs


def document_pieces(tokens: int, seq_len: int, doc_len: int, rng: np.random.Generator) -> list[list[int]]:
    """Per row, the lengths of the document pieces packed into it (documents cut at row ends)."""
    rows, row, left = [], [], seq_len
    while len(rows) < tokens // seq_len:
        n = int(rng.integers(doc_len // 4, 7 * doc_len // 4 + 1))
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


def make_input(kind: str, tokens: int, seq_len: int, doc_len: int, rng) -> tuple[np.ndarray, list[int]]:
    """(segment_ids [rows, length], document lengths) for one input kind."""
    if kind == "dense":
        rows = tokens // seq_len
        return np.ones((rows, seq_len), np.int32), [seq_len] * rows
    pieces = document_pieces(tokens, seq_len, doc_len, rng)
    docs = [n for row in pieces for n in row]
    if kind == "packed":
        return segment_rows(pieces, seq_len), docs
    longest = -(-max(docs) // 128) * 128
    return segment_rows([[n] for n in docs], longest), docs


# ------------------------------------------------------------------------------------------------ timing


def attention_fn(impl: str, scale: float, blocks: BlockSizes, interpret: bool):
    """(q, k, v, segment_ids) -> out for one implementation."""
    if impl == "flash":
        return lambda q, k, v, s: flash_attention(q, k, v, s, scale=scale, block_sizes=blocks, interpret=interpret)
    if impl == "xla":
        return lambda q, k, v, s: reference_attention(q, k, v, s, scale=scale)
    if impl == "cudnn":
        return lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
    if impl == "bundled":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as bundled
        return lambda q, k, v, s: bundled.mha(q, k, v, s, sm_scale=scale, causal=True, interpret=interpret)
    raise ValueError(f"--impls: unknown implementation {impl!r}, expected one of {', '.join(IMPLS)}")


def time_ms(fn, args, warmup: int, iters: int) -> float:
    """Median wall time of a jitted call, after compiling and warming up."""
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(attend, q, k, v, segment_ids, warmup, iters) -> dict:
    forward = jax.jit(attend)
    loss = lambda q, k, v, s: attend(q, k, v, s).astype(jnp.float32).sum()  # noqa: E731
    forward_backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return {
        "fwd_ms": time_ms(forward, (q, k, v, segment_ids), warmup, iters),
        "fwd_bwd_ms": time_ms(forward_backward, (q, k, v, segment_ids), warmup, iters),
    }


def case_record(args, impl, kind, seq_len, head_dim, blocks, interpret) -> dict:
    rng = np.random.default_rng(args.seed)
    heads = args.width // head_dim
    kv_heads = args.kv_heads or heads
    segment_ids, docs = make_input(kind, args.tokens, seq_len, args.doc_len, rng)
    rows, length = segment_ids.shape
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(keys[0], (rows, length, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (rows, length, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (rows, length, kv_heads, head_dim), dtype)
    forward_flops = sum(4 * heads * n * n * head_dim / 2 for n in docs)
    record = {
        "impl": impl, "input": kind, "seq_len": seq_len, "rows": rows, "row_length": length, "head_dim": head_dim,
        "heads": heads, "kv_heads": kv_heads, "dtype": args.dtype, "documents": len(docs),
        "flops_dense": 4 * rows * heads * length**2 * head_dim / 2, "flops_useful": forward_flops,
    }
    if impl == "flash":
        metadata = block_metadata(jnp.asarray(segment_ids), blocks)
        n_q, n_k = metadata.fwd_kv.shape[1], metadata.seq_len // blocks.block_k
        visited = int(visited_blocks(metadata.fwd_kv, n_k).sum())
        triangle = sum(min(n_k, -(-(i + 1) * blocks.block_q // blocks.block_k)) for i in range(n_q)) * rows
        unmasked = int(full_blocks(metadata.fwd_kv, n_k).sum())
        record.update(block_sizes=vars(blocks), fwd_tiles_visited=visited, fwd_tiles_unmasked=unmasked,
                      fwd_tiles_causal_triangle=triangle)
    try:
        timings = measure(attention_fn(impl, head_dim**-0.5, blocks, interpret), q, k, v, jnp.asarray(segment_ids),
                          args.warmup, args.iters)
    except Exception as err:  # noqa: BLE001  (an OOM or an unsupported shape is a result to record, not a crash)
        return {**record, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    record.update(timings)
    record["fwd_tflops"] = forward_flops / timings["fwd_ms"] / 1e9
    record["fwd_bwd_tflops"] = 3.5 * forward_flops / timings["fwd_bwd_ms"] / 1e9
    return record


def environment() -> dict:
    device = jax.devices()[0]
    return {
        "bench": "attention", "device": getattr(device, "device_kind", str(device)), "platform": jax.default_backend(),
        "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "command": " ".join(["python", *sys.argv]), "formula": FORMULA,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    env = environment()
    if env["platform"] != "gpu":
        print(json.dumps({**env, "status": "needs_gpu", "reason": (
            f"jax.default_backend() is {env['platform']!r}; the kernel's speed can only be measured on an NVIDIA GPU "
            "(run this script there; --smoke gives a tiny interpret-mode timing here)")}), flush=True)
        if not args.smoke:
            return
        args.seq_lens, args.tokens, args.head_dims, args.width = [64], 128, [64], 128
        args.impls, args.inputs, args.warmup, args.iters = ["flash", "xla"], ["dense", "packed"], 1, 2
        args.doc_len, args.block_q, args.block_k, args.block_q_bwd, args.block_k_bwd = 16, 16, 16, 16, 16
    interpret = env["platform"] != "gpu"
    for head_dim in args.head_dims:
        blocks = block_sizes(args, head_dim)
        for seq_len in args.seq_lens:
            for kind in args.inputs:
                for impl in args.impls:
                    if impl == "cudnn" and kind != "dense":
                        continue  # cuDNN takes no segment ids: it is the dense upper bound only
                    if impl == "bundled" and (kind == "varlen" or (args.kv_heads or 0) not in (0, args.width // head_dim)):
                        continue  # the bundled kernel has no GQA; varlen is this kernel's ideal
                    record = case_record(args, impl, kind, seq_len, head_dim, blocks, interpret)
                    if interpret:
                        record["meaningful"] = False  # Pallas interpret mode on a CPU: correctness path, not speed
                    print(json.dumps({**env, **record}), flush=True)


if __name__ == "__main__":
    main()
