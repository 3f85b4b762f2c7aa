"""Instruction data: formats, which tokens are scored, per-example isolation under every packer, loss normalization.

The examples are synthetic chats and prompt/completion pairs written here, the
tokenizer a tiny BPE with chat special tokens and a Zephyr-like template
(tests/hf_support.py). The correctness claims are checked against references
computed independently: each example run alone, the text a template renders
for each assistant message, a numpy per-example mean.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_support import CHAT_SPECIALS, CHAT_TEMPLATE, synthetic_chats, write_chat_llama_folder
from seqjax.config.load import load_config
from seqjax.core.errors import ConfigError, CorpusError
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from seqjax.data.strategies import PACKERS as ALL_PACKERS
from seqjax.data.strategies import check_config
from seqjax.model.transformer import build_model
from seqjax.store.build import prepare
from seqjax.store.chat import chat_spans
from seqjax.store.examples import ExampleSpec, char_spans_to_mask
from seqjax.store.reader import TokenStore
from seqjax.store.tokenizer import Tokenizer

# every way of keeping examples whole (the strategies table): each packer but the splitting ones, length grouping,
# fairseq's complete_doc blocks
PACKERS = [name for name, row in ALL_PACKERS.items() if row.keeps_whole]
LAYOUTS = [{"data.packer": p} for p in PACKERS] + [{"data.strategy": "length_grouped"},
                                                   {"data.strategy": "block", "data.break_mode": "complete_doc"}]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return write_chat_llama_folder(tmp_path_factory.mktemp("chat") / "llama")


@pytest.fixture(scope="module")
def tokenizer(chat_folder):
    return Tokenizer(chat_folder / "tokenizer.json", "</s>", "<s>")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pairs(n: int, seed: int = 0) -> list[dict]:
    chats = synthetic_chats(n, seed, max_turns=1)
    return [{"prompt": c["messages"][-2]["content"], "completion": " " + c["messages"][-1]["content"]} for c in chats]


def overrides(root: Path, folder: Path, fmt: str, files: list[Path], **extra) -> list[str]:
    settings_ = {"data.corpus": "jsonl", "data.format": fmt, "data.train_files": f"[{','.join(map(str, files))}]",
                 "data.valid_files": f"[{files[0]}]", "data.cache_dir": str(root / "cache"), "data.seq_len": 64,
                 "data.batch_size": 4, "tokenizer.path": str(folder / "tokenizer.json"),
                 "tokenizer.special_tokens": "[</s>]", "tokenizer.bos_token": "<s>", "model.d_model": 32,
                 "model.n_layers": 2, "model.n_heads": 2, "model.d_ff": 64, "run.dir": str(root / "run")}
    settings_.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in settings_.items()]


def spec(template: str = CHAT_TEMPLATE, loss_on: str = "assistant") -> ExampleSpec:
    return ExampleSpec(format="chat", loss_on=loss_on, chat_template=template, template_name="test", bos_token="<s>",
                       eos_token="</s>")


# ---------------------------------------------------------------------------
# What is scored


def test_a_token_straddling_a_span_edge_is_scored_and_one_outside_is_not():
    offsets = np.asarray([[0, 3], [3, 6], [6, 9], [9, 12]])
    np.testing.assert_array_equal(char_spans_to_mask(offsets, [(5, 9)]), [0, 1, 1, 0])
    np.testing.assert_array_equal(char_spans_to_mask(offsets, [(3, 6), (11, 12)]), [0, 1, 0, 1])
    np.testing.assert_array_equal(char_spans_to_mask(offsets, [(6, 6)]), [0, 0, 0, 0])  # an empty span scores nothing


def test_assistant_spans_are_exactly_the_assistant_messages_and_their_end_of_turn():
    chat = synthetic_chats(1, seed=3, max_turns=3)[0]["messages"]
    text, spans = chat_spans(spec(), chat, "here")
    expected = [m["content"] + "<|end|>\n" for m in chat if m["role"] == "assistant"]
    assert [text[a:b] for a, b in spans] == expected
    _, last = chat_spans(spec(loss_on="last_assistant"), chat, "here")
    assert [text[a:b] for a, b in last] == expected[-1:]


def test_generation_blocks_give_the_same_spans_as_rendering_turn_by_turn():
    marked = CHAT_TEMPLATE.replace("{{ m['content'] }}<|end|>\n",
                                   "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>\n"
                                   "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>\n{% endif %}")
    assert marked != CHAT_TEMPLATE
    for chat in synthetic_chats(5, seed=4):
        assert chat_spans(spec(marked), chat["messages"], "x") == chat_spans(spec(), chat["messages"], "x")


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_it_and_the_turn():
    # the header counts the messages, so a shorter chat's text is not a prefix of the longer one's
    rewriting = "{% for m in messages %}[{{ messages|length }}]<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    chat = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(CorpusError, match=r"here: the chat template test rewrites earlier turns.*message 1"):
        chat_spans(spec(rewriting), chat, "here")


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a non-empty list"),
    ([{"role": "user"}], "must be a non-empty list"),
    ([{"role": "user", "content": "a\ue000"}], "U\\+E000"),
])
def test_bad_messages_are_one_line_naming_the_record(messages, match):
    with pytest.raises(CorpusError, match=f"here: .*{match}"):
        chat_spans(spec(), messages, "here")


@pytest.mark.parametrize("fmt", ["prompt_completion", "chat"])
def test_no_prompt_token_is_ever_scored_and_every_answer_token_is(chat_folder, tokenizer, tmp_path, fmt):
    records = pairs(40) if fmt == "prompt_completion" else synthetic_chats(40, seed=1)
    config = load_config(None, overrides(tmp_path, chat_folder, fmt, [write_jsonl(tmp_path / "d.jsonl", records)]))
    store = prepare(config, splits=("train",)).stores["train"]
    assert store.num_docs == len(records)
    d, mask = np.asarray(store.doc_offsets), np.asarray(store.mask)
    for i, record in enumerate(records):
        ids, weights = np.asarray(store.tokens[d[i]:d[i + 1]]), mask[d[i]:d[i + 1]]
        # the scored tokens, read back as text, are the answers and nothing else
        scored = tokenizer.decode(ids[weights == 1])
        if fmt == "prompt_completion":
            assert scored == record["completion"] + "</s>"
        else:
            assert scored == "".join(m["content"] + "<|end|>\n" for m in record["messages"]
                                     if m["role"] == "assistant")
    assert mask[0] == 0 and store.tokens[0] == tokenizer.separator_id  # the stream opens with <s>: Llama's framing


def test_tokenized_records_take_labels_or_loss_weights_and_bad_ones_are_named(chat_folder, tmp_path):
    records = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
               {"input_ids": [9, 10, 11], "loss_weights": [0, 1, 0]}]
    config = load_config(None, overrides(tmp_path, chat_folder, "tokenized",
                                         [write_jsonl(tmp_path / "t.jsonl", records)]))
    store = prepare(config, splits=("train",)).stores["train"]
    np.testing.assert_array_equal(np.asarray(store.tokens), [1, 5, 6, 7, 8, 1, 9, 10, 11, 1])
    np.testing.assert_array_equal(np.asarray(store.mask), [0, 0, 0, 1, 1, 0, 0, 1, 0, 0])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [5, 6], "labels": [-100]}])
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: field 'labels' must be a list of integers as long as "
                                          r"'input_ids' \(2\)"):
        prepare(load_config(None, overrides(tmp_path, chat_folder, "tokenized", [bad])), splits=("train",))
    oov = write_jsonl(tmp_path / "oov.jsonl", [{"input_ids": [5, 999], "loss_weights": [1, 1]}])
    with pytest.raises(CorpusError, match=r"oov.jsonl:1: 'input_ids' holds id 999, outside .* vocabulary of 300"):
        prepare(load_config(None, overrides(tmp_path, chat_folder, "tokenized", [oov])), splits=("train",))


@pytest.mark.parametrize("record, message", [
    # a label is -100 or the token it sits on (HF's convention): any other was scored as if it were that token
    ({"input_ids": [5, 6, 7], "labels": [-100, 6, -1]}, r"'labels'\[2\] is -1; expected -100 \(not scored\) or the "
                                                         r"input id at that position \(7\)"),
    ({"input_ids": [5, 6, 7], "labels": [-100, 9, 7]}, r"'labels'\[1\] is 9; expected -100"),
    # wrong types and sizes: one line each, never a traceback
    ({"input_ids": [5, 6], "labels": ["6", 6]}, r"field 'labels' must be a list of integers"),
    ({"input_ids": [5, 6], "labels": [None, 6]}, r"field 'labels' must be a list of integers"),
    ({"input_ids": [5, 6], "labels": [True, 6]}, r"field 'labels' must be a list of integers"),
    ({"input_ids": [5, 2**40], "labels": [5, 6]}, r"'input_ids' holds id 1099511627776, outside"),
    ({"input_ids": [5, 2**70], "labels": [5, 6]}, r"'input_ids' holds id 1180591620717411303424, outside"),
    ({"input_ids": [5, -3], "loss_weights": [1, 1]}, r"'input_ids' holds id -3, outside"),
    ({"input_ids": [5, 6], "loss_weights": [1, 10**400]}, r"field 'loss_weights' must be a list of numbers"),
])
def test_bad_tokenized_records_are_one_line_naming_the_record(chat_folder, tmp_path, record, message):
    bad = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: " + message):
        prepare(load_config(None, overrides(tmp_path, chat_folder, "tokenized", [bad])), splits=("train",))


def test_fractional_loss_weights_are_kept_as_float32_when_asked_and_refused_as_bytes(chat_folder, tmp_path):
    """Levanter's prebuilt records carry weights such as 0.1: data.loss_weights_dtype=float32 stores them exactly
    (shard.json says so, and the store reopens the same); the byte default refuses them in one line."""
    records = [{"input_ids": [5, 6, 7, 8], "loss_weights": [0.0, 0.1, 1.0, 2.5]},
               {"input_ids": [9, 10, 11], "loss_weights": [True, False, True]}]
    files = [write_jsonl(tmp_path / "w.jsonl", records)]
    with pytest.raises(CorpusError, match=r"w.jsonl:1: field 'loss_weights' holds 0.1; "
                                          r"data.loss_weights_dtype=uint8 keeps 0/1 weights only"):
        prepare(load_config(None, overrides(tmp_path, chat_folder, "tokenized", files)), splits=("train",))
    config = load_config(None, overrides(tmp_path, chat_folder, "tokenized", files,
                                         **{"data.loss_weights_dtype": "float32"}))
    store = prepare(config, splits=("train",)).stores["train"]
    # (each example's first id is no target, as in transformers' shifted labels: its weight is 0)
    assert store.mask.dtype == np.float32 and store.scored_tokens == 4
    np.testing.assert_array_equal(np.asarray(store.mask), np.float32([0, 0, 0.1, 1, 2.5, 0, 0, 0, 1, 0]))
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert {s.get("weights_dtype") for s in manifest["shards"]} == {"float32"}
    again = TokenStore.open(store.path, verify=True)
    np.testing.assert_array_equal(np.asarray(again.mask), np.asarray(store.mask))
    negative = write_jsonl(tmp_path / "neg.jsonl", [{"input_ids": [5, 6], "loss_weights": [1, -0.5]}])
    with pytest.raises(CorpusError, match=r"neg.jsonl:1: field 'loss_weights' holds -0.5; expected weights >= 0"):
        prepare(load_config(None, overrides(tmp_path, chat_folder, "tokenized", [negative],
                                            **{"data.loss_weights_dtype": "float32"})), splits=("train",))


def test_evaluation_with_fractional_weights_is_the_weighted_mean_nll(chat_folder, tmp_path):
    """Token perplexity = exp(sum(w * nll) / sum(w)) over the scored targets; the count of scored targets is still
    a count; bits per byte is null (a weighted loss has no per-byte reading)."""
    from seqjax.eval.evaluate import evaluate

    rng = np.random.default_rng(4)
    examples = [(rng.integers(1, 64, n).tolist(), (rng.integers(0, 2, n) * rng.choice([0.1, 1.0, 3.0], n)).tolist())
                for n in (5, 9, 14, 3)]
    store = example_store(examples)
    assert store.mask.dtype == np.float32
    model = tiny_model()
    config = config_for("best_fit", 64, **{"eval.mode": "documents", "eval.batch_size": 4})
    result = evaluate(model, store, config, progress=False)
    w = np.asarray(store.mask, np.float64)
    assert result["tokens"] == int(np.count_nonzero(w)) and result["bits_per_byte"] is None
    nll = [contract_loss(model, one_alone(ids, list(ws)))[2][0].astype(np.float64) for ids, ws in examples]
    weights = np.concatenate([np.asarray(ws[1:], np.float64) for _, ws in examples])
    np.testing.assert_allclose(result["token_perplexity"], np.exp(np.average(np.concatenate(nll), weights=weights)),
                               rtol=1e-5)


def test_an_example_with_nothing_scored_is_dropped_and_counted(chat_folder, tmp_path):
    records = [{"input_ids": [5, 6], "labels": [-100, -100]}, {"input_ids": [7, 8], "labels": [-100, 8]}]
    config = load_config(None, overrides(tmp_path, chat_folder, "tokenized",
                                         [write_jsonl(tmp_path / "t.jsonl", records)]))
    prepared = prepare(config, splits=("train",))
    assert prepared.stores["train"].num_docs == 1 and prepared.summary["train"]["dropped_unscored"] == 1


def test_every_corpus_kind_gives_the_same_store(chat_folder, tmp_path):
    zstandard = pytest.importorskip("zstandard")
    records = synthetic_chats(12, seed=5)
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    stores = []
    for corpus, name in [("jsonl", "c.jsonl.gz"), ("jsonl", "c.jsonl.zst"), ("parquet", "c.parquet"),
                         ("hf", "c.jsonl.gz")]:
        config = load_config(None, overrides(tmp_path / corpus / name, chat_folder, "chat", [tmp_path / name],
                                             **{"data.corpus": corpus}))
        stores.append(prepare(config, splits=("train",)).stores["train"])
    for store in stores[1:]:
        np.testing.assert_array_equal(np.asarray(store.tokens), np.asarray(stores[0].tokens))
        np.testing.assert_array_equal(np.asarray(store.mask), np.asarray(stores[0].mask))


def test_instruction_formats_refuse_strategies_that_cut_examples_and_loss_on_they_lack(tmp_path):
    base = ["data.corpus=jsonl", "data.train_files=[a.jsonl]", "data.format=chat"]
    with pytest.raises(ConfigError, match=r"data.strategy: got 'window', expected pack \(any packer but fill or "
                                          r"grain_concat_split\), length_grouped or block"):
        check_config(load_config(None, base + ["data.strategy=window"]))  # (as every command checks a config)
    for packer in ("fill", "grain_concat_split"):  # they fill every row by cutting examples at its end
        with pytest.raises(ConfigError, match=f"data.strategy: got 'pack' with packer='{packer}', expected pack"):
            check_config(load_config(None, base + ["data.strategy=pack", f"data.packer={packer}"]))
    with pytest.raises(ConfigError, match="data.loss_on: got 'completion', expected one of auto, assistant"):
        load_config(None, base + ["data.loss_on=completion"])
    with pytest.raises(ConfigError, match="data.format: got 'chat' with corpus='text'"):
        load_config(None, ["data.corpus=text", "data.train_files=[a.txt]", "data.format=chat"])


# ---------------------------------------------------------------------------
# Packing: isolation, targets, positions


def example_store(examples: list[tuple[list[int], list[int]]], eot: int = 0) -> TokenStore:
    """An in-memory instruction store: each example's ids and each id's weight as a target (the first id is
    never one: nothing comes before it)."""
    return TokenStore.from_documents([ids for ids, _ in examples], eot_id=eot, vocab_size=64,
                                     weights=[list(w) for _, w in examples])


def one_alone(ids: list[int], weights: list[float]) -> dict:
    """One example as transformers and TRL train it: inputs ids[:-1], targets ids[1:], nothing before or after."""
    n = len(ids) - 1
    return {"inputs": np.asarray([ids[:-1]]), "targets": np.asarray([ids[1:]]), "positions": np.arange(n)[None],
            "segment_ids": np.ones((1, n), np.int32), "weights": np.asarray([weights[1:]], np.float32)}


examples_strategy = st.lists(
    st.integers(1, 40).flatmap(lambda n: st.tuples(st.lists(st.integers(1, 63), min_size=n, max_size=n),
                                                   st.lists(st.integers(0, 1), min_size=n, max_size=n))),
    min_size=1, max_size=25)


def config_for(packer: str, seq_len: int = 32, **extra) -> object:
    settings_ = {"data.corpus": "jsonl", "data.train_files": "[x.jsonl]", "data.format": "tokenized",
                 "data.seq_len": seq_len, "data.batch_size": 4, "data.packer": packer, "data.overlong": "split",
                 "data.shuffle": "false"}
    settings_.update(extra)
    return load_config(None, [f"{k}={v}" for k, v in settings_.items()])


def epoch_batches(config, store, n_batches: int) -> list[dict]:
    iterator = iter(build_pipeline(config, store))
    return [next(iterator) for _ in range(n_batches)]


@settings(max_examples=25, deadline=None)
@given(examples=examples_strategy, layout=st.sampled_from(LAYOUTS))
def test_no_target_crosses_an_example_positions_restart_and_weights_are_the_mask(examples, layout):
    assume(any(sum(w[1:]) for _, w in examples))
    store = example_store(examples)
    config = config_for("best_fit", **{"data.batch_size": 1, **layout})  # (a batch per row: any store has an epoch)
    grain = layout.get("data.packer", "").startswith("grain")
    seen_scored = 0
    for batch in epoch_batches(config, store, 3 if grain else EpochPlanner(config, store).plan(0).num_batches):
        for row in range(batch["inputs"].shape[0]):
            seg = batch["segment_ids"][row]
            for s in set(seg[seg > 0].tolist()):
                where = np.flatnonzero(seg == s)
                assert np.all(np.diff(where) == 1)  # one contiguous run per example
                np.testing.assert_array_equal(batch["positions"][row, where], np.arange(len(where)))
                piece = np.concatenate([batch["inputs"][row, where], batch["targets"][row, where[-1:]]])
                # the piece is a slice of one example's ids: never two examples' tokens, never a separator
                owner = [i for i, (ids, _) in enumerate(examples) if _is_slice(piece, np.asarray(ids))]
                assert owner, f"segment {piece} is not inside one example"
        seen_scored += int(batch["weights"].sum())
        assert set(np.unique(batch["weights"])) <= {0.0, 1.0}
    if not grain:  # (Grain's iterator runs on across epochs: its three batches are checked row by row above)
        assert seen_scored == sum(sum(w[1:]) for _, w in examples)


def _is_slice(piece: np.ndarray, seq: np.ndarray) -> bool:
    return any(np.array_equal(seq[k:k + len(piece)], piece) for k in range(len(seq) - len(piece) + 1))


# ---------------------------------------------------------------------------
# Loss and gradients: packed equals alone, in both normalizations


def tiny_model():
    config = load_config(None, ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
                                "model.attention=xla", "model.max_seq_len=64", "data.seq_len=64"])
    return build_model(config, 64, rngs=nnx.Rngs(0))


def contract_loss(model, batch):
    """Contract 3: sum(w * nll) / sum(w) over the batch, and its gradient (rows padded to 64: one compile)."""
    width = batch["inputs"].shape[1]
    batch = {k: np.pad(v, ((0, 0), (0, 64 - width))) for k, v in batch.items()}
    value, grads, nll = _contract_loss(model, batch)
    return value, grads, np.asarray(nll)[:, :width]


@nnx.jit
def _contract_loss(model, batch):
    def loss(m):
        logits = m(jnp.asarray(batch["inputs"]), positions=jnp.asarray(batch["positions"]),
                   segment_ids=jnp.asarray(batch["segment_ids"]))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                                   jnp.asarray(batch["targets"])[..., None], -1)[..., 0]
        w = jnp.asarray(batch["weights"])
        return jnp.sum(w * nll) / jnp.sum(w), nll
    (value, nll), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, grads, nll


def whole_epoch(config, store) -> dict:
    """Every row of epoch 0 as one batch: contract 3 over them is the loss of one global batch holding them all."""
    return joined(epoch_batches(config, store, EpochPlanner(config, store).plan(0).num_batches))


def joined(batches: list[dict]) -> dict:
    width = max(b["inputs"].shape[1] for b in batches)
    return {k: np.concatenate([np.pad(b[k], ((0, 0), (0, width - b[k].shape[1]))) for b in batches])
            for k in batches[0]}


@pytest.mark.parametrize("fractional", [False, True], ids=["0/1 weights", "fractional weights"])
@pytest.mark.parametrize("normalization", ["tokens", "examples"])
def test_a_packed_batch_and_the_examples_unpacked_give_the_same_loss_and_gradients(normalization, fractional):
    rng = np.random.default_rng(0)
    examples = []
    for n in rng.integers(3, 20, 10):
        weights = (rng.random(n) < 0.5).astype(int)
        weights[-1] = 1
        if fractional:  # Levanter-style weights (data.loss_weights_dtype=float32): a weighted mean per example
            weights = weights * rng.choice([0.1, 0.5, 1.0, 2.5], n)
        examples.append((rng.integers(1, 64, n).tolist(), weights.tolist()))
    store = example_store(examples)
    assert store.mask.dtype == (np.float32 if fractional else np.uint8)
    model = tiny_model()
    packed, alone = (whole_epoch(config_for("best_fit", 64, **{"data.batch_size": 1,
                                                               "train.loss_normalization": normalization, **cap}),
                                 store) for cap in ({}, {"data.max_segments_per_row": 1}))
    assert (packed["segment_ids"].max(axis=1) > 1).any()  # several examples share a row
    used = [int((b["segment_ids"].max(axis=1) > 0).sum()) for b in (packed, alone)]
    assert alone["segment_ids"].max() == 1 and used[0] < used[1] == len(examples)
    loss_p, grads_p, _ = contract_loss(model, packed)
    loss_a, grads_a, nll_a = contract_loss(model, alone)
    np.testing.assert_allclose(loss_p, loss_a, rtol=1e-5)
    chex.assert_trees_all_close(grads_p, grads_a, rtol=2e-4, atol=1e-6)
    # the reference, computed apart from the contract: each example run alone, its scored tokens' losses
    per_example = []  # (the weights, the losses) of each example's targets
    for ids, weights in examples:
        _, _, nll = contract_loss(model, one_alone(ids, weights))
        per_example.append((np.asarray(weights[1:], np.float64), nll[0].astype(np.float64)))
    expected = (np.mean([np.average(nll, weights=w) for w, nll in per_example]) if normalization == "examples"
                else np.average(np.concatenate([nll for _, nll in per_example]),
                                weights=np.concatenate([w for w, _ in per_example])))
    np.testing.assert_allclose(loss_p, expected, rtol=1e-5)


def test_examples_normalization_weighs_each_example_one_in_all_and_split_pieces_add_up():
    examples = [([5] * 50, [1] * 50), ([6, 7, 8], [0, 1, 1]), ([9] * 10, [0] * 5 + [1] * 5)]
    store = example_store(examples)
    config = config_for("best_fit", 16, **{"train.loss_normalization": "examples", "data.batch_size": 1})
    batch = whole_epoch(config, store)
    assert batch["weights"].sum() == pytest.approx(3.0)  # one per example, the 50-token one split into pieces
    # (49 of the first's targets are scored: its first id is none)
    np.testing.assert_allclose(np.unique(batch["weights"]), [0.0, 1 / 49, 1 / 5, 1 / 2], rtol=1e-6)


def test_two_processes_read_the_rows_and_weights_of_one_process_in_examples_mode():
    rng = np.random.default_rng(1)
    examples = [(rng.integers(1, 64, n).tolist(), (rng.random(n) < 0.6).astype(int).tolist())
                for n in rng.integers(3, 30, 40)]
    config = config_for("best_fit", 32, **{"train.loss_normalization": "examples", "data.batch_size": 4})
    store = example_store(examples)
    whole = next(iter(build_pipeline(config, store)))
    halves = [next(iter(build_pipeline(config, store, process_index=p, process_count=2))) for p in (0, 1)]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])
    assert len(np.unique(whole["weights"][whole["weights"] > 0])) > 1  # weights of several examples' sizes


def test_the_layout_picture_shades_prompts_and_whitens_padding():
    from seqjax.data.picture import layout_image

    batch = {"segment_ids": np.asarray([[1, 1, 1, 2, 2, 0]]), "weights": np.asarray([[0, 1, 1, 0, 1, 0]], np.float32)}
    image = layout_image(batch)[0]
    assert np.all(image[5] == 1.0) and not np.all(image[0] == 1.0)  # padding white, a prompt token not
    assert image[0].min() > image[1].min()  # the prompt token is paler than its example's scored tokens
    assert not np.allclose(image[1], image[4])  # two examples, two colours


def test_the_layout_picture_gives_each_example_of_the_batch_its_own_colour_not_each_position_in_a_row():
    from seqjax.data.picture import layout_image

    segments = np.asarray([[1, 1, 2, 3, 3, 0], [1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1]])
    image = layout_image({"segment_ids": segments, "weights": (segments > 0).astype(np.float32)})
    colours = {tuple(np.round(image[r, c], 6)) for r, c in zip(*np.nonzero(segments))}
    assert len(colours) == 6  # six examples: the first of each row no longer shares one colour


# ---------------------------------------------------------------------------
# Resume, overlong examples


def test_resume_mid_epoch_gives_the_same_batches_with_instruction_data(chat_folder, tmp_path):
    config = load_config(None, overrides(tmp_path, chat_folder, "chat",
                                         [write_jsonl(tmp_path / "c.jsonl", synthetic_chats(60, seed=6))]))
    store = prepare(config, splits=("train",)).stores["train"]
    iterator = iter(build_pipeline(config, store))
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(4)]
    resumed = iter(build_pipeline(config, store))
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    assert any(b["weights"].sum() for b in expected)


@pytest.mark.parametrize("overlong", ["drop", "truncate", "split"])
def test_overlong_examples_follow_the_policy_and_truncation_keeps_the_start(overlong):
    examples = [(list(range(1, 41)), [1] * 40), ([50, 51, 52], [0, 1, 1])]
    store = example_store(examples)
    config = config_for("best_fit", 16, **{"data.overlong": overlong, "data.batch_size": 1})
    batch = whole_epoch(config, store)
    inputs = batch["inputs"][batch["segment_ids"] > 0].tolist()
    long_tokens = [t for t in inputs if 1 <= t <= 40]
    if overlong == "drop":
        assert long_tokens == []
    elif overlong == "truncate":
        assert long_tokens == list(range(1, 17))  # its first 16 inputs (17 ids, 16 targets): the start is kept
    else:  # every id is an input once but the last, which is only a target
        assert sorted(long_tokens) == list(range(1, 40)) and 40 in batch["targets"]
    assert 52 in batch["targets"]  # the short example is always there, whole


@pytest.mark.parametrize("layout", [{"data.packer": "best_fit"}, {"data.packer": "grain_best_fit"},
                                    {"data.strategy": "length_grouped"}])
def test_instruction_data_truncates_by_default_and_a_cut_example_left_without_an_answer_is_left_out(layout):
    """TRL's default: an example longer than a row keeps its start (no piece whose answers lost their prompt).
    One whose answers all lie past the row would train nothing, so it is left out, and the report counts it."""
    from seqjax.data.stats import overlong_counts, overlong_line

    examples = [(list(range(1, 41)), [0] * 30 + [1] * 10),  # answers at ids 31-40: past a row of 16
                (list(range(41, 61)), [0] * 5 + [1] * 15),  # cut, but its first answers are in
                ([61, 62, 63], [0, 1, 1])]
    store = example_store(examples)
    config = config_for("best_fit", 16, **{"data.overlong": "null", "data.batch_size": 1, **layout})
    assert config.data.resolved_overlong == "truncate"
    grain = "grain" in layout.get("data.packer", "")
    batch = joined(epoch_batches(config, store, 2)) if grain else whole_epoch(config, store)
    inputs = batch["inputs"][batch["segment_ids"] > 0].tolist()
    assert not set(range(1, 41)) & set(inputs)  # left out whole
    assert [t for t in inputs if 41 <= t <= 60] == list(range(41, 57)) and 63 in batch["targets"]
    report = overlong_counts(config, store)
    assert report["longer_than_a_row"] == report["truncated"] == 2 and report["left_out_without_answer"] == 1
    assert overlong_line(report, "examples") == (
        "data.overlong=truncate: 2 of 3 examples are longer than a row of data.seq_len=16: truncated: their ends "
        "are not trained; 1 cut ones kept no scored token and are left out")
    split = overlong_counts(config_for("best_fit", 16, **{"data.overlong": "split"}), store)
    assert split["split"] == 2 and split["pieces"] == 5 and split["left_out_without_answer"] == 1  # (ids 2-17)


@pytest.mark.parametrize("layout", [{"data.packer": "best_fit"}, {"data.packer": "grain_best_fit"},
                                    {"data.strategy": "length_grouped"}])
@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_the_data_report_counts_scored_targets_and_the_examples_dropped_or_truncated(layout, overlong):
    """python -m seqjax.data's numbers, against the epoch's own batches: the scored fraction of the real targets,
    examples per row, and the examples the overlong policy dropped or truncated."""
    from seqjax.data.stats import epoch_stats

    rng = np.random.default_rng(3)
    lengths = [3, 40, 9, 14, 25, 6, 33, 11, 2, 18]  # 40, 25, 33 and 18 predict more than a row of 16
    examples = [(rng.integers(1, 64, n).tolist(), rng.integers(0, 2, n).tolist()) for n in lengths]
    examples[0] = (examples[0][0], [0, 1, 1])
    store = example_store(examples)
    config = config_for("best_fit", 16, **{"data.overlong": overlong, "data.batch_size": 1, **layout})
    stats = epoch_stats(config, store)
    # What the policy leaves of each example's targets (its ids but the first).
    targets = [w[1:] for _, w in examples]
    kept = [t for t in targets if len(t) <= 16] if overlong == "drop" else [t[:16] for t in targets]
    assert stats["examples"] == len(examples) and stats["real_tokens"] == sum(map(len, kept))
    assert stats["scored_targets"] == sum(map(sum, kept))
    assert stats["scored_fraction"] == pytest.approx(sum(map(sum, kept)) / sum(map(len, kept)))
    too_long = sum(n - 1 > 16 for n in lengths)
    assert stats["documents_dropped"] == (too_long if overlong == "drop" else 0)
    if "grain" not in layout.get("data.packer", ""):  # (Grain's packers report no truncation or rows per epoch)
        assert stats["documents_truncated"] == (too_long if overlong == "truncate" else 0)
        batches = epoch_batches(config, store, stats["batches_per_epoch"])
        assert stats["scored_targets"] == sum(int((b["weights"] > 0).sum()) for b in batches)
        assert stats["segments_per_row_mean"] == pytest.approx(len(kept) / stats["rows"])


# ---------------------------------------------------------------------------
# Every format trains (in process: two steps each)


@pytest.mark.slow  # five in-process training runs
@pytest.mark.parametrize("fmt, loss_on, normalization, fractional", [
    ("prompt_completion", "auto", "examples", False),
    ("chat", "last_assistant", "tokens", False),
    ("tokenized", "auto", "examples", False),
    ("tokenized", "auto", "tokens", True),  # data.loss_weights_dtype=float32
    ("text", "auto", "tokens", False),
])
def test_every_format_trains_and_validates_on_its_scored_tokens(chat_folder, tokenizer, tmp_path, fmt, loss_on,
                                                                normalization, fractional):
    from seqjax.train.loop import train  # (the training stage: only this test runs a loop)

    if fmt == "prompt_completion":
        records = pairs(30)
    elif fmt == "chat":
        records = synthetic_chats(30)
    elif fmt == "tokenized":
        records = [{"input_ids": tokenizer.encode_text(r["prompt"]) + tokenizer.encode_text(r["completion"]),
                    "loss_weights": [0] * len(tokenizer.encode_text(r["prompt"]))
                    + [0.5 if fractional else 1] * len(tokenizer.encode_text(r["completion"]))} for r in pairs(30)]
    else:
        records = [{"text": r["prompt"] + r["completion"]} for r in pairs(30)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    config = load_config(None, overrides(tmp_path, chat_folder, fmt, [path], **{
        "data.loss_on": loss_on, "train.loss_normalization": normalization, "train.steps": 2,
        "train.warmup_steps": 0, "train.eval_every": 0, "train.checkpoint_every": 2, "train.async_checkpoint": "false",
        "run.trackers": "[jsonl]", "data.loss_weights_dtype": "float32" if fractional else "uint8"}))
    summary = train(config)
    store = prepare(config, splits=("valid",)).stores["valid"]
    assert np.isfinite(summary["val_loss"]) and summary["finished"]
    if fmt != "text":
        assert 0 < store.scored_tokens < store.predicted_tokens
        assert summary["val_word_perplexity"] is None
        assert summary["val_bits_per_byte"] is None if fractional else summary["val_bits_per_byte"] > 0
    jax.clear_caches()


@pytest.mark.slow  # eighteen in-process two-step runs
@pytest.mark.parametrize("normalization", ["tokens", "examples"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(map(str, layout.values())))
def test_chats_train_under_every_layout_and_both_normalizations(chat_folder, tokenizer, tmp_path, layout,
                                                                normalization):
    """Packed chats train through the real loop with each packer, length grouping and complete_doc blocks: the
    first step's loss is near log(vocab) (a fresh model), the loss is finite at every step, and validation runs."""
    from seqjax.train.loop import train

    path = write_jsonl(tmp_path / "chats.jsonl", synthetic_chats(40))
    config = load_config(None, overrides(tmp_path, chat_folder, "chat", [path], **{
        "train.loss_normalization": normalization, "train.steps": 2, "train.warmup_steps": 0, "train.eval_every": 0,
        "train.checkpoint_every": 2, "train.async_checkpoint": "false", "run.trackers": "[jsonl]",
        **({} if layout.get("data.strategy") == "block" else {"data.overlong": "truncate"}), **layout}))
    summary = train(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r and r.get("split") is None]
    assert summary["finished"] and np.isfinite(summary["val_loss"]) and len(losses) >= 1
    if layout.get("data.strategy") != "block":  # what data.overlong did is in the summary (and the log)
        assert summary["overlong"]["policy"] == "truncate" and summary["overlong"]["documents"] > 0
    assert np.all(np.isfinite(losses)) and losses[0] == pytest.approx(np.log(tokenizer.vocab_size), rel=0.1)
    jax.clear_caches()


def test_the_chat_specials_are_single_tokens(tokenizer):
    for token in CHAT_SPECIALS:
        assert len(tokenizer.encode_text(token)) == 1


def test_text_under_a_llama_tokenizer_is_framed_with_its_bos_and_the_report_says_so(chat_folder, tokenizer, tmp_path):
    """Issue: an imported Llama's documents were framed with </s>. They open with <s>, as transformers encodes them,
    in training, evaluation (the same store) and generation (prompts open with tokenizer.bos_token)."""
    docs = [{"text": r["prompt"] + r["completion"]} for r in pairs(5)]
    config = load_config(None, overrides(tmp_path, chat_folder, "text", [write_jsonl(tmp_path / "t.jsonl", docs)]))
    prepared = prepare(config, splits=("train",))
    store = prepared.stores["train"]
    bos = tokenizer.token_id("<s>")
    assert store.eot_id == bos and tokenizer.separator_id == bos != tokenizer.eot_id
    for i, doc in enumerate(docs):
        framed = np.asarray(store.doc_sequence(i))
        assert framed[0] == bos and framed[-1] == bos
        assert tokenizer.decode(framed[1:-1]) == doc["text"]
    assert prepared.summary["train"]["framing"].startswith("<s> document <s> document")
