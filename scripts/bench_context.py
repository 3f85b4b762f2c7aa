"""Context parallelism on simulated devices: attention and a train step at mesh.context 1, 2, 4 and 8 (JSON lines).

    python scripts/bench_context.py                      # T = 4,096, CPU: 8 forced host devices
    python scripts/bench_context.py --seq-len 8192 --contexts 1,2,4,8 --kv-paths all_gather,ring

For each mesh.context n (and each ``--kv-paths`` way K/V travel) it prints one record:

- ``attention``: the split row's attention forward and backward (seqjax.model.context) on one row of
  packed documents on n devices, timed, against one device's (``--attention``: the flash kernel's spans
  on a GPU, the dense blocks elsewhere); the output bytes of
  each collective in the compiled program a device runs (all-gathers, collective permutes,
  reduce-scatters), and their sum over the row's K/V bytes;
- ``work``: the (query tile, key tile) pairs of 128 tokens each device visits on that row (and on one
  document filling the row), their imbalance (largest / mean - 1), beside a contiguous split's;
- ``chunked_loss``: the chunked loss on the row's hidden states over the n devices, its chunks within
  each device's span (as the objectives run it) beside chunks over the whole row: time and the bytes
  each collective moves;
- ``train_step``: scripts/bench_train.py's real step (a 4-layer model, one row of T tokens, a
  synthetic corpus) on n devices with mesh.context=n: step time and XLA's compiled bytes a device.

Simulated host devices share this machine's cores: the times show the cost of the split's extra
work and copies, not a GPU's speed-up; the work counts and bytes are the devices' own. The last
line is a summary object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from seqjax.core.devices import HOST_DEVICES_FLAG, with_host_devices

REPO = Path(__file__).resolve().parents[1]
# (host devices for a CPU, 8 unless the caller set a count; on a GPU machine the GPUs are the devices and the flag
# is unused)
if "jax" not in sys.modules and HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), 8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from seqjax.config.tree import MeshConfig  # noqa: E402
from seqjax.model import sharding  # noqa: E402
from seqjax.model.attention import attention, resolve_backend  # noqa: E402
from seqjax.model.context import SplitRow, balanced_order, work_per_shard  # noqa: E402
from seqjax.model.sharding import CONTEXT_AXIS  # noqa: E402

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
COLLECTIVE = re.compile(r"= (\([^)]*\)|\w+\[[\d,]*\][^ ]*) (all-gather|collective-permute|all-to-all|all-reduce|"
                        r"reduce-scatter)(-start)?\(")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a row")
    p.add_argument("--contexts", default="1,2,4,8", help="mesh.context sizes")
    p.add_argument("--kv-paths", default="all_gather,ring", help="model.context_attention values")
    p.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                   help="model.attention on every device and on the one-device yardstick (auto: the flash "
                        "kernel on a GPU, xla elsewhere; pallas off a GPU runs in Pallas's interpreter)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3, help="timed calls (after one untimed)")
    p.add_argument("--train-steps", type=int, default=3, help="bench_train's timed steps (0: skip the train step)")
    p.add_argument("--loss-vocab", type=int, default=32_000, help="the chunked loss record's vocabulary")
    p.add_argument("--train-model", default="256,4", metavar="D,LAYERS",
                   help="the train step's model: d_model and layers (its 8 heads of 2 kv heads kept)")
    return p.parse_args(argv)


def packed_row(t: int, seed: int = 0) -> np.ndarray:
    """One row of documents with long-tailed lengths (lognormal, median 600 tokens), the last cut."""
    rng = np.random.default_rng(seed)
    ids, at, doc = np.zeros(t, np.int32), 0, 1
    while at < t:
        length = int(min(max(rng.lognormal(np.log(600), 1.0), 16), t - at))
        ids[at:at + length], at, doc = doc, at + length, doc + 1
    return ids[None]


def collective_bytes(hlo: str) -> dict[str, int]:
    """Output bytes per collective kind in a compiled program's text, one device's; a collective over
    axes of one device (shard_map's transpose sums cotangents over the mesh's other axes) moves
    nothing and is left out."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        found = COLLECTIVE.search(line)
        groups = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        if not found:
            continue
        if groups:
            sizes = {name.strip("'"): int(size) for name, size in re.findall(r"('\w+')=(\d+)", groups.group(1))}
            if np.prod([sizes[a.strip("'")] for a in groups.group(2).split(",")]) == 1:
                continue
        total = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", found.group(1)):
            total += BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        out[found.group(2)] = out.get(found.group(2), 0) + total
    return out


def timed(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / iters * 1e3


def attention_record(args, n: int, kv_path: str, seg: np.ndarray, one_ms: float | None) -> dict:
    t = seg.shape[1]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, t, args.heads, args.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, t, args.kv_heads, args.head_dim)), jnp.float32) for _ in range(2))
    mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=1, context=n, tensor=1), jax.devices()[:n])
    split = SplitRow(mesh.abstract_mesh, n, t, None, None, kv_path, args.attention)
    # the layer's view: q, k, v and ids already in split order, each device holding its share
    order = balanced_order(t, n)
    q, k, v, ids = (jax.device_put(a[:, order], NamedSharding(mesh, P(None, CONTEXT_AXIS)))
                    for a in (q, k, v, jnp.asarray(seg)))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, ids, metadata=split) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        hlo = step.lower(q, k, v).compile().as_text()
        ms = timed(step, q, k, v, iters=args.iters)
    kv_bytes = 2 * t * args.kv_heads * args.head_dim * 4
    moved = collective_bytes(hlo)
    return {"fwd_bwd_ms": round(ms, 2), "one_device_fwd_bwd_ms": one_ms, "collective_bytes": moved,
            "kv_bytes_a_row": kv_bytes, "received_over_kv": round(sum(moved.values()) / kv_bytes, 3)}


def loss_record(args, n: int) -> dict:
    """The chunked loss (model.loss_chunk_tokens) on one row's hidden states split over n devices, forward
    and backward: chunks within each device's span (what the objectives pass, spans = n) against chunks
    over the whole row (spans = 1, what XLA is left to partition): milliseconds and the bytes each
    collective of the compiled program moves (an all-gather of the hidden states, or the head's
    gradient summed over the devices)."""
    from seqjax.model.loss import chunked_lm_loss

    t, d, vocab = args.seq_len, 256, args.loss_vocab
    rng = np.random.default_rng(2)
    mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=1, context=n, tensor=1), jax.devices()[:n])
    on_tokens = NamedSharding(mesh, P(None, CONTEXT_AXIS))
    hidden = jax.device_put(jnp.asarray(rng.normal(size=(1, t, d)), jnp.float32), on_tokens)
    targets = jax.device_put(jnp.asarray(rng.integers(0, vocab, (1, t)), jnp.int32), on_tokens)
    weights = jax.device_put(jnp.ones((1, t), jnp.float32), on_tokens)
    head = jax.device_put(jnp.asarray(rng.normal(size=(d, vocab)) * 0.05, jnp.float32), NamedSharding(mesh, P()))
    record = {}
    for name, spans in (("within_spans", n), ("whole_row", 1)):
        def loss(hidden, head, spans=spans):
            return chunked_lm_loss(hidden, head, targets, weights, chunk_tokens=512, spans=spans)[0]

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        with jax.set_mesh(mesh):
            compiled = step.lower(hidden, head).compile()
            ms = timed(step, hidden, head, iters=args.iters)
        record[name] = {"fwd_bwd_ms": round(ms, 2), "collective_bytes": collective_bytes(compiled.as_text())}
    return {"vocab": vocab, "d_model": d, "chunk_tokens": 512, **record}


def work_record(seg: np.ndarray, n: int) -> dict:
    t = seg.shape[1]
    record = {}
    for name, ids in (("packed", seg), ("one_document", np.ones_like(seg))):
        work = work_per_shard(ids, n, tile=128)
        # a contiguous split: device i's queries are tokens i T / n ..
        contiguous = work_per_shard(ids, n, tile=128, order=np.arange(t))
        record[name] = {"tiles_per_device": work.tolist(), "imbalance": round(float(work.max() / work.mean() - 1), 4),
                        "contiguous_tiles_per_device": contiguous.tolist(),
                        "contiguous_imbalance": round(float(contiguous.max() / contiguous.mean() - 1), 4)}
    return record


def train_step_record(args, n: int, kv_path: str, corpus: Path) -> dict:
    """bench_train.py's real step on n host devices with mesh.context=n."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    d_model, layers = (int(x) for x in args.train_model.split(","))
    if jax.default_backend() == "cpu":
        # (the caller's own XLA flags kept: only the device count is this run's)
        env.update(XLA_FLAGS=with_host_devices(env.get("XLA_FLAGS", ""), n), JAX_PLATFORMS="cpu")
    else:  # the first n GPUs
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n)))
    overrides = [f"run.dir={corpus / 'runs' / f'{n}_{kv_path}'}", "data.corpus=jsonl",
                 f"data.train_files=[{corpus / 'train.jsonl'}]", f"data.valid_files=[{corpus / 'valid.jsonl'}]",
                 f"data.cache_dir={corpus / 'cache'}", "tokenizer.vocab_size=512", f"data.seq_len={args.seq_len}",
                 "data.batch_size=1", "train.grad_accum=1", f"model.d_model={d_model}", f"model.n_layers={layers}",
                 "model.n_heads=8", "model.n_kv_heads=2", f"model.d_ff={3 * d_model}", "model.vocab_size=null",
                 f"model.max_seq_len={args.seq_len}", f"model.attention={args.attention}",
                 f"model.context_attention={kv_path}",
                 "mesh.data=1", f"mesh.context={n}", f"eval.context={args.seq_len}", "train.warmup_steps=1"]
    proc = subprocess.run([sys.executable, "scripts/bench_train.py", "--config", "configs/wikitext2_cpu.yaml",
                           "--loops", "async", "--steps", str(args.train_steps), "--warmup", "1", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    loop = result["loops"]["async"]
    return {"step_time_ms": round(loop["step_time_ms"], 1), "tokens_per_s": round(loop["tokens_per_s"]),
            "compiled_step_bytes": result.get("compiled_step_bytes"), "loss_first_last": loop["loss_first_last"]}


def write_corpus(folder: Path) -> None:
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(400)]
    for name, docs in (("train", 400), ("valid", 20)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for _ in range(docs):
                length = int(min(max(rng.lognormal(np.log(300), 1.0), 8), 6000))
                f.write(json.dumps({"text": " ".join(rng.choice(words, length))}) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.attention = resolve_backend(args.attention, jnp.float32)
    contexts = [int(n) for n in args.contexts.split(",") if int(n) <= len(jax.devices())]
    kv_paths = args.kv_paths.split(",")
    seg = packed_row(args.seq_len)
    env = {"bench": "context", "platform": jax.default_backend(), "devices": len(jax.devices()), "jax": jax.__version__,
           "host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "seq_len": args.seq_len, "documents": int(seg.max()), "attention_backend": args.attention,
           "command": " ".join(["python", *sys.argv])}
    # one device's attention, the yardstick (ids, q, k, v as above)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, args.seq_len, args.heads, args.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, args.seq_len, args.kv_heads, args.head_dim)), jnp.float32)
            for _ in range(2))
    one = jax.jit(jax.value_and_grad(
        lambda q, k, v: jnp.sum(attention(q, k, v, jnp.asarray(seg), backend=args.attention) ** 2), argnums=(0, 1, 2)))
    one_ms = round(timed(one, q, k, v, iters=args.iters), 2)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp)
        if args.train_steps:
            write_corpus(corpus)
        for n in contexts:
            for kv_path in kv_paths if n > 1 else kv_paths[:1]:
                record = {**env, "context": n, "kv_path": kv_path if n > 1 else None}
                if n > 1:
                    record["attention"] = attention_record(args, n, kv_path, seg, one_ms)
                    record["work"] = work_record(seg, n)
                    if kv_path == kv_paths[0]:
                        record["chunked_loss"] = loss_record(args, n)
                else:
                    record["attention"] = {"fwd_bwd_ms": one_ms}
                if args.train_steps:
                    record["train_step"] = train_step_record(args, n, kv_path, corpus)
                print(json.dumps(record), flush=True)
                records.append(record)
    print(json.dumps({"summary": [{"context": r["context"], "kv_path": r["kv_path"],
                                   "attention_ms": r["attention"]["fwd_bwd_ms"],
                                   "imbalance": r.get("work", {}).get("packed", {}).get("imbalance"),
                                   "received_over_kv": r["attention"].get("received_over_kv"),
                                   "step_ms": r.get("train_step", {}).get("step_time_ms")} for r in records]}))


if __name__ == "__main__":
    main()
