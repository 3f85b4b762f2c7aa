"""Generation batches made ahead (rl.max_staleness, mesh.sampler_devices; seqjax/train/ahead.py): generation g is
sampled with the weights at the start of generation g - k, each made once; a run whose sampler has devices of its
own makes exactly the sequential run's batches and takes its losses, resumed in the middle included."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError, MeshConfig
from seqjax.model.sharding import split_devices
from seqjax.train.ahead import Ahead, Side, Tally
from test_rl_run import rl_overrides
from test_train_support import assert_ok, run_cli, train_losses


def drive(ahead: Ahead, steps: int, every: int, start: int = 1) -> dict[int, float]:
    """A run's loop over ``ahead``: each generation's first step takes its batch with that step's weights
    (here the step's number as an array); which weights each batch was made with."""
    used = {}
    for step in range(start, steps + 1):
        generation, within = divmod(step - 1, every)
        if within == 0:
            made = ahead.take(generation, jnp.float32(step), step)
            assert made["generation"] == generation
            used[generation] = made["weights"]
    return used


def recorder(calls: list):
    def make(params, generation, step, side):
        calls.append(generation)
        return {"generation": generation, "weights": float(params), "step": step}
    return make


@settings(max_examples=25, deadline=None)
@given(staleness=st.integers(0, 3), every=st.integers(1, 3), steps=st.integers(1, 12), threaded=st.booleans())
def test_generation_g_is_made_once_with_the_weights_of_generation_g_minus_k(staleness, every, steps, threaded):
    calls = []
    last = (steps - 1) // every
    side = Side(None, None, None, jax.sharding.SingleDeviceSharding(jax.devices()[-1])) if threaded else None
    ahead = Ahead(recorder(calls), staleness, side)
    try:
        used = drive(ahead, steps, every)
    finally:
        ahead.close()
    # each generation once, in order: the last step's, and k beyond it (a longer run's, for a continued run)
    assert calls == list(range(last + staleness + 1))
    # generation g: the weights at the start of generation max(0, g - k)
    assert used == {g: float(max(0, g - staleness) * every + 1) for g in range(last + 1)}


@settings(max_examples=15, deadline=None)
@given(staleness=st.integers(1, 3), steps=st.integers(2, 10), data=st.data())
def test_a_queue_read_back_after_a_cut_goes_on_as_the_uninterrupted_one(staleness, steps, data):
    """What RolloutSource.set_state does with the batches on disk: the launched ones put back in the queue."""
    cut = data.draw(st.integers(1, steps - 1))
    whole_calls, calls = [], []
    whole = drive(Ahead(recorder(whole_calls), staleness), steps, 1)
    first = Ahead(recorder(calls), staleness)
    drive(first, cut, 1)
    resumed = Ahead(recorder(calls), staleness)
    resumed.launched, resumed.queue = first.launched, dict(first.queue)
    assert drive(resumed, steps, 1, start=cut + 1) == {g: w for g, w in whole.items() if g >= cut}
    assert calls == whole_calls  # (nothing made twice, nothing skipped)


def test_a_sampler_mesh_is_refused_in_one_line_where_it_cannot_work(tmp_path):
    base = ["data.corpus=jsonl", "data.format=prompt", f"data.train_files=[{tmp_path / 'p.jsonl'}]"]
    with pytest.raises(ConfigError, match=r"mesh.sampler_devices: got 2 with data.format='text', expected 0"):
        load_config(None, ["mesh.sampler_devices=2"])
    with pytest.raises(ConfigError, match=r"got 2 with rl.max_staleness=0, expected rl.max_staleness >= 1"):
        load_config(None, [*base, "mesh.sampler_devices=2"])
    with pytest.raises(ConfigError, match=r"rl.rollouts_file=r.jsonl, expected 0: replayed"):
        load_config(None, [*base, "mesh.sampler_devices=2", "rl.max_staleness=1", "rl.rollouts_file=r.jsonl"])
    devices = list(range(4))
    assert split_devices(MeshConfig(sampler_devices=1), devices) == ([0, 1, 2], [3])
    with pytest.raises(ConfigError, match="mesh.sampler_devices: got 4, expected fewer than the 4 devices"):
        split_devices(MeshConfig(sampler_devices=4), devices)


def test_a_steps_rows_divide_between_the_trainers_and_the_samplers_shards(tmp_path):
    """5 devices, 2 of them the sampler's: rows split 3 ways to train and 2 ways to sample, so a step's rows are
    sized to a multiple of 6 (the sampler would refuse a batch it cannot split)."""
    from seqjax.train.rollouts import row_shards

    base = ["data.corpus=jsonl", "data.format=prompt", f"data.train_files=[{tmp_path / 'p.jsonl'}]",
            "rl.max_staleness=1"]
    trainer = {"data": 3, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert row_shards(load_config(None, [*base, "mesh.sampler_devices=2"]), trainer) == 6
    assert row_shards(load_config(None, base), trainer) == 3
    assert row_shards(load_config(None, [*base, "mesh.sampler_devices=3"]), trainer) == 3


def rollouts(run_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for path in sorted((run_dir / "rollouts").glob("generation_*.npz")):
        with np.load(path) as f:
            out[path.name] = {k: f[k] for k in f.files}
    return out


@pytest.mark.slow  # (three CLI runs on simulated devices: the full suite)
def test_a_sampler_of_its_own_devices_makes_the_sequential_runs_batches_resumed_or_not(tmp_path):
    """One step off-policy (rl.max_staleness=1), two steps a generation batch, the rows split over 2 devices:
    sampled on the training mesh between steps, and on 2 devices of its own while the other 2 train, cut after
    step 3 (in the middle of a generation batch, the next one launched) and resumed. The same generation batches
    (tokens, advantages, old log-probabilities) and the same losses, bit for bit."""
    common = ["train.steps=6", "train.checkpoint_every=3", "rl.max_staleness=1", "rl.prompts_per_step=1",
              "rl.steps_per_generation=2", "data.batch_size=2", "mesh.data=2"]
    sequential, split = tmp_path / "sequential", tmp_path / "split"
    assert_ok(run_cli(rl_overrides(tmp_path, sequential, *common), devices=2))
    apart = [*common, "mesh.sampler_devices=2"]
    assert_ok(run_cli(rl_overrides(tmp_path, split, *apart, "train.steps=3"), devices=4))
    resumed = run_cli(rl_overrides(tmp_path, split, *apart), devices=4)
    assert_ok(resumed)
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["resumed_from"] == 3
    assert "the sampler's mesh {'data': 2" in resumed.stderr
    assert train_losses(split) == train_losses(sequential) and len(train_losses(split)) == 6
    ours, theirs = rollouts(split), rollouts(sequential)
    # (generation 2 trains at steps 5-6; generation 3, launched at step 5, waits for a longer run)
    assert list(ours) == ["generation_000001.npz", "generation_000002.npz", "generation_000003.npz"]
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].keys() == theirs[name].keys()
        for key in ours[name]:
            np.testing.assert_array_equal(ours[name][key], theirs[name][key], err_msg=f"{name} {key}")


@settings(max_examples=40, deadline=None)
@given(owns=st.lists(st.integers(1, 500), min_size=1, max_size=12), staleness=st.integers(0, 3), data=st.data())
def test_a_batch_made_again_after_a_resume_counts_its_tokens_from_its_predecessor(owns, staleness, data):
    """TRL's num_tokens through each generation batch: a run cut with batches launched ahead, resumed, and any of
    those (the one in training and the k beyond it) found damaged and made again, in order: each counts what the
    uninterrupted run counted (the same completions), not from the newest launched batch's total."""
    whole = Tally()
    through = [whole.add(g, own) for g, own in enumerate(owns)]
    assert through == list(np.cumsum(owns))
    launched = data.draw(st.integers(0, len(owns) - 1))
    cut = Tally()
    cut.restore(json.loads(json.dumps(whole.state(launched, staleness))), launched)
    damaged = data.draw(st.sets(st.integers(max(0, launched - staleness), launched)))
    for g in sorted(damaged):
        assert cut.add(g, owns[g]) == through[g], (g, launched)
