"""A tiny TransformerLM trained a few SGD steps with ``model.attention=pallas`` (interpret mode) follows ``xla``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.model import build_model
from seqjax.model.loss import lm_loss

VOCAB = 64
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64",
        "model.max_seq_len=32", "data.seq_len=24"]


def packed_batch(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Two rows of contract-1 fields: row 0 packs docs of 9, 1 and 10 tokens then padding; row 1 is one doc."""
    segment_ids = np.array([np.repeat([1, 2, 3, 0], [9, 1, 10, 4]), np.ones(24, int)], np.int32)
    starts = np.concatenate([[True], segment_ids[0, 1:] != segment_ids[0, :-1]])
    positions = np.stack([np.arange(24) - np.maximum.accumulate(np.where(starts, np.arange(24), 0)), np.arange(24)])
    tokens = rng.integers(0, VOCAB, (2, 25)).astype(np.int32)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids,
                positions=positions.astype(np.int32), weights=(segment_ids != 0).astype(np.float32))


def sgd_losses(backend: str, batch: dict, steps: int = 3) -> list[float]:
    model = build_model(load_config(None, [*TINY, f"model.attention={backend}"]), VOCAB, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state):
        def loss_fn(state):
            logits = nnx.merge(graphdef, state)(
                batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"]
            )
            return lm_loss(logits, batch["targets"], batch["weights"])[0]

        loss, grads = jax.value_and_grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - 0.5 * g, state, grads), loss

    losses = []
    for _ in range(steps):
        state, loss = step(state)
        losses.append(float(loss))
    return losses


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_tiny_model_training_with_pallas_matches_xla():
    batch = {k: jnp.asarray(v) for k, v in packed_batch(np.random.default_rng(0)).items()}
    with jax.default_matmul_precision("highest"):  # on a GPU, XLA's float32 default would be TF32
        xla = sgd_losses("xla", batch)
        pallas = sgd_losses("pallas", batch)
    assert xla[-1] < xla[0]
    np.testing.assert_allclose(pallas, xla, rtol=2e-5)


def test_block_metadata_is_computed_once_per_forward_and_shared_by_every_layer(monkeypatch):
    """A 3-layer pallas model traces block_metadata once (in the model), never in the kernel, and its logits
    equal the xla model's (same seed, so the same parameters)."""
    from seqjax.model import transformer
    from seqjax.model.kernels import block_ranges

    calls = {"model": 0, "kernel": 0}

    def counting(where, fn):
        def wrapped(*args, **kwargs):
            calls[where] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(transformer, "block_metadata", counting("model", transformer.block_metadata))
    # the kernels' own fallback (kernel_metadata) looks block_metadata up in block_ranges
    monkeypatch.setattr(block_ranges, "block_metadata", counting("kernel", block_ranges.block_metadata))
    batch = packed_batch(np.random.default_rng(1))

    def logits(backend):
        model = build_model(load_config(None, [*TINY, "model.n_layers=3", f"model.attention={backend}"]), VOCAB,
                            rngs=nnx.Rngs(0))
        return np.asarray(nnx.jit(lambda m: m(batch["inputs"], positions=batch["positions"],
                                              segment_ids=batch["segment_ids"]))(model))

    with jax.default_matmul_precision("highest"):
        pallas = logits("pallas")
        assert calls == {"model": 1, "kernel": 0}
        xla = logits("xla")
    assert calls == {"model": 1, "kernel": 0}
    np.testing.assert_allclose(pallas, xla, rtol=2e-5, atol=2e-5)
