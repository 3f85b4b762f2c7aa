"""A Qwen3-VL model (and a Qwen2.5-VL one) trains through the one train step (seqjax.train.step, the
lm objective) with LoRA on its language model and the vision tower frozen: packed rows give the
update of one example per row, two micro-batches the update of one batch, and scan, remat and the
chunked loss the unrolled model's numbers.

The model is the tiny random Qwen3-VL of tests/data/vision (transformers' own weights;
test_vision_language.py checks its logits against transformers), its examples the reference chats
with images of three sizes.
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
from test_train_support import with_devices
from vision_support import QWEN2_5, batch, vl_model

# (two minutes of compiling train steps; test_vision_language.py is the fast proof)
pytestmark = pytest.mark.slow
LORA = LoraConfig(rank=4, alpha=8.0, init="gaussian")
PACKED = [["two_images", "text_only", "one_image"], ["one_image"]]
ONE_PER_ROW = [["two_images"], ["one_image"], ["text_only"], ["one_image"]]


def adapter_step(batch_: dict, grad_accum: int = 1, ref=None, **text):
    """One SGD step (lr 1) of the LoRA model (Qwen3-VL's reference, or ``ref``'s) on ``batch_``:
    (adapters before, after, metrics, the frozen part before and after), the adapters' blocks
    unrolled whatever the model's layout."""
    model = (ref.model if ref else vl_model)(lora=LORA, **text)
    graphdef, trained, frozen, rest = split_params(model)
    trained, frozen = nnx.to_pure_dict(trained), nnx.to_pure_dict(frozen)
    frozen_before = jax.tree.map(np.array, frozen)
    tx = optax.sgd(1.0)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=grad_accum))
    new, _, metrics = step(trained, tx.init(trained), batch_, None, 0, frozen)

    def unrolled(tree):
        return blocks_layout(jax.tree.map(np.asarray, tree), False)

    return unrolled(trained), unrolled(new), metrics, frozen_before, frozen


@pytest.fixture(scope="module")
def packed_step():
    return adapter_step(batch(PACKED, 52, 96))


def test_packed_rows_and_one_example_per_row_over_two_micro_batches_give_one_update(packed_step):
    before, packed, metrics, frozen_before, frozen = packed_step
    assert set(before) == {"blocks"}  # the adapters only: the tower and the base are frozen
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
    # the same seed draws the same adapters
    jax.tree.map(np.testing.assert_array_equal, s_before, before)
    np.testing.assert_allclose(float(s_metrics["loss"]), float(metrics["loss"]), rtol=1e-6)
    jax.tree.map(lambda s, p, b: np.testing.assert_allclose(s - b, p - b, rtol=2e-4, atol=1e-8), scanned, packed,
                 before)


def test_qwen2_5_vl_packed_under_scan_remat_and_the_chunked_loss_gives_one_example_per_rows_update():
    """Qwen2.5-VL's reference (a windowed tower, a Qwen2 text model): the packed batch under scan,
    full remat and the chunked loss gives the update of the unrolled model on one example per row
    over two micro-batches."""
    before, packed, metrics, frozen_before, frozen = adapter_step(
        QWEN2_5.batch(PACKED, 52, 96), ref=QWEN2_5, scan_layers=True, remat="full", loss_chunk_tokens=16)
    jax.tree.map(np.testing.assert_array_equal, frozen_before, jax.tree.map(np.asarray, frozen))
    a_before, alone, alone_metrics, _, _ = adapter_step(QWEN2_5.batch(ONE_PER_ROW, 30, 64), grad_accum=2,
                                                        ref=QWEN2_5)
    jax.tree.map(np.testing.assert_array_equal, a_before, before)
    assert float(metrics["weight_sum"]) == float(alone_metrics["weight_sum"]) > 0
    np.testing.assert_allclose(float(metrics["loss"]), float(alone_metrics["loss"]), rtol=1e-6)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), packed, before))) > 1e-4
    jax.tree.map(lambda p, a, b: np.testing.assert_allclose(p - b, a - b, rtol=2e-4, atol=1e-8), packed, alone,
                 before)


MESH_RUN = """
import json, sys
import jax, numpy as np, optax
from flax import nnx
sys.path.insert(0, "tests")
from vision_support import batch, vl_model
from seqjax.config.model import LoraConfig
from seqjax.model import sharding
from seqjax.model.lora import split_params
from seqjax.train.step import make_train_step

rows = [["two_images", "text_only", "one_image"], ["one_image"], ["two_images"], ["text_only", "one_image"]]
data = batch(rows, 52, 96)
graphdef, trained, frozen, rest = split_params(vl_model(lora=LoraConfig(rank=4, alpha=8.0, init="gaussian")))
tx = optax.sgd(1.0)
out = {}
for name, shape, accum in (("one device", (1, 1, 1), 1), ("data 2 x fsdp 2", (2, 2, 1), 1),
                           ("data 2, two micro-batches", (2, 1, 1), 2)):
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), devices=jax.devices()[:int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    params = sharding.place(nnx.to_pure_dict(trained), sharding.param_shardings(trained, mesh))
    base = sharding.place(nnx.to_pure_dict(frozen), sharding.param_shardings(frozen, mesh))
    rows_of = sharding.batch_sharding(mesh)
    placed = sharding.place(data, {k: rows_of for k in data})
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=accum))
    new, _, metrics = step(params, tx.init(params), placed, None, 0, base)
    out[name] = {"loss": float(metrics["loss"]), "update": [np.asarray(a - b).ravel().tolist() for a, b in
                                                            zip(jax.tree.leaves(new), jax.tree.leaves(params))],
                 "patches_sharding": str(placed["patches"].sharding.spec)}
print(json.dumps(out))
"""


def test_on_a_mesh_rows_take_their_images_and_the_step_is_one_devices():
    """On 4 forced host devices (data 2 x fsdp 2; data 2 with two micro-batches): every image field
    is cut by rows as the text is, and the LoRA step on packed image rows is the one-device step."""
    import json
    import os
    import subprocess
    import sys

    from test_train_support import REPO

    env = {**os.environ, "XLA_FLAGS": with_devices(4), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", MESH_RUN], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    one = result.pop("one device")
    assert max(max(map(abs, u)) for u in one["update"]) > 1e-4
    for mesh in result.values():
        assert mesh["patches_sharding"] == "P(('data', 'fsdp'), None)"  # rows over data x fsdp
        np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=1e-6)
        for a, b in zip(mesh["update"], one["update"], strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-8)
