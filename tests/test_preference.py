"""Preference pairs packed: whole pairs in rows, with or without a shared prompt, give exactly the per-pair
log-probabilities, loss and gradients of one pair per row; bad pairs and unsupported combinations are one line.

(TRL's own numbers on the same model and pairs: tests/test_preference_trl.py.)
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from model_support import compiled_logprobs
from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.core.errors import CorpusError
from seqjax.data.pipeline import build_pipeline
from seqjax.model import build_model, split_params
from seqjax.objectives import resolve
from seqjax.objectives.base import Inputs, target_logprobs
from seqjax.objectives.preference import pair_sums
from seqjax.store.reader import TokenStore
from seqjax.train.step import make_train_step

VOCAB = 64
MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48",
         f"model.vocab_size={VOCAB}", "model.attention=xla", "model.max_seq_len=256"]


def config(*extra: str):
    return load_config(None, ["data.corpus=jsonl", "data.format=preference", "data.train_files=[x.jsonl]",
                              "data.shuffle=false", "data.strategy=pack", "data.packer=greedy", *MODEL, *extra])


def store_of(pairs: list[tuple[list[int], list[int], list[int]]]) -> TokenStore:
    """A preference store: pair k as examples 2k (prompt + chosen) and 2k + 1 (prompt + rejected)."""
    docs, weights = [], []
    for prompt, chosen, rejected in pairs:
        for completion in (chosen, rejected):
            docs.append(prompt + completion)
            weights.append([0] * len(prompt) + [1] * len(completion))
    return TokenStore.from_documents(docs, eot_id=0, vocab_size=VOCAB, weights=weights)


PROMPT_MAX, COMPLETION_MAX = 12, 9
# The one packed row holds the longest four pairs the draws allow: no pair is ever left out, whatever is drawn
# (a row of 128 held 3 of 4 pairs at random, 2026-11-27).
ROW_HOLDS = 4 * 2 * (PROMPT_MAX + COMPLETION_MAX)


def draw_pairs(data, count: int) -> list:
    ids = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=COMPLETION_MAX)
    return [(data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=PROMPT_MAX)), data.draw(ids),
             data.draw(ids)) for _ in range(count)]


def batch_of(cfg, store) -> dict:
    return {k: jnp.asarray(v) for k, v in next(iter(build_pipeline(cfg, store))).items()}


LAYOUTS = {  # (rows, overrides): one pair per row; all packed in one row; packed with the prompt once
    "one per row": (4, ["data.max_segments_per_row=2"]),
    "packed": (1, []),
    "shared prompt": (1, ["data.shared_prompt=true"]),
}
COMPILED: dict = {}


def compiled(window):
    """Per layout, one jitted (loss, gradients, chosen and rejected sums) of the DPO objective, for a model
    with or without a sliding layer (shapes are fixed: a few compilations serve every drawn example)."""
    if window not in COMPILED:
        windowed = [] if window is None else [f"model.sliding_window={window}", "model.layer_types=[sliding,full]"]
        cfg = config(*windowed)
        model, reference = build_model(cfg, rngs=nnx.Rngs(0)), build_model(cfg, rngs=nnx.Rngs(1))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        objective = resolve(["dpo"])

        def run(p, batch):
            def loss(p):
                m = nnx.merge(graphdef, p, rest)
                inputs = Inputs(m, None, {"beta": 0.1, "label_smoothing": 0.0}, objective.totals(batch),
                                lambda micro: target_logprobs(reference, micro, None, micro["weights"] > 0))
                terms = objective.loss(inputs, batch)
                return terms.value / terms.denominator

            m = nnx.merge(graphdef, p, rest)
            c, r = pair_sums(target_logprobs(m, batch, None, batch["weights"] > 0), batch)
            return jax.value_and_grad(loss)(p), c, r

        COMPILED[window] = (windowed, params, jax.jit(run))
    return COMPILED[window]


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), window=st.sampled_from([None, 3]))
def test_packed_pairs_give_the_log_probabilities_loss_and_gradients_of_one_pair_per_row(data, window):
    """Under hypothesis-drawn lengths (one-token prompts included, and a sliding window that the shared prompt
    must count in each sequence's own positions): per-pair log-probabilities, the DPO loss and its gradients."""
    count = 4  # (a batch of four rows: one pair each, or all four in one row of ROW_HOLDS tokens)
    pairs = draw_pairs(data, count)
    assume(all(c != r for _, c, r in pairs))
    store = store_of(pairs)
    windowed, params, run = compiled(window)
    results = {}
    for name, (rows, extra) in LAYOUTS.items():
        batch = batch_of(config(*windowed, f"data.batch_size={rows}", f"data.seq_len={ROW_HOLDS}", *extra), store)
        (value, grads), c, r = run(params, batch)
        valid = np.asarray(pair_sums(jnp.ones(batch["weights"].shape), batch)[0]) > 0
        assert valid.sum() == count
        results[name] = (np.asarray(c)[valid], np.asarray(r)[valid], float(value), grads)
    c, r, value, grads = results["one per row"]
    for name in ("packed", "shared prompt"):
        c2, r2, value2, grads2 = results[name]
        np.testing.assert_allclose(c2, c, rtol=1e-6, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(r2, r, rtol=1e-6, atol=2e-5, err_msg=name)
        assert abs(value2 - value) < 1e-6, name
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads2, grads)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_gradient_accumulation_over_pairs_gives_the_one_batch_update():
    """The loss is a mean over the global batch's pairs: two micro-batches of uneven pairs give the update of one."""
    rng = np.random.default_rng(0)
    pairs = [(list(rng.integers(1, VOCAB, n)), list(rng.integers(1, VOCAB, m)), list(rng.integers(1, VOCAB, m + 1)))
             for n, m in ((3, 2), (9, 5), (1, 7), (4, 1))]
    cfg = config("data.batch_size=4", "data.seq_len=64", "data.max_segments_per_row=2")
    batch = batch_of(cfg, store_of(pairs))
    graphdef, params, _, rest = split_params(build_model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    reference = jax.tree.map(lambda a: a * 1.01, params)
    out = []
    for accum in (1, 2):
        step = make_train_step(graphdef, rest, optax.sgd(1.0), grad_accum=accum, objective=resolve(["dpo"]),
                               settings={"beta": 0.1, "label_smoothing": 0.0})
        new, _, metrics = jax.jit(step)(params, optax.sgd(1.0).init(params), batch, None, 0, None, reference)
        out.append((new, metrics))
    (a, ma), (b, mb) = out
    assert float(ma["weight_sum"]) == float(mb["weight_sum"]) == 4.0  # pairs
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), a, b)
    assert {"rewards/accuracies", "rewards/margins", "logps/chosen"} <= set(ma["reported"])


def test_a_lora_runs_reference_is_its_base_exactly():
    """train.reference=auto under model.lora: the same state with the adapters off computes the base's
    log-probabilities bit for bit."""
    from seqjax.model import BASE_PARAMS
    from seqjax.model.lora import adapters_off

    lora_cfg = config("model.lora.rank=4", "model.lora.alpha=8", "data.batch_size=1", "data.seq_len=64")
    graphdef, adapters, frozen, rest = split_params(build_model(lora_cfg, rngs=nnx.Rngs(0)))
    adapters = jax.tree.map(lambda a: a + 0.1, nnx.to_pure_dict(adapters))  # B != 0: the policy differs
    base_model = build_model(config(), rngs=nnx.Rngs(0))
    nnx.update(base_model, nnx.state(nnx.merge(graphdef, adapters, frozen, rest), BASE_PARAMS))
    batch = batch_of(lora_cfg, store_of([([5, 6, 7], [8, 9], [10])]))
    scored = batch["weights"] > 0
    off = nnx.merge(adapters_off(graphdef, adapters, frozen, rest), adapters, frozen, rest)
    policy = nnx.merge(graphdef, adapters, frozen, rest)
    np.testing.assert_array_equal(np.asarray(compiled_logprobs(off, batch, scored)),
                                  np.asarray(compiled_logprobs(base_model, batch, scored)))
    assert np.abs(np.asarray(compiled_logprobs(policy, batch, scored) - compiled_logprobs(off, batch, scored))
                  ).max() > 1e-3


def noisy_pairs_batch(*extra: str):
    """A batch of 16 rows x 256 tokens packed with pairs over a 320-token vocabulary: at this size XLA's CPU
    backend computes a policy under jax.grad and its equal reference apart an ulp or two apart, on some tokens."""
    vocab, rng = 320, np.random.default_rng(0)
    docs, weights = [], []
    for _ in range(64):
        prompt = list(rng.integers(1, vocab, rng.integers(5, 60)))
        for _ in range(2):
            completion = list(rng.integers(1, vocab, rng.integers(1, 30)))
            docs.append(prompt + completion)
            weights.append([0] * len(prompt) + [1] * len(completion))
    store = TokenStore.from_documents(docs, eot_id=0, vocab_size=vocab, weights=weights)
    cfg = load_config(None, [
        "data.corpus=jsonl", "data.format=preference", "data.train_files=[x.jsonl]", "data.shuffle=false",
        "data.strategy=pack", "data.packer=greedy", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=4", "model.d_ff=64", f"model.vocab_size={vocab}", "model.attention=xla",
        "model.max_seq_len=256", "data.batch_size=16", "data.seq_len=256", "train.objective=dpo", *extra])
    return cfg, batch_of(cfg, store)


@pytest.mark.parametrize("reference", ["copy", *(pytest.param(r, marks=pytest.mark.slow)
                                                 for r in ("lora", "precompute"))])
def test_a_reference_with_the_policys_weights_gives_rewards_of_exactly_zero_in_the_step(reference):
    """TRL logs rewards/accuracies 0 at step 1, where the reference is the policy (LoRA's B = 0, a copy not yet
    moved from): in the train step too, every reward is exactly 0, however XLA fuses the two forward passes. A
    reference that differs (the copy moved, B != 0, a later step) is computed as before."""
    from seqjax.model.lora import adapters_off
    from seqjax.weights.reference import decide, same_weights_rule

    extra = {"copy": ["train.reference=copy"], "lora": ["model.lora.rank=4", "model.lora.alpha=8"],
             "precompute": ["train.reference=precompute"]}[reference]
    cfg, batch = noisy_pairs_batch(*extra)
    objective = resolve(["dpo"])
    graphdef, params, frozen, rest = split_params(build_model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    frozen = None if frozen is None else nnx.to_pure_dict(frozen)
    step = make_train_step(graphdef, rest, optax.sgd(0.0), grad_accum=1, objective=objective,
                           settings={"beta": 0.1, "label_smoothing": 0.0},
                           reference_graphdef=adapters_off(graphdef, params, frozen, rest) if frozen else None,
                           same_weights=same_weights_rule(decide(cfg, True), cfg))
    if reference == "precompute":  # (the starting weights' own log-probabilities, computed apart as the table is)
        scored = batch["weights"] > 0
        batch = {**batch, "reference_logps": jax.jit(lambda p: target_logprobs(
            nnx.merge(graphdef, p, rest), batch, None, scored))(params)}
        step = make_train_step(graphdef, rest, optax.sgd(0.0), grad_accum=1, objective=objective,
                               settings={"beta": 0.1, "label_smoothing": 0.0}, precomputed=True,
                               same_weights=same_weights_rule(decide(cfg, True), cfg))
    run = jax.jit(step)
    copy = jax.tree.map(jnp.copy, params) if reference == "copy" else None
    args = (frozen, copy) if frozen is not None else (None, copy)
    reported = run(params, optax.sgd(0.0).init(params), batch, None, 1, *args)[2]["reported"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert float(reported[name]) == 0.0, (reference, name, float(reported[name]))
    # the weights apart: the reference's own numbers again
    if reference == "lora":
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a + 0.05 if "lora_b" in jax.tree_util.keystr(path) else a, params)
    elif reference == "copy":
        copy = jax.tree.map(lambda a: a * 1.05, copy)
        args = (None, copy)
    later = run(params, optax.sgd(0.0).init(params), batch, None, 2, *args)[2]["reported"]
    assert float(later["rewards/margins"]) != 0.0 and float(later["rewards/accuracies"]) > 0.0


SEGMENT_SUMS = jax.jit(lambda values, ids: __import__("seqjax.model.loss").model.loss.segment_sums(values, ids, 4))


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(-30.0, 0.0, width=32), min_size=1, max_size=24), before=st.integers(0, 40),
       between=st.integers(0, 40))
def test_the_same_values_sum_to_the_same_float32_bits_wherever_they_sit_in_a_row(values, before, between):
    """segment_sums adds a run's entries in an order set by their places in the run alone: a sequence's values
    at any offset of a row, after any other segment, give the same bits."""
    n, t = len(values), 132  # (one shape: one compilation)
    row, ids = np.zeros(t, np.float32), np.zeros(t, np.int32)
    noise = np.random.default_rng(n).normal(size=t).astype(np.float32) * 30
    row[:before], ids[:before] = noise[:before], 1
    row[before:before + n], ids[before:before + n] = values, 2
    at = before + n + between
    row[before + n:at], ids[before + n:at] = noise[before + n:at], 3
    row[at:at + n], ids[at:at + n] = values, 4
    sums = np.asarray(SEGMENT_SUMS(jnp.asarray(row[None]), jnp.asarray(ids[None])))[0]
    assert sums[1].tobytes() == sums[3].tobytes()
    np.testing.assert_allclose(sums[1], np.sum(np.asarray(values, np.float64)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shared", [pytest.param(False, marks=pytest.mark.slow), True])
def test_an_equal_pair_ties_exactly_as_trls_rows_of_their_own_do(shared):
    """A pair whose chosen and rejected sequences are the same (data.degenerate_pairs=keep trains it, as TRL does)
    has equal sums bit for bit in a packed row, whatever attention's reductions round apart at the two offsets:
    a margin of exactly 0, not counted as won, no gradient from it. An ulp between two different sequences'
    sums is kept."""
    rng = np.random.default_rng(0)  # (with the shared prompt, this model rounds the two apart on some tokens)
    pairs = [(list(rng.integers(1, VOCAB, 7)), list(rng.integers(1, VOCAB, 5)), list(rng.integers(1, VOCAB, 6)))
             for _ in range(3)]
    pairs[1] = (pairs[1][0], pairs[1][1], list(pairs[1][1]))
    cfg = config(*(["data.shared_prompt=true"] if shared else []), "data.batch_size=1", "data.seq_len=128")
    batch = batch_of(cfg, store_of(pairs))
    for seed in range(4):
        model = build_model(cfg, rngs=nnx.Rngs(seed))
        c, r = (np.asarray(x)[0] for x in pair_sums(compiled_logprobs(model, batch, batch["weights"] > 0), batch))
        assert c[1].tobytes() == r[1].tobytes() and c[0] != r[0] and c[2] != r[2]
    # the rule, alone: an ulp put on the equal pair's rejected tokens is taken back; on another pair, kept
    chosen = (np.asarray(batch["pair_ids"]) == 3) & (np.asarray(batch["weights"]) > 0)
    rejected = (np.asarray(batch["pair_ids"]) == 4) & (np.asarray(batch["weights"]) > 0)
    other = (np.asarray(batch["pair_ids"]) == 2) & (np.asarray(batch["weights"]) > 0)
    values = np.where(chosen | rejected | other, -1.5, 0.0).astype(np.float32)
    values[rejected | other] = np.nextafter(np.float32(-1.5), np.float32(0))
    c, r = (np.asarray(x)[0] for x in pair_sums(jnp.asarray(values), batch))
    assert c[1] == r[1] and r[0] != -1.5 * other.sum()
    # in the objective: the equal pair is not won, the others as their sums say
    model = build_model(cfg, rngs=nnx.Rngs(0))
    objective = resolve(["dpo"])
    inputs = Inputs(model, None, {"beta": 0.1, "label_smoothing": 0.0}, objective.totals(batch),
                    lambda micro: jnp.zeros(micro["weights"].shape))
    c, r = (np.asarray(x)[0] for x in pair_sums(target_logprobs(model, batch, None, batch["weights"] > 0), batch))
    reported = objective.loss(inputs, batch).reported
    won, count = (float(x) for x in reported["rewards/accuracies"])
    margins = float(reported["rewards/margins"][0])
    assert count == 3 and won == float(c[0] > r[0]) + float(c[2] > r[2])
    assert margins == pytest.approx(0.1 * float((c[0] - r[0]) + (c[2] - r[2])), rel=1e-5)


def test_bad_pairs_are_one_line_naming_the_record(tmp_path):
    from seqjax.store.build import prepare

    good = {"prompt": "Q: a b", "chosen": " c d", "rejected": " e f"}
    cases = {"equals 'rejected'": ({**good, "rejected": " c d"}, "data.degenerate_pairs=error"),
             "field 'chosen' is empty after the prompt": ({**good, "chosen": ""}, "data.degenerate_pairs=error"),
             "expected all text (standard) or all lists": (
                 {**good, "chosen": [{"role": "assistant", "content": "x"}]}, "data.degenerate_pairs=keep")}
    for i, (expected, (record, policy)) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        cfg = load_config(None, ["data.corpus=jsonl", "data.format=preference", f"data.train_files=[{path}]",
                                 f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300", policy])
        with pytest.raises(CorpusError, match=f"bad{i}.jsonl:2: .*{re.escape(expected)}"):
            prepare(cfg, splits=("train",))
    # a lone UTF-16 surrogate (JSON's "\ud800" reads as one; the tokenizer would raise a TypeError), in a pair and
    # in a chat: one line naming the file and the line
    for fmt, record in (("preference", {**good, "chosen": " c \ud800"}),
                        ("chat", {"messages": [{"role": "user", "content": "hi \udc00"},
                                               {"role": "assistant", "content": "ok"}]})):
        path = tmp_path / f"surrogate_{fmt}.jsonl"
        path.write_text(json.dumps(good if fmt == "preference" else record) + "\n" + json.dumps(record) + "\n")
        cfg = load_config(None, ["data.corpus=jsonl", f"data.format={fmt}", f"data.train_files=[{path}]",
                                 f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300",
                                 "data.chat_template=chatml"])
        line = 2 if fmt == "preference" else 1
        with pytest.raises(CorpusError, match=rf"surrogate_{fmt}.jsonl:{line}: holds a lone UTF-16 surrogate"):
            prepare(cfg, splits=("train",))


def test_pairs_of_equal_or_empty_completions_are_kept_as_trl_keeps_them_or_dropped_and_counted(tmp_path):
    """data.degenerate_pairs: keep (TRL's DPOTrainer trains them; an empty standard completion is its EOS alone)
    or drop; prepare's summary counts them either way. An EOS after every completion under data.pair_eos=always,
    and never a second one."""
    from seqjax.store.build import prepare, summarize

    records = [{"prompt": "Q: a b", "chosen": " c d", "rejected": " e f"},
               {"prompt": "Q: g", "chosen": " h", "rejected": " h"},
               {"prompt": "Q: i", "chosen": "", "rejected": " j"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stores = {}
    for policy in ("keep", "drop"):
        for eos in ("template", "always"):
            cfg = load_config(None, ["data.corpus=jsonl", "data.format=preference", f"data.train_files=[{path}]",
                                     f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300",
                                     f"data.degenerate_pairs={policy}", f"data.pair_eos={eos}"])
            store = prepare(cfg, splits=("train",)).stores["train"]
            summary = summarize(store, 0.0, False)
            assert (summary["pairs_identical"], summary["pairs_empty"]) == (1, 1)
            assert summary["pairs_dropped"] == (2 if policy == "drop" else 0)
            assert store.num_docs == (6 if policy == "keep" else 2)
            stores[policy, eos] = store
    kept = stores["keep", "template"]
    eos_id = kept.doc_sequence(0)[-1]
    assert kept.doc_sequence(2).tolist() == kept.doc_sequence(3).tolist()  # the equal pair, as it is
    empty = kept.doc_sequence(4)
    assert empty[-1] == eos_id and int(np.asarray(kept.mask[kept.doc_spans()[0][4]:][:len(empty)]).sum()) == 1
    # (standard text already ends with its EOS: always adds none)
    assert all(stores["keep", "always"].doc_sequence(k).tolist() == kept.doc_sequence(k).tolist() for k in range(6))


def test_unsupported_combinations_are_one_line():
    from seqjax.data.strategies import check_config
    from seqjax.model.attention import attention
    from seqjax.train.setup import objective_of

    with pytest.raises(ConfigError, match="train.objective=lm does not read the batch field 'pair_ids'"):
        objective_of(config())
    with pytest.raises(ConfigError, match="data.overlong: got split, expected truncate"):
        config("data.overlong=split")
    with pytest.raises(ConfigError, match="data.shared_prompt: got true with data.format=chat"):
        load_config(None, ["data.corpus=jsonl", "data.format=chat", "data.train_files=[x]", "data.shared_prompt=true"])
    with pytest.raises(ConfigError, match="data.strategy: got block, expected pack .* for data.format=preference"):
        check_config(config("data.strategy=block", "data.break_mode=complete_doc"))
    with pytest.raises(ConfigError, match="train.reference: got auto with model.lora.modules_to_save"):
        objective_of(config("train.objective=dpo", "model.lora.rank=4", "model.lora.modules_to_save=[head]",
                            "model.tie_embeddings=false"))
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ConfigError, match="model.attention: got 'pallas', which cannot honour a shared prompt's "
                                          r"mask \(data.shared_prompt, rl.layout=prompt_once\) with a sliding window"):
        attention(q, q, q, jnp.ones((1, 4), jnp.int32), backend="pallas", prefix_ids=jnp.zeros((1, 4), jnp.int32),
                  positions=jnp.arange(4)[None], window=2)
    with pytest.raises(ConfigError, match="model.attention: got 'splash', which cannot honour a shared prompt"):
        attention(q, q, q, jnp.ones((1, 4), jnp.int32), backend="splash", prefix_ids=jnp.zeros((1, 4), jnp.int32),
                  positions=jnp.arange(4)[None])
