"""Rollout groups as batches (seqjax.data.rollouts): the prompt once with G completions each attending to it and
to itself, the prompt once per completion, or one completion a row all give the GRPO family's losses and
gradients to float32 rounding; the prompt-once row computes the prompt once; what cannot fit is one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqjax.config.load import load_config
from seqjax.config.rl import LAYOUTS
from seqjax.core.errors import DataError
from seqjax.data.rollouts import Group, rollout_batches
from seqjax.model import build_model
from seqjax.objectives import Inputs, resolve
from seqjax.objectives.base import target_logprobs
from seqjax.objectives.rl import ROWS

VOCAB = 64
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
        f"model.vocab_size={VOCAB}", "model.max_seq_len=64", "data.seq_len=64", "model.attention=xla",
        "model.param_dtype=float32", "model.compute_dtype=float32"]
# the draws' bounds, and each layout's batch shape holding whatever they draw: at most 3 groups of 4 completions
# of 6 tokens after a prompt of 6 (a group once: 5 + 4 x 7 = 33 predictions; a completion with its prompt: 11)
MAX_GROUPS, MAX_G, MAX_PROMPT, MAX_COMPLETION = 3, 4, 6, 6
SHAPES = {"prompt_once": (MAX_GROUPS, 64), "prompt_per_completion": (4, 64),
          "padded": (MAX_GROUPS * MAX_G, MAX_PROMPT + MAX_COMPLETION)}
SETTINGS = {"rl.epsilon": 0.2, "rl.epsilon_upper": 0.28, "rl.delta": None, "rl.beta": 0.04,
            "rl.use_bias_correction_kl": True, "rl.sapo_temperature_pos": 1.0, "rl.sapo_temperature_neg": 1.05,
            "rl.max_completion_length": MAX_COMPLETION}


@pytest.fixture(scope="module")
def model():
    return build_model(load_config(None, TINY), rngs=nnx.Rngs(0))


def groups_strategy():
    group = st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=MAX_PROMPT),
        st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=MAX_COMPLETION), min_size=2,
                 max_size=MAX_G),
        st.integers(0, 2**31 - 1))
    return st.lists(group, min_size=1, max_size=MAX_GROUPS)


def make_groups(drawn) -> list[Group]:
    out = []
    for prompt, completions, seed in drawn:
        rng = np.random.default_rng(seed)
        out.append(Group(np.asarray(prompt), [np.asarray(c) for c in completions],
                         rng.normal(size=len(completions)).astype(np.float32),
                         rng.random(len(completions)) < 0.2))
    return out


def sampled_logps(batch: dict, salt: float) -> np.ndarray:
    """Per scored target: a value of the completion and the token's place in it alone (the sampling policy's or the
    reference's log-probabilities, the same in every layout)."""
    out = np.zeros(batch["weights"].shape, np.float32)
    for number in np.unique(batch["completion"][batch["weights"] > 0]):
        at = (batch["completion"] == number) & (batch["weights"] > 0)
        k = np.arange(at.sum())
        out[at] = -3.0 + 0.3 * np.sin(salt * number + 1.7 * k)
    return out


def sampled_fields(batch: dict) -> dict:
    """The batch on device, its policy moved since sampling (``fresh`` 0: the ratio leaves 1) and a KL to a
    reference, both log-probabilities functions of the completion and the token's place alone."""
    rows = len(batch["inputs"])
    return {k: jnp.asarray(v) for k, v in batch.items()} | {
        "old_logps": jnp.asarray(sampled_logps(batch, 0.7)), "fresh": jnp.zeros((rows, 1), jnp.int32),
        "rollout_reference_logps": jnp.asarray(sampled_logps(batch, 1.3)),
        "reference_is_policy": jnp.zeros((rows, 1), jnp.int32)}


@functools.lru_cache(maxsize=None)
def every_loss(graphdef, level: str):
    """A jitted function of (params, fields): every loss type's loss (its sum over its global denominator, as the
    step divides it) and their gradients, one compile per layout's shapes."""
    settings_ = {**SETTINGS, "rl.importance_sampling_level": level}

    def losses(params, fields):
        model = nnx.merge(graphdef, params)
        objectives = [resolve([row.name]) for row in ROWS]
        # (one Inputs: the policy's forward runs once for every loss type, as a weighted objective's parts share it)
        inputs = Inputs(model, None, settings_, {k: v for o in objectives for k, v in o.totals(fields).items()})
        out = []
        for objective in objectives:
            terms = objective.loss(inputs, fields)
            out.append(terms.value / jnp.where(terms.denominator > 0, terms.denominator, 1.0))
        values = jnp.stack(out)
        return values, values

    return jax.jit(jax.jacrev(losses, has_aux=True))


def losses_and_grads(model, batch: dict, level: str) -> tuple[np.ndarray, list[np.ndarray]]:
    graphdef, params = nnx.split(model)
    grads, values = every_loss(graphdef, level)(params, sampled_fields(batch))
    return np.asarray(values), [np.asarray(g) for g in jax.tree.leaves(grads)]


def test_the_property_compares_every_layout_the_config_offers():
    assert set(SHAPES) == set(LAYOUTS)


@pytest.mark.slow  # (the full suite and CI run it; the fast loop has the layouts in test_grpo_trl)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups_strategy(), st.sampled_from(["token", "sequence"]))
def test_every_layout_gives_the_same_losses_and_gradients(model, drawn, level):
    """Every loss type of the GRPO family, token- or sequence-level ratio, on groups of any prompt and completion
    lengths, with completions masked out at random."""
    groups = make_groups(drawn)
    results = {}
    for layout, (rows, width) in SHAPES.items():
        (batch,) = rollout_batches(groups, layout, width, rows, steps=1)
        results[layout] = losses_and_grads(model, batch, level)
    values, grads = results["padded"]
    assert np.isfinite(values).all()
    for layout in ("prompt_once", "prompt_per_completion"):
        ours, our_grads = results[layout]
        np.testing.assert_allclose(ours, values, rtol=1e-5, atol=1e-6, err_msg=layout)
        for a, b in zip(our_grads, grads):  # ([loss types, *parameter shape])
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=layout)


def test_the_prompt_once_row_computes_the_prompt_once_and_each_completion_sees_only_it_and_itself(model):
    """A group of 3 completions of m tokens after a 5-token prompt: 4 + sum(m) positions, where one sequence per
    completion takes sum(4 + m); and each completion's log-probabilities are those of its own sequence alone."""
    prompt = np.asarray([5, 6, 7, 8, 9])
    completions = [np.asarray([11, 12]), np.asarray([13, 14, 15]), np.asarray([16])]
    group = Group(prompt, completions, np.zeros(3, np.float32), np.zeros(3, bool))
    (once,) = rollout_batches([group], "prompt_once", 32, 1, steps=1)
    (padded,) = rollout_batches([group], "padded", 8, 3, steps=1)
    assert int((once["segment_ids"] > 0).sum()) == 4 + sum(len(c) for c in completions)
    assert int((padded["segment_ids"] > 0).sum()) == sum(4 + len(c) for c in completions)
    logps = {}
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, b, s: target_logprobs(nnx.merge(graphdef, p), b, None, s))
    for name, batch in (("once", once), ("padded", padded)):
        scored = jnp.asarray(batch["weights"] > 0)
        values = np.asarray(forward(params, {k: jnp.asarray(v) for k, v in batch.items()}, scored))
        logps[name] = [values[(batch["completion"] == n) & (batch["weights"] > 0)] for n in (1, 2, 3)]
    for a, b, c in zip(logps["once"], logps["padded"], completions):
        assert len(a) == len(c)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_what_cannot_fit_is_one_line():
    group = Group(np.arange(1, 9), [np.arange(1, 9)] * 4, np.zeros(4, np.float32), np.zeros(4, bool))
    with pytest.raises(DataError, match=r"rl.layout=prompt_once: a group with its prompt takes 39 predictions, "
                                        r"more than data.seq_len=32"):
        rollout_batches([group], "prompt_once", 32, 4, steps=1)
    with pytest.raises(DataError, match=r"takes 4 rows of data.seq_len=16, more than data.batch_size=2 x "
                                        r"rl.steps_per_generation=1"):
        rollout_batches([group], "padded", 16, 2, steps=1)


def test_a_generation_batch_is_dealt_to_its_steps_and_shards_whole():
    """8 groups of different sizes over 2 steps and 2 shards of 2 rows each: every completion is in exactly one
    step, and the steps' token shares add to the generation batch's scored tokens (DAPO's normalizer)."""
    rng = np.random.default_rng(0)
    groups = [Group(np.arange(1, 4), [np.arange(1, 2 + int(rng.integers(0, 6))) for _ in range(2)],
                    np.zeros(2, np.float32), np.zeros(2, bool)) for _ in range(8)]
    batches = rollout_batches(groups, "prompt_once", 32, 4, steps=2, shards=2)
    seen = np.concatenate([np.unique(b["completion"][b["completion"] > 0]) for b in batches])
    assert sorted(seen.tolist()) == list(range(1, 17))
    scored = sum(float(b["weights"].sum()) for b in batches)
    assert sum(float(b["token_share"].sum()) for b in batches) == pytest.approx(scored)
