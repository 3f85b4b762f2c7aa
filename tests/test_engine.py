"""The generation engine (seqjax.engine): its paged KV cache computes what a full forward pass computes
(each drawn token's log-probability equals the training forward's on the finished sequence, whatever
the packing, pages, slots, layout, adapters or experts), sampling is a function of (seed, prompt,
completion, position) alone, a prompt is stored once per group, slots are reused as sequences end,
and bad sizes are one line."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.extend import core as jax_core

from seqjax.config.engine import EngineConfig
from seqjax.config.load import load_config
from seqjax.core.errors import UsageError
from seqjax.engine import Engine, generate, sample_rollouts
from seqjax.engine.engine import _waves
from seqjax.engine.paged import PagedKV, _gather, blockwise_attention
from seqjax.engine.prefill import prefill
from seqjax.model import build_model
from seqjax.model.attention import masked_attention
from seqjax.model.mask import page_mask
from seqjax.model.sampling import SamplingConfig

VOCAB = 64
BASE = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
        "model.max_seq_len=64", "model.attention=xla", "data.seq_len=64", "model.init_std=0.3"]
MODELS: dict = {}
# Qwen3.5's mix: a Gated DeltaNet layer (its state and convolution window a row of the engine's cache) beside
# attention
HYBRID = ("model.layer_types=[linear,full]", "model.deltanet.key_heads=2", "model.deltanet.value_heads=4",
          "model.deltanet.key_dim=8", "model.deltanet.value_dim=8")


def model_of(*extra: str):
    if extra not in MODELS:
        MODELS[extra] = build_model(load_config(None, [*BASE, *extra]), VOCAB, rngs=nnx.Rngs(3))
    return MODELS[extra]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, inputs, positions, segment_ids):
    return jax.nn.log_softmax(nnx.merge(graphdef, state)(inputs, positions=positions, segment_ids=segment_ids), -1)


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log p(token) of each token after the prompt from one full forward pass (the training path), padded to
    max_seq_len so it compiles once."""
    seq, t = prompt + tokens, model.cfg.max_seq_len
    pad = np.zeros((1, t), np.int32)
    inputs, positions, segment_ids = pad.copy(), pad.copy(), pad.copy()
    inputs[0, :len(seq)], positions[0, :len(seq)], segment_ids[0, :len(seq)] = seq, np.arange(len(seq)), 1
    logp = np.asarray(_forward(*nnx.split(model), inputs, positions, segment_ids))[0]
    return np.asarray([logp[len(prompt) - 1 + i, tok] for i, tok in enumerate(tokens)])


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


def assert_logprobs_are_the_forwards(model, prompts, done, copies):
    for i, completion in enumerate(done):
        want = teacher_forced(model, prompts[i // copies], completion.tokens)
        np.testing.assert_allclose(completion.logprobs, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # (the full suite; the fast loop keeps the greedy and paging tests)
@pytest.mark.parametrize("extra", [(), ("model.scan_layers=true",),
                                   ("model.sliding_window=4", "model.layer_types=[sliding,full]",
                                    "model.attention_sinks=true", "model.qkv_bias=true", "model.attn_out_bias=true"),
                                   ("model.experts.count=4", "model.experts.top_k=2", "model.experts.d_ff=16"),
                                   ("model.attention_gate=true", "model.rope_fraction=0.5", "model.qk_norm=true",
                                    "model.norm_plus_one=true"), HYBRID],
                         ids=["dense", "scanned", "windows_sinks", "experts", "gated_partial_rope", "deltanet"])
def test_every_drawn_tokens_log_probability_is_the_training_forwards(extra):
    """Two prompts packed into one prefill row, a third longer than engine.prefill_tokens=6 prefilled in two
    pieces (6 tokens, then 1 continuing it over its pages, while the first two's sequences decode), pages of
    4 (prompts and the pieces' cut ending mid-page: the copy on write), 3 slots for 6 sequences (slots
    refilled): each token's log-probability under the engine's cache equals the full forward's on the
    finished sequence; with a sliding window, attention sinks and biases, experts, Qwen3.5's gated
    attention with partial RoPE, and a Gated DeltaNet layer (each slot's state copied from its prompt's,
    continued token by token; the second piece's from the first's, its convolution window reaching back
    into it)."""
    model = model_of(*extra)
    prompts = prompts_of([5, 1, 7])
    engine = Engine(model, EngineConfig(slots=3, page_size=4, prefill_tokens=6))
    done = engine.run(prompts, max_new_tokens=9, stop_ids=[], sampling=SamplingConfig(temperature=1.0),
                      key=jax.random.key(1), copies=2)
    assert [len(c.tokens) for c in done] == [9] * 6
    assert_logprobs_are_the_forwards(model, prompts, done, 2)
    # (one row packed: a Gated DeltaNet's too, each prompt's state the one after its own last token; then
    # the pieces, a row each, beside the decoding slots)
    assert (engine.stats["prefill_rows"], engine.stats["pieces"], engine.stats["waves_beside_decode"]) == (3, 2, 2)
    assert engine.stats["waves_without_a_step"] == 0  # (the decoding slots step between the two pieces)
    assert engine.stats["prompt_pages"] == 2 + 1 + 2


def test_greedy_tokens_are_the_argmax_of_full_forward_passes():
    model = model_of()
    prompts = prompts_of([5, 2, 11], seed=2)
    done = generate(model, prompts, eot_id=None, max_new_tokens=8, engine=EngineConfig(slots=2, page_size=2))
    for prompt, g in zip(prompts, done):
        seq = list(prompt)
        for _ in range(8):
            real = np.arange(64)[None] < len(seq)
            inputs = np.asarray([seq + [0] * (64 - len(seq))], np.int32)
            positions = np.where(real, np.arange(64)[None], 0).astype(np.int32)
            logp = np.asarray(_forward(*nnx.split(model), inputs, positions, real.astype(np.int32)))[0]
            seq.append(int(np.argmax(logp[len(seq) - 1])))
        assert g.tokens == seq[len(prompt):]
    assert len({tuple(g.tokens) for g in done}) > 1


def decode_step_products(*extra: str, tokens: int = 1) -> int:
    """The matrix products (dot_general) one decode step's program traces (a token a row into a paged cache),
    sub-programs included: a scan's body counts once, however many layers it runs. With ``tokens`` > 1: the
    packed prefill's program (two prompts in a row of ``tokens``, written into their pages)."""
    model = build_model(load_config(None, [*BASE, *extra]), VOCAB, rngs=nnx.Rngs(0))
    cache = PagedKV.empty(model.cfg, pages=8, page_size=4, rows=2, table=4)
    graphdef, state = nnx.split(model)

    def step(state, cache):
        ones = jnp.ones((2, 1), jnp.int32)
        return nnx.merge(graphdef, state).decode(ones, positions=ones, segment_ids=ones, cache=cache)

    def prefilled(state, cache):
        segments = jnp.asarray([[1] * (tokens // 2) + [2] * (tokens - tokens // 2)], jnp.int32)
        places = jnp.arange(tokens, dtype=jnp.int32)[None]
        last = jnp.asarray([[0, tokens // 2 - 1], [0, tokens - 1]], jnp.int32)
        return prefill(nnx.merge(graphdef, state), cache, segments, places, segments, places, last)

    def products(jaxpr) -> int:
        return sum((eqn.primitive.name == "dot_general") + sum(products(sub) for sub in jax_core.jaxprs_in_params(
            eqn.params)) for eqn in jaxpr.eqns)

    return products(jax.make_jaxpr(step if tokens == 1 else prefilled)(state, cache).jaxpr)


def test_a_scanned_models_decode_step_traces_one_block_whatever_its_depth():
    """model.scan_layers: the decode step is one lax.scan over the stacked blocks with every layer's pages (one
    array) in its carry, so its program, and what the loop's bodies compile, does not grow with the depth;
    unrolled, it does. (Its numbers: the scanned case of the log-probability test above.)"""
    scanned = [decode_step_products(f"model.n_layers={n}", "model.scan_layers=true", "model.sliding_window=4",
                                     "model.layer_types=[sliding,full]" if n == 2 else
                                     "model.layer_types=[sliding,full,sliding,full,sliding,full]") for n in (2, 6)]
    unrolled = [decode_step_products(f"model.n_layers={n}") for n in (2, 6)]
    assert 0 < scanned[0] == scanned[1] == unrolled[0] // 2 and unrolled[1] == 3 * unrolled[0], (scanned, unrolled)
    # the packed prefill too: one block whatever the depth (its keys and values written into the pages layer by
    # layer), where unrolled its program grows with every layer
    scanned = [decode_step_products(f"model.n_layers={n}", "model.scan_layers=true", tokens=8) for n in (2, 6)]
    unrolled = [decode_step_products(f"model.n_layers={n}", tokens=8) for n in (2, 6)]
    assert 0 < scanned[0] == scanned[1] < unrolled[0] and unrolled[1] > unrolled[0], (scanned, unrolled)


@pytest.mark.parametrize("layout", ["false", "true"], ids=["unrolled", "scanned"])
def test_every_step_writes_the_pages_in_place(layout):
    """The compiled sampling program (prefill, the decode loop, the next waves and a prompt's later pieces)
    copies the pools of pages, [layers, pages, Hkv, page_size, D] for keys and for values, where the empty pools
    are made; a scanned model's steps never, an unrolled model's one layer's pair at most (XLA keeps one layer's
    pools apart around the copy-on-write's branch: a step moves 1/L of the cache, where copying every layer's
    would move all of it each token, on a GPU more bytes than the weights the step reads)."""
    model = model_of(f"model.scan_layers={layout}")
    engine = Engine(model, EngineConfig(slots=4, page_size=4, prefill_tokens=8))
    lowered, plan = engine.lower([5, 9, 3], copies=2, max_new_tokens=6, sampling=SamplingConfig(temperature=1.0))
    text = lowered.compile().as_text()
    stack = model.cfg.n_layers if layout == "true" else 1
    pool = f"f32[{stack},{plan.pages},{model.cfg.kv_heads},4,{model.cfg.head_dim}]"
    copies, computation = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith("{"):
            computation = "entry" if line.startswith("ENTRY") else line.split()[0]
        if " copy(" not in line or f"= {pool}" not in line:
            continue
        if computation != "entry" or "broadcast" not in line.split(" copy(")[-1]:  # (else an empty pool made)
            copies[computation] = copies.get(computation, 0) + 1
    assert text.count(pool) > 10 and "while(" in text  # (the pools, threaded through the loop)
    assert (max(copies.values(), default=0) <= 2) if layout == "false" else not copies, copies


@pytest.mark.slow  # (the full suite; the fast loop keeps the greedy and paging tests)
@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), slots=st.integers(1, 7),
       page_size=st.sampled_from([1, 2, 4, 8, 16]), spare=st.integers(0, 3), seed=st.integers(0, 3),
       waves=st.sampled_from([0, 5, 8, 20]))
def test_sampling_is_a_function_of_seed_prompt_completion_and_position_only(lengths, slots, page_size, spare, seed,
                                                                              waves):
    """The same completions (tokens and log-probabilities) whatever the slots, the page size, a pool only just
    large enough (sequences then wait for pages), the order in which sequences end (a stop id), the waves a
    request is cut into and the pieces a prompt longer than engine.prefill_tokens is prefilled in."""
    model = model_of()
    prompts = prompts_of(lengths, seed)
    run = functools.partial(sample_rollouts, model, prompts, stop_ids=[7, 11], max_new_tokens=10,
                            sampling=SamplingConfig(temperature=1.0), key=jax.random.key(seed), copies=3)
    reference = run(engine=EngineConfig(slots=16, page_size=16))
    assume(len({len(c.tokens) for c in reference}) > 1)  # (sequences that end at different steps)
    need = max((n % page_size + 10 + page_size - 1) // page_size for n in lengths)
    pages = sum(-(-n // page_size) for n in lengths) + need + spare
    other = run(engine=EngineConfig(slots=slots, page_size=page_size, kv_pages=pages, prefill_tokens=waves))
    assert [c.tokens for c in other] == [c.tokens for c in reference]
    np.testing.assert_allclose([x for c in other for x in c.logprobs], [x for c in reference for x in c.logprobs],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # (the full suite; the fast loop keeps the greedy and paging tests)
def test_a_request_of_more_prompt_tokens_than_engine_prefill_tokens_runs_in_waves_and_samples_the_same():
    """engine.prefill_tokens=12: prompts of 9, 3, 14, 5 and 7 tokens run in four waves, in order ([9, 3], then
    14, longer than the budget, alone in two pieces of 12 and 2 tokens, then [5, 7]), each next one prefilled
    between decode steps while the last one's sequences still decode: the same tokens and log-probabilities as
    one wave, each sequence streamed under its index in the request. A pool of 7 pages (a wave's 4 prompt pages
    and one sequence's 3) runs it too, where the prompts together take 12: each prompt's pages go back once its
    last completion ends."""
    model = model_of()
    prompts = prompts_of([9, 3, 14, 5, 7], seed=6)

    def run(budget, pages=0):
        streamed = {}
        engine = Engine(model, EngineConfig(slots=4, page_size=4, prefill_tokens=budget, kv_pages=pages))
        done = engine.run(prompts, max_new_tokens=8, stop_ids=[3, 5], sampling=SamplingConfig(temperature=1.0),
                          key=jax.random.key(2), copies=2, on_done=lambda i, c: streamed.__setitem__(i, c))
        return done, streamed, engine.stats

    (whole, _, one), (waved, streamed, cut) = run(0), run(12)
    assert (one["waves"], cut["waves"], cut["pieces"]) == (1, 4, 2) and cut["sequences"] == 10
    assert cut["waves_beside_decode"] == 3 and one["waves_beside_decode"] == 0 and cut["waves_without_a_step"] == 0
    assert [c.tokens for c in waved] == [c.tokens for c in whole] and len({len(c.tokens) for c in whole}) > 1
    np.testing.assert_allclose([x for c in waved for x in c.logprobs], [x for c in whole for x in c.logprobs],
                               rtol=1e-5, atol=1e-5)
    assert streamed == dict(enumerate(waved)) and cut["new_tokens"] == one["new_tokens"]
    tight, _, stats = run(12, pages=7)
    assert stats["pages"] == 7 < stats["prompt_pages"] == 12
    assert [c.tokens for c in tight] == [c.tokens for c in whole]


@pytest.mark.parametrize("window,sinks", [(None, False), (5, True)], ids=["full", "window_sinks"])
def test_a_pieces_blockwise_attention_is_the_gathered_paths_one_softmax(window, sinks):
    """A prompt's later piece attends over its pages a block at a time with a running softmax; with blocks of 1
    and 2 pages it equals the gathered path's one softmax over every page (the decode step's, under the same
    page_mask): queries of many tokens a row, rows at different places, a page table with no page at its end,
    a window and attention sinks; a padding query gets zeros."""
    rng = np.random.default_rng(0)
    b, t, h, hkv, d, size, pages, width = 2, 6, 4, 2, 8, 4, 12, 5
    keys, values = (jnp.asarray(rng.normal(size=(1, pages, hkv, size, d)), jnp.float32) for _ in range(2))
    table = rng.permutation(pages)[:b * width].reshape(b, width)
    table[0, -1] = pages  # (row 0 holds 4 pages: 16 places)
    real = jnp.asarray([[1] * 6, [1] * 4 + [0] * 2]) > 0
    before = jnp.asarray([7, 13])
    place = before[:, None] + jnp.cumsum(real, axis=1) - 1
    total = before + jnp.sum(real, axis=1)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32) if sinks else None
    table = jnp.asarray(table, jnp.int32)
    mask = page_mask(place, real, total, width * size, window)
    whole = masked_attention(q, _gather(keys, 0, table), _gather(values, 0, table), mask, sinks=sink,
                             heads_first=True)
    for per in (1, 2):
        blocks = blockwise_attention(q, keys, values, 0, table, place, real, total, window=window, scale=None,
                                     sinks=sink, block_pages=per)
        np.testing.assert_allclose(blocks, whole, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(blocks)[1, 4:]).max() == 0 < np.abs(np.asarray(blocks)[1, :4]).min()


def test_a_plan_knows_its_pieces_and_rows_refuse_a_plan_made_for_other_waves():
    """The program compiled for a run takes later pieces only where its plan says so (Engine.plan, from the
    waves); rows cut otherwise than the plan's waves are refused before anything compiles."""
    engine = Engine(model_of(), EngineConfig(page_size=4))
    cut, whole = _waves([9, 3], 4), _waves([9, 3], 0)
    assert [(w.start, w.stop) for w in cut] == [(0, 4), (4, 8), (8, 9), (0, None)]
    assert engine.plan([9, 3], 2, 4, waves=cut).pieces and not engine.plan([9, 3], 2, 4, waves=whole).pieces
    with pytest.raises(ValueError, match="the plan was made for other waves"):
        engine.rows(prompts_of([9, 3]), whole, engine.plan([9, 3], 2, 4, waves=cut), None)


def test_a_group_stores_its_prompt_once_and_slots_take_the_next_sequence_as_one_ends():
    """8 completions of each of 4 prompts of 30 tokens: the prompts take their own pages once (not 8 times);
    with 4 slots and completions ending at different steps, nearly every slot-step draws a real token."""
    model = model_of()
    prompts = prompts_of([30, 30, 30, 30], seed=5)
    engine = Engine(model, EngineConfig(slots=4, page_size=8))
    done = engine.run(prompts, max_new_tokens=20, stop_ids=[3, 5, 9], sampling=SamplingConfig(temperature=1.0),
                      key=jax.random.key(0), copies=8)
    assert engine.stats["prompt_pages"] == 4 * 4  # (ceil(30 / 8) a prompt, whatever the copies)
    lengths = [len(c.tokens) for c in done]
    assert min(lengths) < 20 and engine.stats["token_steps"] == sum(lengths)
    assert engine.stats["slot_use"] > 0.9, engine.stats
    assert all(c.stopped == (c.tokens[-1] in (3, 5, 9)) for c in done)


@pytest.mark.slow  # (the full suite; the fast loop keeps the greedy and paging tests, as for slots and page sizes)
@pytest.mark.parametrize("extra", [(), HYBRID], ids=["attention", "deltanet"])
def test_the_step_shrinks_its_rows_as_the_last_sequences_run_and_samples_the_same(extra):
    """engine.shrink_to: 16 slots cut to 10, 6 and 4 once nothing waits and the decoding ones fit (their
    page tables, lengths and DeltaNet state rows moved to the front; a request of 64 new tokens, where it
    applies): the same tokens and log-probabilities as 16 slots throughout, the same real tokens in fewer
    slot-steps."""
    model = model_of(*extra, "model.max_seq_len=128", "data.seq_len=128")
    prompts = prompts_of([9, 14, 5, 11], seed=4)

    def run(shrink_to):
        engine = Engine(model, EngineConfig(slots=16, page_size=4, shrink_to=shrink_to))
        done = engine.run(prompts, max_new_tokens=64, stop_ids=[3, 5, 9], sampling=SamplingConfig(1.0),
                          key=jax.random.key(1), copies=8)
        return done, engine.stats

    (fixed, before), (shrunk, after) = run(0), run(4)
    lengths = [len(c.tokens) for c in fixed]
    assert min(lengths) < max(lengths)  # (sequences end at different steps)
    assert [c.tokens for c in shrunk] == [c.tokens for c in fixed]
    np.testing.assert_allclose([x for c in shrunk for x in c.logprobs], [x for c in fixed for x in c.logprobs],
                               rtol=1e-5, atol=1e-5)
    assert after["token_steps"] == before["token_steps"] == sum(lengths)
    assert after["slot_steps"] < before["slot_steps"] and after["slot_use"] > before["slot_use"]


def test_the_steps_rows_are_cut_to_two_thirds_down_to_shrink_to():
    from seqjax.engine.loop import widths

    assert widths(32, 4) == [32, 21, 14, 9, 6, 4] and widths(16, 4) == [16, 10, 6, 4]
    assert widths(32, 0) == [32] and widths(3, 4) == [3] and widths(5, 4) == [5, 4]


def test_each_sequence_is_handed_over_as_it_ends_while_the_others_decode():
    """``on_done`` streams: 32 sequences over 4 slots, ending at different steps, reach it in the order they end
    (the step each ends at follows from the tokens: a sequence takes the first slot to free), each once, equal to
    what the run returns; the CLI's --stream prints them so (tests/test_generate.py)."""
    model = model_of()
    prompts = prompts_of([30, 12, 25, 7], seed=5)
    streamed = []
    done = Engine(model, EngineConfig(slots=4, page_size=8)).run(
        prompts, max_new_tokens=20, stop_ids=[3, 5, 9], sampling=SamplingConfig(temperature=1.0),
        key=jax.random.key(0), copies=8, on_done=lambda i, c: streamed.append((i, c)))
    free, ends = [0] * 4, {}
    for i, completion in enumerate(done):  # (the loop's schedule: each sequence takes the first slot to free)
        slot = min(range(4), key=lambda k: free[k])
        ends[i] = free[slot] + len(completion.tokens) - 1
        free[slot] = ends[i] + 1
    order = [i for i, _ in streamed]
    assert sorted(order) == list(range(32)) and all(c == done[i] for i, c in streamed)
    assert [ends[i] for i in order] == sorted(ends[i] for i in order) and order != sorted(order)


def test_generate_leaves_the_stop_id_out_and_rollouts_keep_it():
    model = model_of()
    prompts = prompts_of([4, 6], seed=1)
    free = generate(model, prompts, eot_id=None, max_new_tokens=6)
    stop = free[0].tokens[2]
    ended = generate(model, prompts, eot_id=stop, max_new_tokens=6)
    kept = sample_rollouts(model, prompts, stop_ids=[stop], max_new_tokens=6, sampling=SamplingConfig(0.0),
                           key=jax.random.key(0))
    assert ended[0].stopped and ended[0].tokens == free[0].tokens[:free[0].tokens.index(stop)]
    assert kept[0].tokens == ended[0].tokens + [stop]


def test_a_stop_sequence_ends_a_continuation_where_its_tokens_first_end_it():
    """Stop sequences of several tokens (seqjax.generate --stop), right-aligned in one array whatever their
    lengths: greedy tokens end where a pair taken from the free run first ends, the pair left out of generate's
    output; a longer sequence that never occurs changes nothing."""
    from seqjax.main.generate import stop_tokens

    model = model_of()
    prompts = prompts_of([5, 9], seed=2)
    never = [VOCAB + 1, VOCAB + 2, VOCAB + 3]  # (no such token; the three runs' stop arrays of one shape compile once)
    free = generate(model, prompts, eot_id=None, max_new_tokens=12, stop_sequences=[never, never])
    pair = free[0].tokens[4:6]
    end = next(j for j in range(2, 13) if free[0].tokens[j - 2:j] == pair)
    ended = generate(model, prompts, eot_id=None, max_new_tokens=12, stop_sequences=[never, pair])
    assert ended[0].stopped and ended[0].tokens == free[0].tokens[:end - 2]
    assert all(ended[1].tokens[:j] == free[1].tokens[:j] for j in range(len(ended[1].tokens)))
    kept = Engine(model).run(prompts, max_new_tokens=12, stop_ids=[], sampling=SamplingConfig(0.0),
                             key=jax.random.key(0), stop_sequences=[never, pair])
    assert kept[0].tokens == free[0].tokens[:end] and kept[0].stopped

    class Lossy:  # (a tokenizer that cannot write the text back)
        def encode_text(self, text):
            return [1] if text else []

        def decode(self, ids):
            return "?" * len(ids)

    for text in ("", "\u2603"):
        with pytest.raises(UsageError, match=f"^--stop {text!r}: the tokenizer encodes it as .* expected a "
                                             "non-empty text it encodes exactly"):
            stop_tokens(text, Lossy())


@pytest.mark.slow  # (the full suite; the fast loop keeps the greedy and paging tests)
def test_under_lora_the_engine_reads_the_adapters_as_they_are():
    """Adapters with B moved off 0 (no merge, no copy of the base): the engine's log-probabilities are the
    adapted training forward's."""
    model = model_of("model.lora.rank=4", "model.lora.alpha=8")
    graphdef, state = nnx.split(model)
    moved = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.2 if "lora_b" in jax.tree_util.keystr(path) else a, state)
    adapted = nnx.merge(graphdef, moved)
    prompts = prompts_of([6, 3], seed=3)
    done = Engine(adapted, EngineConfig(slots=2, page_size=4)).run(
        prompts, max_new_tokens=6, stop_ids=[], sampling=SamplingConfig(1.0), key=jax.random.key(2))
    assert_logprobs_are_the_forwards(adapted, prompts, done, 1)
    base = Engine(model, EngineConfig(slots=2, page_size=4)).run(
        prompts, max_new_tokens=6, stop_ids=[], sampling=SamplingConfig(1.0), key=jax.random.key(2))
    assert [c.logprobs for c in base] != [c.logprobs for c in done]


def test_bad_sizes_are_one_line():
    model = model_of()
    with pytest.raises(UsageError, match=r"--max-new-tokens: got 10, expected at most 4: prompt 1 takes 60 of "
                                         r"model.max_seq_len=64"):
        generate(model, [[1, 2], [3] * 60], eot_id=None, max_new_tokens=10)
    with pytest.raises(UsageError, match=r"prompt 1: 64 tokens .* expected at most 63"):
        generate(model, [[1, 2], [3] * 64], eot_id=None, max_new_tokens=1)
    with pytest.raises(UsageError, match=r"engine.kv_pages: got 2, expected at least 4"):
        generate(model, [[1] * 5], eot_id=None, max_new_tokens=6, engine=EngineConfig(page_size=4, kv_pages=2))
    with pytest.raises(UsageError, match=r"engine.kv_pages: 1099511627776 pages of 16 tokens .* GB free on cpu"):
        generate(model, [[1] * 5], eot_id=None, max_new_tokens=6, engine=EngineConfig(kv_pages=2**40))
    with pytest.raises(UsageError, match="at least one token"):
        generate(model, [[1], []], eot_id=None, max_new_tokens=2)
    with pytest.raises(Exception, match="engine.page_size: got 3, expected a power of two"):
        load_config(None, ["engine.page_size=3"])


def test_decoding_never_writes_outside_a_sequences_own_pages():
    """Two prompts' groups decoded together: every sequence's log-probabilities stay its own forward's even
    as the others write beside it (a write into a shared or another's page would move them)."""
    model = model_of()
    prompts = prompts_of([7, 7], seed=9)
    done = Engine(model, EngineConfig(slots=6, page_size=2)).run(
        prompts, max_new_tokens=12, stop_ids=[], sampling=SamplingConfig(1.0), key=jax.random.key(3), copies=3)
    assert_logprobs_are_the_forwards(model, prompts, done, 3)
    assert jnp.asarray([len(c.tokens) for c in done]).sum() == 6 * 12


@pytest.mark.parametrize("lengths, page_size, new", [([17], 4, 2), *(pytest.param(*case, marks=pytest.mark.slow)
                                                                     for case in (([17, 3], 4, 1),
                                                                                  ([40, 9, 33], 8, 3)))])
def test_prompt_tables_fit_the_caches_table_whatever_the_sizes(lengths, page_size, new):
    """A prompt whose pages round up past the cache's page table (17 tokens in pages of 4: five pages, a
    table of five for two new tokens): it decodes, and each completion is the full forward's greedy one
    (a chat prompt with 8 new tokens failed so once)."""
    model = model_of()
    prompts = prompts_of(lengths, seed=2)
    done = generate(model, prompts, eot_id=None, max_new_tokens=new, engine=EngineConfig(page_size=page_size))
    for prompt, g in zip(prompts, done):
        assert len(g.tokens) == new
        seq, t = prompt + g.tokens, model.cfg.max_seq_len
        inputs = np.zeros((1, t), np.int32)
        inputs[0, :len(seq)] = seq
        real = (np.arange(t) < len(seq))[None]
        logp = np.asarray(_forward(*nnx.split(model), inputs, np.where(real, np.arange(t), 0).astype(np.int32),
                                   real.astype(np.int32)))[0]
        assert [int(np.argmax(logp[len(prompt) - 1 + i])) for i in range(new)] == g.tokens
