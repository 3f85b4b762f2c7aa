"""Whether a compiler keeps more than a rematerialized block's input when the block holds a ``lax.scan`` (JSON).

    python scripts/probe_scan_remat.py                  # this machine's default backend
    JAX_PLATFORMS=cpu python scripts/probe_scan_remat.py

Qwen3.5-9B's plan at 32k tokens (BENCHMARKS.md, "Qwen3.5") came out at 155.5 GB where every block is
rematerialized: each Gated DeltaNet layer kept about 139 KB a token beyond its input. The cause reproduces on a
toy: layers ``x + f(x) @ w.T`` under ``jax.checkpoint``, f a scan over chunks of the row, or the same arithmetic
without the scan. Under remat a layer should keep its input alone (``x_bytes_per_token``); the script reports
what the compiled gradient's temporaries grow by per layer and token, both ways, from 1 to 4 layers.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp


def layer(scan: bool, tokens: int, width: int):
    def f(x, w):
        chunks = jnp.tanh(x @ w).reshape(tokens // 64, 64, width)
        if scan:
            def step(s, xs):
                s = s * 0.9 + xs.sum(0)
                return s, xs * s

            _, out = jax.lax.scan(step, jnp.zeros(width, x.dtype), chunks)
        else:
            out = chunks * jnp.cumsum(chunks.sum(1), 0)[:, None]
        return x + out.reshape(1, tokens, width) @ w.T

    return jax.checkpoint(f)


def temp_bytes(layers: int, scan: bool, tokens: int, width: int) -> int:
    weights = [jnp.full((width, width), 0.01) for _ in range(layers)]
    block = layer(scan, tokens, width)

    def loss(ws, x):
        for w in ws:
            x = block(x, w)
        return x.sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weights, jnp.ones((1, tokens, width))).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    result = {"backend": jax.default_backend(), "tokens": args.tokens, "width": args.width,
              "x_bytes_per_token": 4 * args.width}
    for scan in (True, False):
        one, four = (temp_bytes(n, scan, args.tokens, args.width) for n in (1, 4))
        result["with_scan" if scan else "without_scan"] = {
            "temp_bytes_1_layer": one, "temp_bytes_4_layers": four,
            "kept_bytes_per_layer_and_token": round((four - one) / 3 / args.tokens, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
