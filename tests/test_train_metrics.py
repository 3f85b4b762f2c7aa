"""The unigram baseline, the FLOPs formula, metrics.jsonl on resume, and load_for_inference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.train.flops import flops_per_token, mfu, peak_flops_per_device
from seqjax.train.metrics import MetricsLog, read_metrics, unigram_perplexity
from test_train_support import tiny_overrides


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


def test_a_new_run_moves_an_old_metrics_log_aside_and_never_cuts_it(tmp_path, caplog):
    old = "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 8))
    (tmp_path / "metrics.jsonl").write_text(old)
    log = MetricsLog(tmp_path, resume_step=0)  # no checkpoint to resume: a new run
    log.write({"step": 1, "loss": 9.0})
    log.close()
    (aside,) = tmp_path.glob("metrics.*.jsonl")
    assert aside.read_text() == old
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 9.0}]
    assert f"moved to {aside.name}" in caplog.text


def test_a_resume_puts_back_the_checkpoints_own_row_and_reports_a_cut_line(tmp_path, caplog):
    """A kill cut step 10's line short; checkpoint 10 kept that row, so the history loses nothing."""
    rows = [{"step": s, "loss": float(s)} for s in range(1, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 10, "lo')
    log = MetricsLog(tmp_path, resume_step=10, checkpoint_row={"step": 10, "loss": 10.0})
    log.note({"step": 10, "event": "resume", "config_changes": {}})
    log.write({"step": 11, "loss": float("nan"), "skipped": True})  # JSON has no NaN: written as null
    log.close()
    assert "line(s) 10 were cut short" in caplog.text and "had no row for step 10" in caplog.text
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text
    assert read_metrics(tmp_path) == rows + [{"step": 10, "loss": 10.0}, {"step": 10, "event": "resume",
                                                                          "config_changes": {}},
                                             {"step": 11, "loss": None, "skipped": True}]


@pytest.mark.slow
def test_load_for_inference_from_a_run_dir_and_from_a_step_folder(reference, tiny_root, tmp_path):
    import jax
    from flax import nnx

    from seqjax.weights.inference import load_for_inference

    run_dir = tiny_root / "reference"
    config, model = load_for_inference(run_dir)
    assert config.model.vocab_size == 300 and config.train.steps == 60
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    _, older = load_for_inference(run_dir / "checkpoints" / str(steps[0]))
    latest = jax.tree.leaves(nnx.state(model, nnx.Param))
    early = jax.tree.leaves(nnx.state(older, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(latest, early))  # different steps, different weights
    with pytest.raises(ConfigError, match=r"is none of what it takes; expected a seqjax run folder \(checkpoints/\)"):
        load_for_inference(tmp_path)


class _Recorder:
    """Stands in for a tracker package: records every call made on it."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self

        return record


def test_metrics_go_to_the_trackers_run_trackers_names_and_jsonl_always(tmp_path, monkeypatch):
    import sys
    import types

    board, wandb_run = _Recorder(), _Recorder()
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=lambda *a, **k: board))
    wandb = types.SimpleNamespace(init=lambda **kwargs: wandb_run.calls.append(("init", (), kwargs)) or wandb_run)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # both "installed"
    config = load_config(None, ["run.wandb_project=lm"])
    log = MetricsLog(tmp_path, resume_step=0, trackers=["tensorboard", "wandb"], config=config)
    log.write({"step": 1, "loss": 2.5, "mfu": None, "skipped": True})
    log.write({"step": 1, "val_loss": 2.0}, prefix="valid")
    log.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5, "mfu": None, "skipped": True},
                                      {"step": 1, "val_loss": 2.0}]
    scalars = [args for name, args, _ in board.calls if name == "add_scalar"]
    assert scalars == [("train/loss", 2.5, 1), ("valid/val_loss", 2.0, 1)]  # numbers only, no step, no bools
    init = wandb_run.calls[0][2]
    assert init["project"] == "lm" and init["resume"] == "allow" and init["config"]["run"]["wandb_project"] == "lm"
    assert [kw["step"] for name, _, kw in wandb_run.calls if name == "log"] == [1, 1]
    assert wandb_run.calls[-1][0] == "finish" and board.calls[-1][0] == "close"


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(tiny_root, tmp_path, monkeypatch, capsys):
    from seqjax.main.train import main

    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "tensorboardX" else real(name))
    with pytest.raises(SystemExit) as exit_:
        main(tiny_overrides(tiny_root, tmp_path / "run", **{"run.trackers": "[jsonl,tensorboard]"}))
    assert exit_.value.code == 2
    assert "run.trackers: 'tensorboard' needs the tensorboardX package" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="run.trackers\\[1\\]: got 'tb', expected one of jsonl, tensorboard, wandb"):
        load_config(None, ["run.trackers=[jsonl,tb]"])


def test_newest_readable_tries_steps_newest_first_and_reports_each_unreadable_one():
    from seqjax.weights.saved import newest_readable

    unreadable = []

    def restore(step):
        if step > 20:
            raise OSError(f"step {step} is truncated")
        return f"state {step}"

    found = newest_readable([10, 30, 20, 40], restore, lambda step, err: unreadable.append((step, str(err))))
    assert found == (20, "state 20")
    assert unreadable == [(40, "step 40 is truncated"), (30, "step 30 is truncated")]
    assert newest_readable([30, 40], restore, lambda step, err: None) is None


def _step_logger(tmp_path, **kwargs):
    from seqjax.train.metrics import StepLogger

    settings = dict(steps=6, start_step=0, tokens_seen=100, log_every=2, learning_rates=np.linspace(0, 1, 7),
                    flops_per_token=lambda length: 1e3, peak=None, z_loss=False, nonfinite="stop",
                    last_good=lambda: "step 0 in somewhere", primary=True)
    return StepLogger(MetricsLog(tmp_path, resume_step=0), **{**settings, **kwargs})


def _metrics(loss: float, tokens: int = 12) -> dict[str, np.ndarray]:
    finite = math.isfinite(loss)
    return {"loss": np.float32(loss), "grad_norm": np.float32(1.5 if finite else loss), "tokens": np.int32(tokens),
            "finite": np.bool_(finite)}


def test_step_logger_writes_one_row_per_step_counts_tokens_and_logs_plain_lines_off_a_terminal(tmp_path, caplog):
    with _step_logger(tmp_path) as steps, caplog.at_level("INFO", logger="seqjax.train.metrics"):
        assert steps.plain  # pytest's stderr is not a terminal: plain lines instead of a bar
        for step in (1, 2):
            steps.add(step, _metrics(3.0 - step), (2, 8))
            assert steps.due(step)  # the first step alone (compilation), then every log_every
        steps.flush(2)
        assert not steps.due(3)
    steps.log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and [r["loss"] for r in rows] == [2.0, 1.0]
    assert rows[1]["tokens_seen"] == 124 and steps.tokens_seen == 124
    assert rows[0]["learning_rate"] == pytest.approx(1 / 6) and rows[0]["padding_fraction"] == pytest.approx(0.25)
    assert [r.getMessage() for r in caplog.records if "step 2/6" in r.getMessage()] == [
        f"step 2/6: loss 1.0000, {rows[1]['tokens_per_s']:.0f} tokens/s"]


def test_step_logger_stops_on_a_nonfinite_step_before_logging_it(tmp_path):
    from seqjax.train.metrics import NonFiniteLoss

    steps = _step_logger(tmp_path)
    steps.add(1, _metrics(1.0), (2, 8))
    steps.add(2, _metrics(float("nan")), (2, 8))
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss nan .* at step 2; .*Last good checkpoint: step 0 in"):
        steps.flush(2)
    steps.log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_the_stop_message_names_what_was_not_finite_the_gradient_or_the_loss(tmp_path):
    """A finite loss with a NaN gradient read "non-finite loss 6.238 (grad norm nan)"."""
    from seqjax.train.metrics import NonFiniteLoss

    steps = _step_logger(tmp_path)
    steps.add(1, {**_metrics(6.238), "grad_norm": np.float32("nan"), "finite": np.bool_(False)}, (2, 8))
    with pytest.raises(NonFiniteLoss, match=r"^non-finite gradient \(grad norm nan; loss 6.238\) at step 1; "):
        steps.flush(1)
    steps.log.close()


def test_step_logger_under_skip_stops_after_a_log_window_of_skipped_steps(tmp_path):
    from seqjax.train.metrics import NonFiniteLoss

    steps = _step_logger(tmp_path, nonfinite="skip", log_every=3)
    for step, loss in ((1, float("nan")), (2, float("nan")), (3, 1.0), (4, float("inf")), (5, float("nan"))):
        steps.add(step, _metrics(loss), (2, 8))
    steps.flush(5)  # at most two in a row: the odd spike is what skip is for
    steps.add(6, _metrics(float("nan")), (2, 8))
    with pytest.raises(NonFiniteLoss, match=r"the last 3 steps \(to step 6\) were all non-finite and skipped"):
        steps.flush(6)
    steps.log.close()


def test_bars_are_drawn_only_on_a_terminal_and_tqdm_disable_turns_them_off(monkeypatch):
    import sys

    from seqjax.core.progress import on_terminal, progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert on_terminal() and not progress_bar(total=3).disable
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not on_terminal() and progress_bar(total=3).disable
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert on_terminal()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress_bar(total=3).disable


def test_off_a_terminal_a_long_phase_says_how_far_it_is_every_half_minute(monkeypatch, caplog):
    """No phase is silent in a log file: a bar that is off logs a plain line every PLAIN_EVERY_S seconds (the final
    validation and eval on pairs said nothing for minutes); the train bar leaves its lines to the step logger."""
    import sys

    from seqjax.core import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    bar = progress.progress_bar(total=10, desc="dpo on valid", unit="batch")
    with caplog.at_level("INFO", logger="seqjax"):
        for _ in range(10):
            clock[0] += 7.0
            bar.update()
    lines = [r.getMessage() for r in caplog.records if "dpo on valid" in r.getMessage()]
    assert lines == ["dpo on valid: 5/10 batch, 35 s", "dpo on valid: 10/10 batch, 70 s"]
    quiet = progress.progress_bar(total=10, desc="train", plain=False)
    with caplog.at_level("INFO", logger="seqjax"):
        for _ in range(10):
            clock[0] += 40.0
            quiet.update()
    assert not any("train:" in r.getMessage() for r in caplog.records)
