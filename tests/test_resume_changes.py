"""Resuming under a changed config: what keeps exact resume goes on (and is printed), what changes the batches
or the model is refused with nothing touched, and with train.allow_config_change the data restarts at the
documented position, the next epoch boundary.

The refusals run the CLI in this process (they stop before any step is compiled); the runs that train are
subprocesses on the tiny corpus (tests/test_train_support.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqjax.train.metrics import read_metrics
from test_train_support import (
    assert_ok,
    checkpoint_steps,
    copy_reference,
    run_cli,
    snapshot,
    tiny_overrides,
    train_losses,
)

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow


def refused(overrides: list[str], capsys) -> str:
    """Run the training CLI in this process, expect exit code 2, and return its one-line message."""
    from seqjax.main.train import main

    with pytest.raises(SystemExit) as exit_:
        main(overrides)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if " ERROR " in line]
    assert "Traceback" not in err
    return line


def test_a_shape_change_on_resume_exits_2_lists_the_keys_and_touches_nothing(reference, tiny_root, tmp_path, capsys):
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    before = snapshot(run_dir)
    line = refused(tiny_overrides(tiny_root, run_dir, **{"model.d_ff": 128, "train.steps": 70}), capsys)
    assert "checkpoints/60 does not fit this config, which changed model.d_ff: 64 -> 128" in line
    assert "params/blocks/0/mlp/w_up: checkpoint (32, 64) float32, now (32, 128) float32" in line
    assert "Nothing was moved" in line
    assert snapshot(run_dir) == before  # every checkpoint, metrics.jsonl and config.yaml as they were
    assert not (run_dir / "checkpoints_corrupt").exists()


@pytest.mark.parametrize("key, value, old", [("data.batch_size", 8, 16), ("data.seq_len", 16, 32)])
def test_a_change_to_the_batches_is_refused_naming_the_key_and_the_override(reference, tiny_root, tmp_path, capsys,
                                                                            key, value, old):
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    before = snapshot(run_dir)
    line = refused(tiny_overrides(tiny_root, run_dir, **{key: value, "train.steps": 70}), capsys)
    assert f"checkpoints/60 was written under another config: {key}: {old} -> {value}" in line
    assert "set train.allow_config_change=true" in line
    assert snapshot(run_dir) == before


def test_a_checkpoint_without_its_config_says_that_nothing_can_be_checked(reference, tiny_root, tmp_path):
    """Neither config/metadata nor config.yaml: a changed data.batch_size resumed without a word."""
    import shutil

    run_dir = copy_reference(tiny_root, tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / "60" / "config")
    (run_dir / "config.yaml").unlink()
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **{"data.batch_size": 8, "train.steps": 62}))
    assert_ok(proc)
    assert "checkpoints/60 carries no config" in proc.stderr
    assert "resumes its parameters, optimizer and data position under the config given now" in proc.stderr
    assert sorted(train_losses(run_dir))[-2:] == [61, 62]


def test_a_new_training_text_is_refused_even_under_the_same_keys(reference, tiny_root, tmp_path, capsys):
    """The checkpoint records the source files' hashes: the same file name with other text is another data set."""
    run_dir = copy_reference(tiny_root, tmp_path / "run")
    other = tmp_path / "corpus"
    other.mkdir()
    lines = (tiny_root / "train.jsonl").read_text().splitlines()
    (other / "train.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    overrides = tiny_overrides(tiny_root, run_dir, **{"train.steps": 70, "data.cache_dir": tmp_path / "cache",
                                                      "data.train_files": f"[{other / 'train.jsonl'}]",
                                                      "tokenizer.path": run_dir / "tokenizer.json"})
    line = refused(overrides, capsys)
    assert "training text (xxh3 of each file)" in line and "set train.allow_config_change=true" in line


def test_changes_that_keep_exact_resume_go_on_with_the_same_losses_and_are_printed(reference, tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **{"train.steps": 10})))
    changed = {"train.steps": 20, "train.checkpoint_every": 4, "train.log_every": 3, "train.prefetch": 0,
               "eval.mode": "sliding", "train.keep_checkpoints": 2}
    proc = run_cli(tiny_overrides(tiny_root, run_dir, **changed))
    assert_ok(proc)
    assert "config changes since checkpoint 10: " in proc.stderr
    assert "train.steps: 10 -> 20" in proc.stderr and "eval.mode: 'blocks' -> 'sliding'" in proc.stderr
    assert train_losses(run_dir) == {step: reference[step] for step in range(1, 21)}
    (resume_row,) = [r for r in read_metrics(run_dir) if r.get("event") == "resume"]
    assert resume_row["step"] == 10 and resume_row["config_changes"]["train.steps"] == [10, 20]
    assert "data_restart" not in resume_row
    # Each checkpoint keeps the config it was written under; config.yaml at the root is the latest run's.
    assert json.loads((run_dir / "checkpoints" / "20" / "config" / "metadata").read_text())["train"]["steps"] == 20
    assert "steps: 20" in (run_dir / "config.yaml").read_text()


def test_with_the_override_the_data_restarts_at_thenext_epoch_start(reference, tiny_root, tmp_path):
    """Checkpoint 60 stopped inside epoch e; the resumed run's first batch is batch 0 of epoch e + 1, cut by the
    new config (rows of 8), and its loss is the checkpoint's model on exactly that batch."""
    from seqjax.config.load import load_config
    from seqjax.data.pipeline import build_pipeline
    from seqjax.model.loss import lm_loss
    from seqjax.store.build import prepare
    from seqjax.weights.inference import load_for_inference

    run_dir = copy_reference(tiny_root, tmp_path / "run")
    stopped = json.loads((run_dir / "checkpoints" / "60" / "data" / "process_0-of-1.json").read_text())
    assert stopped["batch"] > 0, "the reference must stop inside an epoch for this test to mean anything"
    overrides = tiny_overrides(tiny_root, run_dir, **{"data.batch_size": 8, "train.steps": 62,
                                                      "train.allow_config_change": "true"})
    proc = run_cli(overrides)
    assert_ok(proc)
    boundary = {"epoch": stopped["epoch"] + 1, "batch": 0}
    assert f"the data restarts at {boundary} of the new config" in proc.stderr
    (resume_row,) = [r for r in read_metrics(run_dir) if r.get("event") == "resume"]
    assert resume_row["config_changes"]["data.batch_size"] == [16, 8]
    assert resume_row["data_restart"] == {"from": stopped, "to": boundary}
    saved = json.loads((run_dir / "checkpoints" / "62" / "data" / "process_0-of-1.json").read_text())
    assert (saved["epoch"], saved["batch"]) == (boundary["epoch"], 2)  # (its window keys only save planning)
    assert 60 in checkpoint_steps(run_dir) and train_losses(run_dir)[60] == reference[60]

    config = load_config(None, overrides)
    store = prepare(config, splits=("train",)).stores["train"]
    batches = iter(build_pipeline(config, store))
    batches.set_state(boundary)
    batch = next(batches)
    _, model = load_for_inference(run_dir / "checkpoints" / "60")
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    loss, _ = lm_loss(logits, batch["targets"], batch["weights"])
    assert train_losses(run_dir)[61] == pytest.approx(float(np.asarray(loss)), rel=1e-5)


def test_a_data_restart_moves_a_mixture_source_by_source_to_its_next_epoch():
    from seqjax.config.load import load_config
    from seqjax.data.pipeline import next_epoch_start

    two = load_config(None, ["data.sources=[{name: a, train_files: [a.txt]}, {name: b, train_files: [b.txt]}]",
                             "data.corpus=text"])
    state = {"step": 40, "sources": [{"epoch": 2, "window": 0, "row": 0}, {"epoch": 0, "window": 1, "row": 3}]}
    assert next_epoch_start(state, two) == {
        "step": 40, "sources": [{"epoch": 2, "window": 0, "row": 0}, {"epoch": 1, "window": 0, "row": 0}]}
    one = load_config(None, ["data.sources=[{name: a, train_files: [a.txt]}]", "data.corpus=text"])
    assert next_epoch_start(state, one) == {"step": 0, "sources": [{"epoch": 0, "window": 0, "row": 0}]}
    plain = load_config(None, [])
    assert next_epoch_start(state, plain) == {"epoch": 0, "batch": 0}  # out of a mixture: from the start
    windowed = {"epoch": 3, "batch": 17, "window": 1, "window_batch": 5}
    assert next_epoch_start(windowed, plain) == {"epoch": 4, "batch": 0}
    assert next_epoch_start({"epoch": 3, "batch": 0, "window": 0, "window_batch": 0}, plain) == {"epoch": 3,
                                                                                                  "batch": 0}
