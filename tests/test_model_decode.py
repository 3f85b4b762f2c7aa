"""KV-cache decoding equals full forward passes, compiles once, and refuses bad sizes."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.model import build_model
from seqjax.model.decode import _step_fn, decode_step, prefill, prompt_batch

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    cfg = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                             "model.d_ff=64", "model.max_seq_len=16", "model.attention=xla", "data.seq_len=16"])
    return build_model(cfg, VOCAB, rngs=nnx.Rngs(3))


def full_forward_next_logits(model, tokens: list[int]) -> np.ndarray:
    """Logits after ``tokens`` from a full forward pass (padded to max_seq_len so it compiles once)."""
    (x, p, g), n = prompt_batch([tokens]), len(tokens)
    pad = ((0, 0), (0, model.cfg.max_seq_len - n))
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, *(np.pad(a, pad) for a in (x, p, g))))[0, n - 1]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, inputs, positions, segment_ids):
    return nnx.merge(graphdef, state)(inputs, positions=positions, segment_ids=segment_ids)


def test_cached_decode_equals_full_forward_and_compiles_once(model):
    prompts = [[5, 9, 1, 33, 2], [7, 40]]  # different lengths: the second row is right-padded
    new_tokens = 5
    logits, cache = prefill(model, *prompt_batch(prompts), max_len=5 + new_tokens)
    compiled_before = _step_fn()._cache_size()
    rng = np.random.default_rng(0)
    seqs = [list(p) for p in prompts]
    for step in range(new_tokens):
        for row, seq in enumerate(seqs):
            np.testing.assert_allclose(
                np.asarray(logits[row]), full_forward_next_logits(model, seq), rtol=1e-5, atol=1e-5
            )
        tokens = rng.integers(0, VOCAB, len(seqs))  # any continuation, not only greedy
        for seq, token in zip(seqs, tokens):
            seq.append(int(token))
        logits, cache = decode_step(model, tokens, cache)
    assert _step_fn()._cache_size() - compiled_before <= 1  # one compile for all steps, none per token


def test_a_packed_prompt_continues_its_last_segment_only(model):
    """Row = [doc A | doc B]: decoding continues B exactly as if A were not there."""
    a, b = [3, 4, 5, 6], [8, 9, 10]
    inputs = np.asarray([a + b], np.int32)
    positions = np.asarray([list(range(len(a))) + list(range(len(b)))], np.int32)
    segment_ids = np.asarray([[1] * len(a) + [2] * len(b)], np.int32)
    logits, cache = prefill(model, inputs, positions, segment_ids, max_len=9)
    np.testing.assert_allclose(np.asarray(logits[0]), full_forward_next_logits(model, b), rtol=1e-5, atol=1e-5)
    logits, _ = decode_step(model, [11], cache)
    np.testing.assert_allclose(np.asarray(logits[0]), full_forward_next_logits(model, b + [11]), rtol=1e-5, atol=1e-5)


def test_decoding_past_the_cache_is_loud(model):
    logits, cache = prefill(model, [[1, 2, 3]], max_len=4)
    logits, cache = decode_step(model, [4], cache)
    assert np.isfinite(np.asarray(logits)).all()
    logits, _ = decode_step(model, [5], cache)
    assert np.isnan(np.asarray(logits)).all()


def test_bad_sizes_raise(model):
    with pytest.raises(ValueError, match="max_len=3, expected between the prompt length 4 and model.max_seq_len=16"):
        prefill(model, [[1, 2, 3, 4]], max_len=3)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        prefill(model, [[1, 2]], max_len=17)
    _, cache = prefill(model, [[1, 2]], max_len=4)
    with pytest.raises(ValueError, match=r"tokens has shape \(2,\), expected \(1,\)"):
        decode_step(model, [1, 2], cache)
    with pytest.raises(ValueError, match="at least one token"):
        prompt_batch([[1], []])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollouts_prefill_each_prompt_once_and_sample_as_generate_does_for_its_copies(model, temperature):
    """sample_rollouts(prompts, copies=3) in one device loop, each prompt prefilled once and its cache copied to
    its three rows, gives what the step-by-step generate gives for the prompts written out three times with the
    same key: greedily, or sampled (each copy its own draw); the stop token is kept, as TRL keeps it."""
    import jax

    from seqjax.model.decode import generate, sample_rollouts
    from seqjax.model.sampling import SamplingConfig

    prompts = [[5, 9, 1, 33, 2], [7, 40]]
    sampling = SamplingConfig(temperature=temperature)
    free = generate(model, [p for p in prompts for _ in range(3)], eot_id=None, max_new_tokens=8,
                    sampling=sampling, seed=4)
    stop = free[0].tokens[2]  # (a token the first row writes third: a row that stops)
    theirs = generate(model, [p for p in prompts for _ in range(3)], eot_id=stop, max_new_tokens=8,
                      sampling=sampling, seed=4)
    ours = sample_rollouts(model, prompts, stop_ids=[stop], max_new_tokens=8, sampling=sampling,
                           key=jax.random.key(4), copies=3)
    assert [g.tokens for g in ours] == [g.tokens + [stop] * g.stopped for g in theirs]
    assert [g.stopped for g in ours] == [g.stopped for g in theirs] and ours[0].stopped
    if temperature:
        assert len({tuple(g.tokens) for g in ours[:3]}) > 1  # (the copies draw apart)
