"""A Qwen3-VL model trains through the one train step (seqjax.train.step, the lm objective) with LoRA on its
language model and the vision tower frozen: packed rows give the update of one example per row, two micro-batches
the update of one batch, and scan, remat and the chunked loss the unrolled model's numbers.

The model is the tiny random Qwen3-VL of tests/data/vision (transformers' own weights; test_vision_language.py
checks its logits against transformers), its examples the reference chats with images of three sizes.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from seqjax.config.model import LoraConfig
from seqjax.model.lora import split_params
from seqjax.model.stacking import blocks_layout
from seqjax.train.step import make_train_step
from vision_support import batch, vl_model

pytestmark = pytest.mark.slow  # (two minutes of compiling train steps; test_vision_language.py is the fast proof)
LORA = LoraConfig(rank=4, alpha=8.0, init="gaussian")
PACKED = [["two_images", "text_only", "one_image"], ["one_image"]]
ONE_PER_ROW = [["two_images"], ["one_image"], ["text_only"], ["one_image"]]


def adapter_step(batch_: dict, grad_accum: int = 1, **text):
    """One SGD step (lr 1) of the LoRA model on ``batch_``: (adapters before, after, metrics, the frozen part
    before and after), the adapters' blocks unrolled whatever the model's layout."""
    model = vl_model(lora=LORA, **text)
    graphdef, trained, frozen, rest = split_params(model)
    trained, frozen = nnx.to_pure_dict(trained), nnx.to_pure_dict(frozen)
    frozen_before = jax.tree.map(np.array, frozen)
    tx = optax.sgd(1.0)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=grad_accum))
    new, _, metrics = step(trained, tx.init(trained), batch_, None, 0, frozen)

    def unrolled(tree):
        return {**tree, "lm": blocks_layout(jax.tree.map(np.asarray, tree["lm"]), False)}

    return unrolled(trained), unrolled(new), metrics, frozen_before, frozen


@pytest.fixture(scope="module")
def packed_step():
    return adapter_step(batch(PACKED, 52, 96))


def test_packed_rows_and_one_example_per_row_over_two_micro_batches_give_one_update(packed_step):
    before, packed, metrics, frozen_before, frozen = packed_step
    assert set(before) == {"lm"}  # the adapters only: the tower and the base are frozen
    jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, frozen))
    _, alone, alone_metrics, _, _ = adapter_step(batch(ONE_PER_ROW, 30, 64), grad_accum=2)
    assert float(metrics["weight_sum"]) == float(alone_metrics["weight_sum"]) > 0
    np.testing.assert_allclose(float(metrics["loss"]), float(alone_metrics["loss"]), rtol=1e-6)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), packed, before)
    assert max(jax.tree.leaves(moved)) > 1e-4  # B moved off 0
    jax.tree.map(lambda p, a, b: np.testing.assert_allclose(p - b, a - b, rtol=2e-4, atol=1e-8), packed, alone,
                 before)


def test_scan_remat_and_the_chunked_loss_give_the_unrolled_update(packed_step):
    before, packed, metrics, _, _ = packed_step
    s_before, scanned, s_metrics, _, _ = adapter_step(batch(PACKED, 52, 96), scan_layers=True, remat="full",
                                                      loss_chunk_tokens=16)
    jax.tree.map(np.testing.assert_array_equal, s_before, before)  # the same seed draws the same adapters
    np.testing.assert_allclose(float(s_metrics["loss"]), float(metrics["loss"]), rtol=1e-6)
    jax.tree.map(lambda s, p, b: np.testing.assert_allclose(s - b, p - b, rtol=2e-4, atol=1e-8), scanned, packed,
                 before)
