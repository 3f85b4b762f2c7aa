"""Run by tests/test_context.py in a subprocess with 8 forced host devices: attention over a row split
on mesh.context = 2, 4 and 8 (all_gather and ring) against one device, outputs and dQ/dK/dV, under
hypothesis-drawn packings. Prints one JSON line of what it checked; any mismatch raises.

``context_cases.py EXAMPLES pallas``: the flash kernel's spans (interpret mode) on mesh.context = 2
and 4, both paths, rows of 128 tokens (its tiles are at least 16 tokens, and a device holds two
chunks of T / 2n), against the kernel on one whole row; and a 2-layer model with a sliding layer
on mesh.context = 2 against xla on one device."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from seqjax.config.tree import MeshConfig
from seqjax.model import context, sharding
from seqjax.model.attention import attention
from seqjax.model.context import SplitRow, balanced_order, inverse_order
from seqjax.model.mask import FULL

KERNEL = sys.argv[2] if len(sys.argv) > 2 else "xla"
B, T, H, HKV, D = 2, 128 if KERNEL == "pallas" else 64, 4, 2, 8
TOLERANCE = 1e-6  # of each array's largest magnitude, float32
# (the kernel skips a window of 1: each query's one key leaves dQ zero in exact arithmetic, and the
# kernel's float32 noise there, 4e-6 on one device or split, is all there is to compare)
WINDOWS = (None, 2, 5, 17) if KERNEL == "pallas" else (None, 1, 5, 17)
checked: list[dict] = []
# a shard's queries in chunks of 8 (as a long row's go in chunks of 1,024): 32 and 16 queries a device
# take the chunked path on 2 and 4 devices, 8 on 8 the whole one
context.QUERY_CHUNK = 8


def one_device(q, k, v, seg, window, prefix, positions):
    """The same backend over one whole row (the kernel's own float32 noise is no split's error: with a
    window of 1, dQ is zero in exact arithmetic, and flash leaves 1e-6 of noise there on any layout)."""
    return attention(q, k, v, seg, backend=KERNEL, window=window, prefix_ids=prefix, positions=positions)


def make_split(n: int, strategy: str):
    mesh = sharding.build_mesh(MeshConfig(data=8 // n, fsdp=1, context=n, tensor=1))
    rows = ("data",) if 8 // n > 1 and B % (8 // n) == 0 else None  # (rows whole where they do not split)
    order, inverse = balanced_order(T, n), inverse_order(balanced_order(T, n))
    split = SplitRow(mesh.abstract_mesh, n, T, rows, None, strategy, KERNEL)

    def run(q, k, v, seg, window, prefix, positions):
        moved = [None if a is None else a[:, order] for a in (q, k, v, seg, prefix, positions)]
        out = attention(*moved[:4], window=window, metadata=split, prefix_ids=moved[4], positions=moved[5])
        return out[:, inverse]

    return mesh, run


MESHES = {(n, s): make_split(n, s) for n in ((2, 4) if KERNEL == "pallas" else (2, 4, 8))
          for s in ("all_gather", "ring")}


def value_and_grads(fn, args, cotangent):
    q, k, v, *rest = args
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
    return (out, *pull(cotangent))


COMPILED: dict = {}


def compiled(key, fn):
    """One jitted (output, dq, dk, dv) program per mesh and mask form, reused across draws."""
    if key not in COMPILED:
        COMPILED[key] = jax.jit(lambda args, cot: value_and_grads(fn, args, cot))
    return COMPILED[key]


@st.composite
def rows(draw, shared: bool):
    """B rows of T tokens: documents of drawn lengths (one over at least half the row, so in every
    shard; a few; many short ones), padding after; or (``shared``) a prompt and completions that
    continue its positions, as data.shared_prompt packs them."""
    seg = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    prefix = np.zeros((B, T), np.int32)
    for b in range(B):
        if shared:
            prompt = draw(st.integers(1, 24))
            completions = draw(st.lists(st.integers(1, 16), min_size=1, max_size=4))
            assume(prompt + sum(completions) <= T)
            seg[b, :prompt], positions[b, :prompt] = 1, np.arange(prompt)
            at = prompt
            for c, length in enumerate(completions):
                seg[b, at:at + length] = 2 + c
                positions[b, at:at + length] = prompt + np.arange(length)
                prefix[b, at:at + length] = 1
                at += length
            continue
        kind = draw(st.sampled_from(["one", "few", "many"]))
        if kind == "one":
            lengths = [draw(st.integers(T // 2, T))]
        else:
            lengths = draw(st.lists(st.integers(1, 3 * T // 8 if kind == "few" else 6), min_size=1, max_size=T))
        at = 0
        for s, length in enumerate(lengths, start=1):
            length = min(length, T - at)
            if length <= 0:
                break
            seg[b, at:at + length], positions[b, at:at + length] = s, np.arange(length)
            at += length
    return seg, positions, (prefix if shared else None)


def check(drawn, mesh_key, seed):
    """One draw on one mesh, under every window (a traced value: FULL for none, so one program
    serves them all)."""
    seg, positions, prefix = drawn
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, T, HKV, D)), jnp.float32) for _ in range(2))
    cot = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    shared = prefix is not None
    mesh, run = MESHES[mesh_key]
    for window in WINDOWS:
        args = (q, k, v, jnp.asarray(seg), jnp.int32(FULL if window is None else window),
                None if prefix is None else jnp.asarray(prefix), jnp.asarray(positions))
        want = compiled(("one", shared), one_device)(args, cot)
        with jax.set_mesh(mesh):
            got = compiled((mesh_key, shared), run)(args, cot)
        for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
            scale = float(jnp.abs(a).max()) or 1.0
            err = float(jnp.abs(a - b).max()) / scale
            assert err <= TOLERANCE, (name, mesh_key, window, shared, err, seg.tolist())
        # (a document from token 0 over half the row lies in every shard: chunks 0 .. n - 1)
        checked.append({"mesh": list(mesh_key), "window": window, "shared": shared,
                        "spans_all": bool(((seg == 1).sum(axis=1) >= T // 2).any())})


def check_all(examples: int) -> None:
    """Every mesh and strategy, plain packings and shared prompts, ``examples`` draws each."""
    for mesh_key in sorted(MESHES):
        for shared in (False,) if KERNEL == "pallas" else (False, True):
            run = settings(max_examples=examples, deadline=None, derandomize=True,
                           suppress_health_check=list(HealthCheck))(
                given(rows(shared), st.integers(0, 2**31 - 1))(lambda drawn, seed: check(drawn, mesh_key, seed)))
            run()


def check_model() -> dict:
    """A 2-layer model's loss and gradients with model.attention=pallas on mesh.context = 2 (a packed
    row, a sliding layer) against xla on one device: the kernel reaches every layer through the
    model (Transformer.split_row_kernel)."""
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.model import build_model
    from seqjax.model.loss import lm_loss

    tiny = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
            f"model.max_seq_len={T}", f"data.seq_len={T}", "model.sliding_window=24",
            "model.layer_types=[sliding,full]"]
    rng = np.random.default_rng(0)
    seg = np.repeat([1, 2, 3, 0], [70, 9, 40, 9])[None].repeat(B, 0).astype(np.int32)
    tokens = jnp.asarray(rng.integers(0, 64, (B, T + 1)), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(70), np.arange(9), np.arange(40), np.zeros(9, int)])[None]
                            .repeat(B, 0), jnp.int32)

    def loss_and_grads(backend, mesh=None):
        model = build_model(load_config(None, [*tiny, f"model.attention={backend}"]), 64, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state):
            logits = nnx.merge(graphdef, state)(tokens[:, :-1], positions=positions, segment_ids=jnp.asarray(seg))
            return lm_loss(logits, tokens[:, 1:], jnp.asarray(seg != 0, jnp.float32))[0]

        if mesh is None:
            return jax.jit(jax.value_and_grad(loss))(state)
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss))(state)

    mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=1, context=2, tensor=1), devices=jax.devices()[:2])
    want, got = loss_and_grads("xla"), loss_and_grads("pallas", mesh)
    worst = max(float(jnp.abs(a - b).max() / (jnp.abs(a).max() or 1.0))
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    assert worst <= 1e-5, worst
    return {"model_loss": float(want[0]), "model_worst": worst}


def check_chunked_loss() -> dict:
    """The chunked loss and log-probabilities on hidden states split over mesh.context = 4 (rows over
    data = 2): chunks stay within each device's span (model.context.row_spans), so the compiled
    program gathers nothing along the tokens, and the sums and gradients equal one device's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from seqjax.model.context import row_spans
    from seqjax.model.loss import chunked_lm_loss, chunked_token_logprobs

    rows, t, d, vocab = 4, 256, 16, 96
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(rows, t, d)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(d, vocab)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (rows, t)), jnp.int32)
    weights = jnp.asarray(rng.random((rows, t)) > 0.2, jnp.float32)

    def loss(hidden, head, targets, weights):
        spans = row_spans(hidden)
        lm = chunked_lm_loss(hidden, head, targets, weights, chunk_tokens=24, z_loss=1e-3, spans=spans)[0]
        logp = chunked_token_logprobs(hidden, head, targets, weights > 0, chunk_tokens=24, spans=spans)
        return lm - jnp.mean(logp), spans

    step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (want, one), want_grads = jax.jit(step)(hidden, head, targets, weights)
    mesh = sharding.build_mesh(MeshConfig(data=2, fsdp=1, context=4, tensor=1))
    with jax.set_mesh(mesh):
        split = [jax.device_put(a, NamedSharding(mesh, P("data", "context"))) for a in (hidden, targets, weights)]
        args = (split[0], jax.device_put(head, NamedSharding(mesh, P())), split[1], split[2])
        compiled = jax.jit(step).lower(*args).compile()
        (got, spans), got_grads = compiled(*args)
    gathers = [line for line in compiled.as_text().splitlines() if "all-gather" in line and f",{t}," in line]
    assert (one, spans) == (1, 4) and not gathers, gathers[:2]
    worst = max(float(jnp.abs(a - b).max() / jnp.abs(a).max()) for a, b in zip(want_grads, got_grads))
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want)) and worst <= 1e-6, (got, want, worst)
    return {"loss_spans": int(spans), "loss_gathers_along_tokens": len(gathers), "loss_worst": worst}


if __name__ == "__main__":
    check_all(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
    extra = check_model() if KERNEL == "pallas" else check_chunked_loss()
    print(json.dumps({"kernel": KERNEL, "examples": len(checked),
                      "meshes": sorted({tuple(c["mesh"]) for c in checked}),
                      "windows": sorted({str(c["window"]) for c in checked}),
                      "shared": sum(c["shared"] for c in checked),
                      "one_document_over_every_shard": sum(c["spans_all"] for c in checked), **extra}))
