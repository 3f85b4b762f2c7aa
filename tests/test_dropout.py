"""Dropout: only in training, bit for bit absent at rate 0, and drawn from (run.seed, step) alone.

The masks must not depend on where they are drawn: an exact resume, another
device count and another process count all see the same bits, so their
losses match an uninterrupted single-device run (exactly, or to 1e-5 where
the device count changes the reductions, as in tests/test_sharding.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.engine import generate
from seqjax.eval.evaluate import evaluate
from seqjax.model import build_model
from seqjax.model.attention import attention
from seqjax.store.reader import TokenStore
from seqjax.train.optimizer import build_optimizer
from seqjax.train.step import make_train_step
from test_multiprocess import run_two_processes
from test_train_support import REPO, cli_env, tiny_overrides, train_losses

VOCAB = 64
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "model.max_seq_len=32", "model.attention=xla", "data.seq_len=32", "train.steps=10", "train.warmup_steps=0"]
DROPOUT = {"model.dropout": 0.1, "model.token_dropout": 0.1, "model.attention_dropout": 0.1}


def tiny(*overrides: str):
    config = load_config(None, [*TINY, *overrides])
    return config, build_model(config, VOCAB, rngs=nnx.Rngs(0))


def batch(rows: int = 4, length: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of two packed documents each (segment ids 1 and 2, positions restarting)."""
    rng = np.random.default_rng(seed)
    cut = length // 3
    segment_ids = np.where(np.arange(length) < cut, 1, 2).astype(np.int32)[None].repeat(rows, 0)
    positions = np.where(np.arange(length) < cut, np.arange(length), np.arange(length) - cut)[None].repeat(rows, 0)
    return {
        "inputs": rng.integers(1, VOCAB, (rows, length)).astype(np.int32),
        "targets": rng.integers(1, VOCAB, (rows, length)).astype(np.int32),
        "segment_ids": segment_ids,
        "positions": positions.astype(np.int32),
        "weights": np.ones((rows, length), np.float32),
    }


def stepper(config, model):
    """``(rng, step) -> (params, metrics)``: one jitted train step (two micro-batches) from the model's weights."""
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(state)
    tx, _ = build_optimizer(config.train)
    fn = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=2, z_loss=0.0))

    def one_step(rng, step: int = 1):
        new_params, _, metrics = fn(params, tx.init(params), batch(), rng, step)
        return new_params, metrics

    return one_step


RUN_KEY = jax.random.key_data(jax.random.key(0))


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_at_rate_zero_a_training_step_is_the_step_without_dropout_bit_for_bit():
    one_step = stepper(*tiny())
    with_key, without = one_step(RUN_KEY), one_step(None)
    for a, b in zip(jax.tree.leaves(with_key), jax.tree.leaves(without)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_dropout_changes_the_training_loss_but_not_evaluation_or_generation():
    plain_config, plain = tiny()
    drop_config, dropped = tiny("model.dropout=0.3", "model.token_dropout=0.1", "model.attention_dropout=0.2")
    for a, b in zip(jax.tree.leaves(nnx.state(plain, nnx.Param)), jax.tree.leaves(nnx.state(dropped, nnx.Param))):
        np.testing.assert_array_equal(a, b)  # dropout takes no parameters and no initializer keys

    plain_loss = float(stepper(plain_config, plain)(RUN_KEY)[1]["loss"])
    drop_step = stepper(drop_config, dropped)
    drop_loss, other_step = (float(drop_step(RUN_KEY, step)[1]["loss"]) for step in (1, 2))
    assert drop_loss != plain_loss
    assert other_step != drop_loss  # each step draws new masks

    rng = np.random.default_rng(1)
    store = TokenStore.from_documents([rng.integers(1, VOCAB, n) for n in (40, 9, 70)], eot_id=0, vocab_size=VOCAB)
    scores = [evaluate(m, store, c, progress=False, word_count=100, byte_count=500)
              for c, m in ((plain_config, plain), (drop_config, dropped))]
    assert scores[0]["nll_sum"] == scores[1]["nll_sum"]
    generations = [generate(m, [[0, 5, 6], [0, 7]], eot_id=None, max_new_tokens=6) for m in (plain, dropped)]
    assert generations[0] == generations[1]


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
@settings(max_examples=6, deadline=None)
@given(rate=st.floats(0.05, 0.9), token_rate=st.sampled_from([0.0, 0.2]), attention_rate=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**31 - 1))
def test_without_a_key_the_forward_ignores_the_rates_and_with_one_it_drops(rate, token_rate, attention_rate, seed):
    _, plain = tiny()
    _, dropped = tiny(f"model.dropout={rate}", f"model.token_dropout={token_rate}",
                      f"model.attention_dropout={attention_rate}")
    b = batch(rows=2)
    fields = {"positions": b["positions"], "segment_ids": b["segment_ids"]}
    np.testing.assert_array_equal(dropped(b["inputs"], **fields), plain(b["inputs"], **fields))
    key = jax.random.key(seed)
    trained = dropped(b["inputs"], **fields, dropout_key=key)
    assert not np.array_equal(trained, plain(b["inputs"], **fields))
    np.testing.assert_array_equal(trained, dropped(b["inputs"], **fields, dropout_key=key))  # a key is one mask


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_token_dropout_zeroes_whole_token_embeddings_and_scales_the_rest():
    rate = 0.4
    _, model = tiny(f"model.token_dropout={rate}")
    b = batch(rows=3)
    fields = {"positions": b["positions"], "segment_ids": b["segment_ids"]}
    key = jax.random.key(7)
    # The model's first key goes to token dropout: one keep/drop draw per token, shared by its D features.
    keep = jax.random.bernoulli(jax.random.split(key, 3)[0], 1.0 - rate, (*b["inputs"].shape, 1))
    assert 0 < float(keep.mean()) < 1
    embeddings = model.embed_tokens(b["inputs"]) * keep / (1.0 - rate)
    want = model.from_embeddings(embeddings, **fields)
    np.testing.assert_allclose(model(b["inputs"], **fields, dropout_key=key), want, rtol=1e-5, atol=1e-6)


def test_rates_out_of_range_and_attention_dropout_on_a_kernel_are_refused():
    with pytest.raises(ConfigError, match=r"model.dropout: got 1.0, expected a rate in \[0, 1\)"):
        load_config(None, ["model.dropout=1.0"])
    for backend in ("pallas", "cudnn", "splash"):
        with pytest.raises(ConfigError, match=f"model.attention_dropout: got 0.1, expected 0 with "
                                              f"model.attention='{backend}'"):
            load_config(None, ["model.attention_dropout=0.1", f"model.attention={backend}"])
    load_config(None, ["model.attention_dropout=0.1", "model.attention=auto"])  # auto runs xla when dropping
    q = np.zeros((1, 8, 2, 4), np.float32)
    with pytest.raises(ValueError, match="attention dropout needs model.attention=xla"):
        attention(q, q, q, np.ones((1, 8), np.int32), backend="pallas", dropout_rate=0.1,
                  dropout_key=jax.random.key(0))


def test_the_train_cli_refuses_attention_dropout_on_pallas_in_one_line(tmp_path, capsys):
    from seqjax.main.train import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"run.dir={tmp_path / 'run'}", "model.attention=pallas", "model.attention_dropout=0.1"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "config error: model.attention_dropout: got 0.1" in line
    assert not (tmp_path / "run").exists()


RUNS = """
import json, sys
from seqjax.config.load import load_config
from seqjax.train.loop import train
for overrides in json.loads(sys.argv[1]):
    train(load_config(None, overrides))
"""


def run_in_one_process(runs: list[list[str]], devices: int | None = None) -> None:
    """Train each override list in turn, in one fresh Python (``devices`` forced CPU devices)."""
    proc = subprocess.run([sys.executable, "-c", RUNS, json.dumps(runs)], cwd=REPO, env=cli_env(devices=devices),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def dropout_runs(tiny_root, tmp_path_factory):
    """An uninterrupted 20-step run with dropout, and one stopped at 10 and resumed to 20 (one device)."""
    root = tmp_path_factory.mktemp("dropout")
    whole, resumed = root / "whole", root / "resumed"
    run_in_one_process([
        tiny_overrides(tiny_root, whole, **DROPOUT, **{"train.steps": 20}),
        tiny_overrides(tiny_root, resumed, **DROPOUT, **{"train.steps": 10}),
        tiny_overrides(tiny_root, resumed, **DROPOUT, **{"train.steps": 20}),
    ])
    return whole, resumed


@pytest.mark.slow
def test_resume_with_dropout_on_matches_an_uninterrupted_run_exactly(dropout_runs, reference):
    whole, resumed = dropout_runs
    losses = train_losses(whole)
    assert sorted(losses) == list(range(1, 21))
    assert train_losses(resumed) == losses
    assert all(losses[s] != reference[s] for s in range(1, 21))  # dropout was on in the loop


@pytest.mark.slow
def test_resume_with_dropout_on_8_devices_draws_the_masks_of_one_device(dropout_runs, tiny_root, tmp_path):
    whole, resumed = dropout_runs
    run_dir = tmp_path / "run"
    shutil.copytree(resumed, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "20")  # resume from the one-device checkpoint of step 10
    mesh = {"mesh.data": 4, "mesh.fsdp": 2}
    run_in_one_process([tiny_overrides(tiny_root, run_dir, **DROPOUT, **mesh, **{"train.steps": 20})], devices=8)
    losses, expected = train_losses(run_dir), train_losses(whole)
    assert sorted(losses) == list(range(1, 21))
    for step in range(11, 21):
        assert losses[step] == pytest.approx(expected[step], rel=1e-5), step


@pytest.mark.slow
def test_two_processes_with_dropout_match_one_process(dropout_runs, tiny_root, tmp_path):
    whole, _ = dropout_runs
    run_dir = tmp_path / "run"
    run_two_processes(tiny_overrides(tiny_root, run_dir, **DROPOUT,
                                     **{"mesh.data": 4, "mesh.fsdp": 2, "train.steps": 6}))
    losses, expected = train_losses(run_dir), train_losses(whole)
    assert sorted(losses) == list(range(1, 7))
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
