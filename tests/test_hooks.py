"""The loop's side duties are ordered hooks: a new one runs at its steps without editing the loop, and the metrics
flush runs before any hook that needs it (so a non-finite step never reaches a checkpoint)."""

from __future__ import annotations

import pytest

from seqjax.config.load import load_config
from seqjax.train.hooks import Hook, Hooks, StepState
from seqjax.train.loop import train
from seqjax.train.metrics import read_metrics
from test_train_support import tiny_overrides


def state(step: int, stopping: bool = False) -> StepState:
    return StepState(step, params=None, opt_state=None, rng=None, position=None, stopping=stopping)


def test_hooks_run_at_their_steps_in_order_with_the_flush_first():
    calls = []
    hooks = Hooks(Hook("flush", lambda s: calls.append(("flush", s.step)), every=4), last_step=10)
    hooks.add(Hook("save", lambda s: calls.append(("save", s.step)), every=5, when=lambda s: s.stopping))
    hooks.add(Hook("trace", lambda s: calls.append(("trace", s.step)), at_last=False, when=lambda s: s.step == 3,
                   after_flush=False))
    for step in range(1, 11):
        hooks.after_step(state(step, stopping=step == 7))
    assert calls == [("trace", 3), ("flush", 4), ("flush", 5), ("save", 5), ("flush", 7), ("save", 7),
                     ("flush", 8), ("flush", 10), ("save", 10)]
    assert hooks.names == ["flush", "save", "trace"]
    with pytest.raises(ValueError, match="'save' is already added"):
        hooks.add(Hook("save", print))


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_a_new_hook_runs_at_its_steps_after_the_metrics_reached_the_log(tiny_root, tmp_path):
    run_dir = tmp_path / "run"
    seen = []

    def mine(s: StepState) -> None:
        logged = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
        seen.append((s.step, max(logged), s.params is not None))

    config = load_config(None, tiny_overrides(tiny_root, run_dir, **{"train.steps": 10, "train.log_every": 100}))
    train(config, hooks=[Hook("mine", mine, every=3)])
    # Steps 3, 6, 9 and the last; each time every step so far was already flushed to metrics.jsonl, although
    # train.log_every=100 would not have flushed them on its own.
    assert seen == [(3, 3, True), (6, 6, True), (9, 9, True), (10, 10, True)]
