"""Run by tests/test_moe.py in a subprocess with 8 forced host devices: a tiny mixture-of-experts model's loss,
router terms and gradients on meshes with an expert axis (mesh.expert = 2, 4 and 8, beside data, fsdp and
context; and bfloat16 matmuls over 8) against one device. Prints one JSON line of what it checked; any
mismatch raises."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.load import load_config
from seqjax.config.tree import MeshConfig
from seqjax.model import build_model, sharding
from seqjax.model.experts import load_balancing_loss

TOLERANCE = 2e-5  # of each array's largest magnitude, float32
MESHES = [dict(data=4, expert=2), dict(fsdp=2, expert=4), dict(expert=8), dict(data=2, expert=2, context=2),
          dict(fsdp=2, expert=2, context=2)]

config_args = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
               "model.vocab_size=64", "model.max_seq_len=32", "data.seq_len=32", "model.attention=xla",
               "model.experts.count=8", "model.experts.top_k=2", "model.experts.d_ff=16"]
config = load_config(None, config_args)
model = build_model(config, rngs=nnx.Rngs(0))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
rng = np.random.default_rng(0)
inputs = rng.integers(1, 64, (8, 32)).astype(np.int32)
segment_ids = np.repeat(np.arange(1, 5), 8)[None].repeat(8, 0).astype(np.int32)
segment_ids[:, 28:] = 0  # a padding tail: never routed into the router's terms
positions = np.tile(np.arange(8), 4)[None].repeat(8, 0).astype(np.int32)


def loss(params, inputs, positions, segment_ids):
    features, head, terms = nnx.merge(graphdef, params, rest).forward(inputs, positions=positions,
                                                                      segment_ids=segment_ids)
    logits = (features @ head).astype(jnp.float32)
    real = (segment_ids > 0).astype(jnp.float32)
    value = jnp.sum(jax.nn.logsumexp(logits, -1) * real) / jnp.sum(real) + load_balancing_loss(terms, 2)
    return value, terms


def run(params, *batch):
    (value, terms), grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
    return value, terms, grads


pure = nnx.to_pure_dict(params)
one = jax.jit(run)(pure, inputs, positions, segment_ids)
checked = []
for axes in MESHES:
    mesh = sharding.build_mesh(MeshConfig(**{"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **axes}))
    shardings = sharding.param_shardings(params, mesh)
    placed = sharding.place(pure, shardings)
    batch = [sharding.place(a, sharding.batch_sharding(mesh)) for a in (inputs, positions, segment_ids)]
    out = jax.jit(run)(placed, *batch)
    for name, got, want in (("loss", out[0], one[0]), ("counts", out[1].counts, one[1].counts),
                            ("probs", out[1].probs, one[1].probs)):
        scale = max(1.0, float(jnp.max(jnp.abs(want))))
        assert float(jnp.max(jnp.abs(got - want))) <= TOLERANCE * scale, (axes, name, got, want)
    for got, want in zip(jax.tree.leaves(out[2]), jax.tree.leaves(one[2])):
        scale = max(1.0, float(jnp.max(jnp.abs(want))))
        assert float(jnp.max(jnp.abs(got - want))) <= TOLERANCE * scale, (axes, "gradient")
    spec = shardings["blocks"][0]["mlp"]["experts"]["w_gate"].spec
    assert spec[0] == "expert", (axes, spec)  # (the experts are split over the expert axis)
    checked.append({"mesh": axes, "loss": float(out[0])})

# bfloat16 matmuls over the expert axis (tokens gathered in bfloat16, their gradients added in float32): one
# device's loss and gradients to bfloat16's rounding
half = load_config(None, [*config_args, "model.compute_dtype=bfloat16"])
graphdef, params, rest = nnx.split(build_model(half, rngs=nnx.Rngs(0)), nnx.Param, ...)
pure = nnx.to_pure_dict(params)
one = jax.jit(run)(pure, inputs, positions, segment_ids)
mesh = sharding.build_mesh(MeshConfig(data=1, fsdp=1, expert=8, context=1, tensor=1))
batch = [sharding.place(a, sharding.batch_sharding(mesh)) for a in (inputs, positions, segment_ids)]
out = jax.jit(run)(sharding.place(pure, sharding.param_shardings(params, mesh)), *batch)
assert abs(float(out[0]) - float(one[0])) <= 2e-2 * abs(float(one[0])), (float(out[0]), float(one[0]))
for got, want in zip(jax.tree.leaves(out[2]), jax.tree.leaves(one[2])):
    scale = max(1e-3, float(jnp.max(jnp.abs(want))))
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) <= 5e-2 * scale, "bf16 grad"
checked.append({"mesh": {"expert": 8}, "compute_dtype": "bfloat16", "loss": float(out[0])})
print(json.dumps({"checked": checked}))
