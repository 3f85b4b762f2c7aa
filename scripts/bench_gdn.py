"""Gated DeltaNet's two forms against attention at one shape (JSON lines): the chunked form (training, prefill),
the recurrent form (token by token, decoding's) and softmax attention over the same packed rows.

    python scripts/bench_gdn.py --seq-lens 512,2048 --out gdn.jsonl                # the CPU, float32
    python scripts/bench_gdn.py --seq-lens 4096,16384 --dtype bfloat16 --pallas     # a GPU (the GPU suite's gdn stage)
    python scripts/bench_gdn.py --seq-lens 2048 --shared-prompt 128,8,96             # a GRPO row: the prompt once

The shape is Qwen3.5's linear layer: ``--key-heads`` query/key heads and ``--heads`` value heads of 128, the
rows packed with documents of ``--doc-len`` tokens (segment ids, so the resets are in the work). Attention runs
at the same token count with ``--heads`` heads of ``--attn-head-dim`` (256, Qwen3.5's gated attention) and
``--attn-kv-heads`` key/value heads, on seqjax's backend ``--attention`` (xla: the masked softmax; pallas:
the flash kernel). Each row: forward and forward+backward milliseconds (median of ``--repeats`` runs of
``--iters`` calls each, after a compile), tokens a second, and for the chunked form its largest difference
from the recurrent one (float32 rounding: the same numbers). ``--shared-prompt P,G,C`` lays the rows out as
GRPO's prompt-once rows instead (groups of a P-token prompt and G completions of C tokens, each completion
entering with its prompt's final state) and times the two forms of that rule (chunked_prompt_rule against
the token-by-token prompt_rule), without attention. ``--pallas`` adds the chunked form with its scan over
chunks in the Pallas kernel (``gdn_pallas``: model.deltanet.kernel=pallas; compiled on a GPU, interpreted
elsewhere, which is slow). The last line is a summary object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn, args, iters: int, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # (the compile)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(runs)


def inputs(args, t: int, seed: int = 0):
    """Qwen3.5's linear-layer inputs for one row of ``t`` tokens: q, k [1, T, Hk, 128], v [1, T, H, 128], the
    decay g and beta [1, T, H], documents of ``args.doc_len`` tokens."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 5)
    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], (1, t, args.key_heads, 128), dtype)
    k = jax.random.normal(keys[1], (1, t, args.key_heads, 128), dtype)
    v = jax.random.normal(keys[2], (1, t, args.heads, 128), dtype)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (1, t, args.heads))) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, args.heads)))
    segment_ids = (jnp.arange(t)[None] // args.doc_len + 1).astype(jnp.int32)
    return q, k, v, g, beta, segment_ids


def shared_rows(t: int, spec: str):
    """(segment ids, prefix ids) [1, T] of prompt-once rows: groups of a P-token prompt and G completions of C
    tokens (``spec`` "P,G,C"), as many as fit, the rest padding."""
    import numpy as np

    prompt, group, completion = (int(n) for n in spec.split(","))
    seg, prefix = np.zeros((1, t), np.int32), np.zeros((1, t), np.int32)
    place, number = 0, 0
    while place + prompt + group * completion <= t:
        number += 1
        first = number
        seg[0, place:place + prompt] = first
        place += prompt
        for _ in range(group):
            number += 1
            seg[0, place:place + completion], prefix[0, place:place + completion] = number, first
            place += completion
    return seg, prefix


def measure(args, t: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from seqjax.model.attention import attention
    from seqjax.model.delta_rule import chunked_prompt_rule, chunked_rule, prompt_rule, recurrent_rule

    q, k, v, g, beta, seg = inputs(args, t)
    rules = {"chunked": lambda *a: chunked_rule(*a, chunk=args.chunk)[0], "recurrent": lambda *a: recurrent_rule(*a)[0]}
    if args.pallas:
        rules["pallas"] = lambda *a: chunked_rule(*a, chunk=args.chunk, kernel="pallas")[0]
    if args.shared_prompt:
        seg, prefix = (jnp.asarray(a) for a in shared_rows(t, args.shared_prompt))
        rules = {"chunked": lambda *a: chunked_prompt_rule(*a, prefix, chunk=args.chunk)[0],
                 "recurrent": lambda *a: prompt_rule(*a, prefix)[0]}
    out, rows = {}, []
    for name, rule in rules.items():
        forward = jax.jit(rule)
        backward = jax.jit(jax.grad(lambda q, k, v, g, beta, s, rule=rule: jnp.sum(
            rule(q, k, v, g, beta, s).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
        operands = (q, k, v, g, beta, seg)
        out[name] = forward(*operands)
        fwd = _timed(forward, operands, args.iters, args.repeats)
        bwd = _timed(backward, operands, args.iters, args.repeats)
        impl = f"gdn_prompt_{name}" if args.shared_prompt else f"gdn_{name}"
        rows.append({"impl": impl, "seq_len": t, "fwd_ms": round(fwd, 3), "fwd_bwd_ms": round(bwd, 3),
                     "fwd_tokens_per_s": round(t / fwd * 1e3, 1), "fwd_bwd_tokens_per_s": round(t / bwd * 1e3, 1)})
    for row, name in zip(rows, rules):
        if name != "recurrent":
            row["max_abs_diff_vs_recurrent"] = float(jnp.max(jnp.abs(out[name].astype(jnp.float32)
                                                                     - out["recurrent"].astype(jnp.float32))))
    if args.shared_prompt:
        return rows
    keys = jax.random.split(jax.random.key(1), 3)
    dtype = jnp.dtype(args.dtype)
    aq = jax.random.normal(keys[0], (1, t, args.heads // 2, args.attn_head_dim), dtype)
    ak = jax.random.normal(keys[1], (1, t, args.attn_kv_heads, args.attn_head_dim), dtype)
    av = jax.random.normal(keys[2], (1, t, args.attn_kv_heads, args.attn_head_dim), dtype)

    def attend(q, k, v, s):
        return attention(q, k, v, s, backend=args.attention)

    forward = jax.jit(attend)
    backward = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(attend(q, k, v, s).astype(jnp.float32) ** 2),
                                argnums=(0, 1, 2)))
    fwd = _timed(forward, (aq, ak, av, seg), args.iters, args.repeats)
    bwd = _timed(backward, (aq, ak, av, seg), args.iters, args.repeats)
    rows.append({"impl": f"attention_{args.attention}", "seq_len": t, "fwd_ms": round(fwd, 3),
                 "fwd_bwd_ms": round(bwd, 3), "fwd_tokens_per_s": round(t / fwd * 1e3, 1),
                 "fwd_bwd_tokens_per_s": round(t / bwd * 1e3, 1)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="512,2048")
    p.add_argument("--heads", type=int, default=32, help="value heads (Qwen3.5-9B: 32)")
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--attn-head-dim", type=int, default=256)
    p.add_argument("--attn-kv-heads", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=300, help="tokens a packed document holds")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="xla", help="seqjax's attention backend for the comparison")
    p.add_argument("--pallas", action="store_true", help="also the chunked form with the Pallas scan")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shared-prompt", default=None, metavar="P,G,C",
                   help="prompt-once rows: groups of a P-token prompt and G completions of C tokens")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    import jax

    rows = []
    for t in (int(n) for n in args.seq_lens.split(",")):
        for row in measure(args, t):
            row |= {"dtype": args.dtype, "heads": args.heads, "key_heads": args.key_heads, "doc_len": args.doc_len,
                    "chunk": args.chunk, "shared_prompt": args.shared_prompt, "backend": jax.default_backend()}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = {"rows": len(rows), "devices": [str(d) for d in jax.devices()],
               "date": time.strftime("%Y-%m-%d"), "argv": argv if argv is not None else sys.argv[1:]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
