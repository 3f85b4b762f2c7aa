"""The LM head and cross-entropy, three ways, side by side in one run: memory and time of loss + gradients (JSON).

    python scripts/bench_loss.py [--tokens 8192] [--d-model 768] [--vocab 50304] [--chunk 1024] [--repeats 3]

- ``plain``: seqjax's default path, the whole [tokens, vocab] float32 logits, then ``lm_loss``;
- ``seqjax_chunked``: ``model.loss_chunk_tokens``, :func:`seqjax.model.loss.chunked_lm_loss`;
- ``tokamax_chunked_xla``: tokamax's ``linear_softmax_cross_entropy_loss(..., implementation="chunked_xla")``,
  when tokamax is installed (``pip install tokamax``; it is not a seqjax dependency).

Each is jitted as value_and_grad with respect to the features and the head. Memory is XLA's compiled
memory analysis (temporary bytes: what the computation allocates besides its arguments and outputs); time
is the median of ``--repeats`` runs after one warm-up. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.model.loss import chunked_lm_loss, lm_loss


def implementations(chunk: int) -> dict:
    def plain(x, head, labels):
        return lm_loss(jnp.einsum("nd,dv->nv", x, head, preferred_element_type=jnp.float32)[None], labels[None],
                       jnp.ones_like(labels, jnp.float32)[None])[0]

    def seqjax_chunked(x, head, labels):
        return chunked_lm_loss(x[None], head, labels[None], jnp.ones_like(labels, jnp.float32)[None],
                               chunk_tokens=chunk)[0]

    found = {"plain": plain, "seqjax_chunked": seqjax_chunked}
    try:
        import tokamax  # optional: a peer to compare with, not a dependency
    except ImportError:
        return found

    def tokamax_chunked_xla(x, head, labels):
        return tokamax.linear_softmax_cross_entropy_loss(x, labels, head, reduction="mean",
                                                         implementation="chunked_xla")

    found["tokamax_chunked_xla"] = tokamax_chunked_xla
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    x = jnp.asarray(rng.normal(size=(args.tokens, args.d_model)), dtype)
    head = jnp.asarray(rng.normal(size=(args.d_model, args.vocab)) * 0.02, dtype)
    labels = jnp.asarray(rng.integers(0, args.vocab, args.tokens), jnp.int32)
    rows, reference = [], None
    for name, fn in implementations(args.chunk).items():
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        compiled = step.lower(x, head, labels).compile()
        stats = compiled.memory_analysis()
        loss, grads = jax.block_until_ready(compiled(x, head, labels))  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(x, head, labels))
            times.append(time.perf_counter() - start)
        reference = reference or (float(loss), grads)
        rows.append({
            "implementation": name,
            "temp_bytes": int(stats.temp_size_in_bytes),
            "seconds_median": statistics.median(times),
            "loss": float(loss),
            "max_abs_grad_diff_vs_plain": max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                                             for a, b in zip(grads, reference[1])),
        })
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({
        "bench": "loss", "date": datetime.date.today().isoformat(), "machine": platform.machine(),
        "backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()],
        "tokens": args.tokens, "d_model": args.d_model, "vocab": args.vocab, "chunk": args.chunk,
        "dtype": args.dtype, "full_logits_bytes": args.tokens * args.vocab * 4, "results": rows,
    }))


if __name__ == "__main__":
    main()
