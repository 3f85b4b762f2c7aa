"""The unigram baseline, the FLOPs formula, metrics.jsonl on resume, and load_for_inference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from seqjax.config import ConfigError, load_config
from seqjax.train.flops import flops_per_token, mfu, peak_flops_per_device
from seqjax.train.metrics import MetricsLog, read_metrics, unigram_perplexity


def test_unigram_perplexity_is_exp_of_the_smoothed_frequency_cross_entropy():
    eot = 0
    train = np.array([eot, 1, 1, 1, 2, eot])  # scored: 1 1 1 2 eot (the first token has no context)
    valid = np.array([eot, 1, 2, eot])  # scored: 1 2 eot
    counts = np.array([1, 3, 1, 0]) + 1.0  # add-one smoothing over a 4-token vocabulary
    p = counts / counts.sum()
    expected = math.exp(-(math.log(p[1]) + math.log(p[2]) + math.log(p[0])) / 3)
    assert unigram_perplexity(train, valid, vocab_size=4) == pytest.approx(expected)
    # A token never seen in training still gets a finite probability.
    assert math.isfinite(unigram_perplexity(train, np.array([eot, 3, 3]), vocab_size=4))


def test_flops_per_token_follows_the_documented_formula():
    model = load_config(None, ["model.d_model=64", "model.n_layers=3", "model.n_heads=4"]).model
    # tied: the embedding table is the LM head, so every parameter counts
    assert flops_per_token(model, 128, num_params=10_000, vocab_size=50) == 6 * 10_000 + 12 * 3 * 4 * 16 * 128
    untied = load_config(
        None, ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.tie_embeddings=false"]
    ).model
    assert (
        flops_per_token(untied, 128, num_params=10_000, vocab_size=50) == 6 * (10_000 - 50 * 64) + 12 * 3 * 4 * 16 * 128
    )
    assert mfu(1000.0, 1e9, num_devices=2, peak=1e12) == pytest.approx(0.5)
    assert mfu(1000.0, 1e9, num_devices=2, peak=None) is None


def test_mfu_peak_comes_from_the_config_then_the_table_and_is_unknown_on_cpu():
    class Device:
        def __init__(self, kind):
            self.device_kind = kind

    assert peak_flops_per_device(Device("NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops_per_device(Device("cpu")) is None
    assert peak_flops_per_device(Device("cpu"), override=2e11) == 2e11


def test_metrics_log_cuts_lines_after_the_resumed_step(tmp_path):
    rows = [{"step": s, "loss": float(s)} for s in range(1, 6)] + [{"step": 4, "val_loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    log = MetricsLog(tmp_path, resume_step=3)
    log.write({"step": 4, "loss": 40.0})
    log.close()
    assert read_metrics(tmp_path) == rows[:3] + [{"step": 4, "loss": 40.0}]


def test_load_for_inference_from_a_run_dir_and_from_a_step_folder(reference, tiny_root, tmp_path):
    import jax
    from flax import nnx

    from seqjax.train.checkpoint import load_for_inference

    run_dir = tiny_root / "reference"
    config, model = load_for_inference(run_dir)
    assert config.model.vocab_size == 300 and config.train.steps == 60
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    _, older = load_for_inference(run_dir / "checkpoints" / str(steps[0]))
    latest = jax.tree.leaves(nnx.state(model, nnx.Param))
    early = jax.tree.leaves(nnx.state(older, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(latest, early))  # different steps, different weights
    with pytest.raises(ConfigError, match="expected a run directory"):
        load_for_inference(tmp_path)
