"""Context parallelism (seqjax.model.context): rows split over mesh.context give one device's numbers.

- the head-tail order and its inverse round-trip, and balance a causal row's work exactly;
- attention outputs and dQ/dK/dV on 2, 4 and 8 simulated devices, both strategies, windows and
  shared prompts, equal one device to 1e-6 (tests/context_cases.py, in a subprocess); so does the
  flash kernel's spans on 2 and 4, and a model with it on 2 equals xla on one device; the chunked
  loss keeps its chunks within each device's span (no gather along the tokens);
- ``python -m seqjax.train`` over the context axis takes one device's steps, with data parallelism,
  a ring, LoRA under scan and remat, and a resume onto another mesh.context;
- what cannot honour a split row is refused in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.model.context import balanced_order, inverse_order, work_per_shard
from test_train_support import REPO, cli_env, tiny_overrides, train_losses


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16))
def test_the_head_tail_order_gives_each_device_chunks_i_and_2n_minus_1_minus_i_and_undoes_exactly(n, chunk):
    t = 2 * n * chunk
    order = balanced_order(t, n)
    assert sorted(order.tolist()) == list(range(t))
    assert (order[inverse_order(order)] == np.arange(t)).all() and (inverse_order(order)[order] == np.arange(t)).all()
    for device, share in enumerate(order.reshape(n, 2 * chunk)):
        assert share[:chunk].tolist() == list(range(device * chunk, (device + 1) * chunk))
        last = 2 * n - 1 - device
        assert share[chunk:].tolist() == list(range(last * chunk, (last + 1) * chunk))


def test_a_row_that_does_not_cut_into_2n_chunks_is_one_line():
    with pytest.raises(ConfigError, match=r"mesh.context=4: a row of 36 tokens does not cut into 8 equal chunks"):
        balanced_order(36, 4)
    with pytest.raises(ConfigError, match=r"data.seq_len: got 36, expected a multiple of 2 x mesh.context = 8"):
        load_config(None, ["mesh.context=4", "data.seq_len=36"])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_device_visits_the_same_tiles_of_a_causal_row_where_contiguous_shards_do_not(n):
    t = 256 * n
    one_document = np.ones((1, t), np.int32)
    work = work_per_shard(one_document, n, tile=128)
    assert work.max() / work.min() - 1 <= 0.05
    # the contiguous split (device i: tokens i T / n ..), which the head-tail order replaces: the last device
    # attends to the whole row, the first to its own shard
    per_tile = np.tril(np.ones((t // 128, t // 128), int))
    contiguous = per_tile.reshape(n, -1, t // 128).sum(axis=(1, 2))
    assert contiguous.max() / contiguous.min() - 1 > 0.05
    assert work.sum() == per_tile.sum()  # the same tiles in all, only spread evenly


def test_documents_inside_one_shard_cost_the_other_shards_nothing():
    n, t = 4, 1024
    short = np.repeat(np.arange(1, 9), t // 8)[None].astype(np.int32)  # 8 documents of 128 tokens = the chunks
    work = work_per_shard(short, n, tile=128)
    assert work.tolist() == [2] * n  # each device: its two chunks' own diagonal tiles, nothing across shards


@pytest.mark.slow
def test_attention_over_2_4_and_8_context_devices_equals_one_device_in_value_and_gradient():
    proc = subprocess.run([sys.executable, "tests/context_cases.py", "3"], cwd=REPO, env=cli_env(devices=8),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["examples"] >= 6 * 2 * 3 * 4 and len(report["meshes"]) == 6
    assert report["shared"] >= 6 * 3 * 4 and report["examples"] - report["shared"] >= 6 * 3 * 4
    assert report["one_document_over_every_shard"] > 0
    assert set(report["windows"]) == {"None", "1", "5", "17"}
    # the chunked loss on context 4: chunks within each device's span, nothing gathered along the tokens
    assert report["loss_spans"] == 4 and report["loss_gathers_along_tokens"] == 0 and report["loss_worst"] <= 1e-6


@pytest.mark.slow
def test_the_flash_kernels_spans_over_2_and_4_context_devices_equal_it_on_one_row():
    """model.attention=pallas on a split row (interpret mode): each device's chunks are spans of
    queries against spans of keys, with block_metadata's ranges and the spans' offsets."""
    proc = subprocess.run([sys.executable, "tests/context_cases.py", "2", "pallas"], cwd=REPO,
                          env=cli_env(devices=8), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kernel"] == "pallas" and report["examples"] >= 4 * 2 * 4 and len(report["meshes"]) == 4
    assert set(report["windows"]) == {"None", "2", "5", "17"} and report["one_document_over_every_shard"] > 0
    assert report["model_worst"] <= 1e-5


SCRIPT = """
import json, sys
from seqjax.main.cli import configure_logging
from seqjax.config.load import load_config
from seqjax.train.loop import train
configure_logging()
base, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for run_dir, overrides in runs:
    train(load_config(None, [*base, f"run.dir={run_dir}", *overrides]))
"""


@pytest.mark.slow
def test_training_over_the_context_axis_takes_one_devices_steps(reference, tiny_root, tmp_path):
    """20 steps on 4 simulated devices against the one-device reference run, to 2e-6: mesh.context=4,
    and a ring run on mesh.context=4 resumed at step 10 on fsdp 2 x context 2 (the parameters split
    beside the rows' tokens); a LoRA run, scanned
    and rematerialized on mesh.context=4 with the chunked loss, against its twin with no context
    axis (mesh.data=4)."""
    steps = 20
    base = [o for o in tiny_overrides(tiny_root, tmp_path, **{"train.steps": steps}) if not o.startswith("run.dir=")]
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "train.lr=1e-2", "model.loss_chunk_tokens=8"]
    runs = [
        (tmp_path / "context4", ["mesh.data=1", "mesh.context=4"]),
        (tmp_path / "ring", ["mesh.data=1", "mesh.context=4", "model.context_attention=ring", "train.steps=10"]),
        (tmp_path / "ring", ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "model.context_attention=ring"]),
        (tmp_path / "lora_one", [*lora, "train.init_from=" + str(tiny_root / "reference"), "mesh.data=4"]),
        (tmp_path / "lora_context", [*lora, "train.init_from=" + str(tiny_root / "reference"), "mesh.data=1",
                                     "mesh.context=4", "model.scan_layers=true", "model.remat=full"]),
    ]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(base), json.dumps([(str(d), o) for d, o in runs])],
                          cwd=REPO, env=cli_env(devices=4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "mesh {'data': 1, 'fsdp': 1, 'expert': 1, 'context': 4, 'tensor': 1}" in proc.stderr
    assert "'context': 2" in proc.stderr and "resum" in proc.stderr.lower()
    # (float32 sums in another order: 1.0e-6 apart at worst under the tests' unoptimized compile, 2.2e-7 under a
    # user's)
    for name in ("context4", "ring"):
        losses = train_losses(tmp_path / name)
        assert sorted(losses) == list(range(1, steps + 1)), name
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[step], rel=2e-6), (name, step)
    twin, split = train_losses(tmp_path / "lora_one"), train_losses(tmp_path / "lora_context")
    assert sorted(split) == list(range(1, steps + 1)) and twin[steps] < twin[1]
    for step, loss in split.items():
        assert loss == pytest.approx(twin[step], rel=2e-6), ("lora", step)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.context=2", "model.attention=pallas_mosaic"],
     "model.attention: got 'pallas_mosaic', which attends over one whole row and cannot honour mesh.context=2; "
     "expected one of xla, pallas, auto"),
    (["mesh.context=2", "model.attention=pallas", "data.seq_len=40"],
     "data.seq_len: got 40 (eval.context 40) with model.attention=pallas, whose tiles are at least 16 tokens; "
     "expected a multiple of 2 x mesh.context x 16 = 64"),
    (["mesh.context=2", "model.attention=xla", "model.attention_dropout=0.1"],
     "model.attention_dropout: got 0.1, which draws its random bits per whole row and cannot honour mesh.context=2; "
     "expected 0"),
    (["mesh.context=2", "data.corpus=jsonl", "data.format=prompt"],
     "mesh.context: got 2 with data.format='prompt', which does not split rows over mesh.context yet; expected "
     "mesh.context=1"),
])
def test_what_cannot_honour_a_split_row_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert str(error.value) == message


def test_the_data_plot_marks_which_device_holds_each_chunk(tiny_root, tmp_path, monkeypatch):
    from seqjax.data import picture
    from seqjax.main import data as data_cli

    drawn = []
    draw = picture.draw_batch
    monkeypatch.setattr(picture, "draw_batch", lambda *a: drawn.append(a) or draw(*a))
    overrides = [o for o in tiny_overrides(tiny_root, tmp_path / "run") if o.startswith(("data.", "tokenizer."))]
    data_cli.main([*overrides, "mesh.context=4", "--plot", str(tmp_path / "layout.png")])
    (_, path, _, owners), = drawn
    assert owners == [0, 1, 2, 3, 3, 2, 1, 0] and path.stat().st_size > 0
