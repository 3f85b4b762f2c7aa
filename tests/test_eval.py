"""evaluate(): exact perplexity arithmetic, agreement of the protocols, and counts that match prepare's summary."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.eval.evaluate import evaluate, windows_for
from seqjax.model import build_model
from seqjax.store.reader import TokenStore
from test_train_support import with_devices

VOCAB = 40
EOT = 0


class UniformLM(nnx.Module):
    """Logits that say nothing: every token has probability 1 / vocab.

    The logits are a (zero) parameter, not a constant, so XLA cannot fold the whole evaluation at compile time.
    """

    def __init__(self, vocab: int):
        self.bias = nnx.Param(jnp.zeros((vocab,), jnp.float32))

    def __call__(self, inputs, *, positions, segment_ids):
        return jnp.broadcast_to(self.bias[...], inputs.shape + self.bias.shape)


def small_store(seed: int = 0, doc_lengths=(7, 0, 12, 3, 9)) -> TokenStore:
    rng = np.random.default_rng(seed)
    return TokenStore.from_documents([rng.integers(1, VOCAB, n) for n in doc_lengths], eot_id=EOT, vocab_size=VOCAB)


def config(*overrides: str):
    return load_config(None, ["model.max_seq_len=64", "data.seq_len=8", "eval.batch_size=4", *overrides])


def load_tiny_config():
    return load_config(None, ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=32",
                              "model.max_seq_len=64", "data.seq_len=8", "model.attention=xla", "model.init_std=0.5"])


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(load_tiny_config(), vocab_size=VOCAB, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("mode", ["blocks", "sliding", "documents"])
def test_uniform_logits_give_the_vocabulary_size(mode):
    store = small_store()
    result = evaluate(
        UniformLM(VOCAB),
        store,
        config(f"eval.mode={mode}", "eval.stride=3"),
        word_count=11,
        byte_count=50,
        progress=False,
    )
    assert result["tokens"] == store.predicted_tokens
    assert result["nll_sum"] == pytest.approx(store.predicted_tokens * math.log(VOCAB), rel=1e-6)
    assert result["token_perplexity"] == pytest.approx(VOCAB, rel=1e-6)
    assert result["word_perplexity"] == pytest.approx(VOCAB ** (store.predicted_tokens / 11), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(store.predicted_tokens * math.log2(VOCAB) / 50, rel=1e-6)


def direct_document_nll(model, store: TokenStore) -> float:
    """Each article [EOT] + text + [EOT] as one whole row (no windows), summed: what the protocols must match."""
    return float(direct_nll_per_document(model, store).sum())


def direct_nll_per_document(model, store: TokenStore) -> np.ndarray:
    """Each article [EOT] + text + [EOT] as one whole row of its own (no windows, no packing): its nll."""
    units = [np.asarray(store.doc_sequence(i), np.int64) for i in range(store.num_docs)]
    width = max(len(u) for u in units) - 1
    inputs, targets, segment_ids = (np.zeros((len(units), width), np.int32) for _ in range(3))
    for row, unit in enumerate(units):
        n = len(unit) - 1
        inputs[row, :n], targets[row, :n], segment_ids[row, :n] = unit[:-1], unit[1:], 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), inputs.shape)
    logits = np.asarray(model(inputs, positions=positions, segment_ids=segment_ids), np.float64)
    logp = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), targets[..., None], -1)[..., 0]
    return -(logp * segment_ids).sum(axis=1)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_modes_agree_when_the_context_covers_the_split(tiny_model):
    store = small_store()
    context = store.predicted_tokens  # one window holds the whole split: every article is seen whole
    reference = direct_document_nll(tiny_model, store)
    for mode in ("blocks", "sliding", "documents"):
        result = evaluate(tiny_model, store, config(f"eval.mode={mode}", f"eval.context={context}", "eval.stride=5"),
                          progress=False)
        assert result["tokens"] == store.predicted_tokens
        assert result["nll_sum"] == pytest.approx(reference, rel=1e-5), mode


def test_short_contexts_change_the_score_but_stride_equal_to_context_is_blocks(tiny_model):
    store = small_store()
    blocks = evaluate(tiny_model, store, config("eval.mode=blocks", "eval.context=4"), progress=False)
    sliding = evaluate(
        tiny_model, store, config("eval.mode=sliding", "eval.context=4", "eval.stride=4"), progress=False
    )
    assert sliding["nll_sum"] == blocks["nll_sum"]
    overlapping = evaluate(tiny_model, store, config("eval.mode=sliding", "eval.context=4", "eval.stride=1"),
                           progress=False)
    assert overlapping["tokens"] == blocks["tokens"]
    assert overlapping["nll_sum"] != pytest.approx(blocks["nll_sum"], rel=1e-4)  # the windows really differ


def test_deterministic_and_a_partial_run_says_so(tiny_model):
    store = small_store()
    cfg = config("eval.mode=sliding", "eval.context=4", "eval.stride=2", "eval.batch_size=2")
    first = evaluate(tiny_model, store, cfg, word_count=10, byte_count=40, progress=False)
    second = evaluate(tiny_model, store, cfg, word_count=10, byte_count=40, progress=False)
    assert first["nll_sum"] == second["nll_sum"] and first["complete"]
    partial = evaluate(tiny_model, store, cfg, max_batches=2, word_count=10, byte_count=40, progress=False)
    assert not partial["complete"] and partial["windows"] == 4
    assert 0 < partial["tokens"] < first["tokens"] and partial["word_perplexity"] is None


@pytest.mark.slow
def test_a_context_whose_batch_cannot_fit_the_device_is_refused_before_any_batch():
    from seqjax.config.tree import ConfigError

    huge = load_config(None, ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=32",
                              "model.max_seq_len=400000", "data.seq_len=8", "model.attention=xla",
                              "eval.context=400000", "eval.batch_size=4"])
    model = build_model(huge, vocab_size=VOCAB, rngs=nnx.Rngs(3))
    with pytest.raises(ConfigError, match=r"^eval.context=400000 with 4 rows per device \(eval.batch_size\) needs at "
                                          r"least [\d,.]+ GB for one batch .* more than this device's"):
        evaluate(model, small_store(), huge, progress=False)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_counts_match_the_prepare_summary(wikitext_prepared, wikitext_config):
    """Every protocol scores the tokens prepare counted; words and bytes are the split text's (from the manifest)."""
    vocab = wikitext_prepared.tokenizer.vocab_size
    for split in ("valid", "test"):
        store, summary = wikitext_prepared.stores[split], wikitext_prepared.summary[split]
        for mode in ("blocks", "documents"):
            cfg = load_config(None, [f"eval.mode={mode}", "eval.context=1024", "eval.batch_size=16"])
            result = evaluate(UniformLM(vocab), store, cfg, progress=False)
            assert result["split"] == split
            assert (result["tokens"], result["words"], result["bytes"]) == (
                summary["tokens"], summary["words"], summary["bytes"])
            assert result["token_perplexity"] == pytest.approx(vocab, rel=1e-5)
            assert result["word_perplexity"] == pytest.approx(vocab ** (summary["tokens"] / summary["words"]), rel=1e-4)
    assert wikitext_prepared.summary["test"]["words"] == 245_569  # the word-level test split's count in the literature


@pytest.mark.slow
def test_eval_cli_prints_one_json_object_last(wikitext_prepared, wikitext_config, tmp_path, monkeypatch, capsys):
    """``--run DIR --split test key=value``: the overrides reach evaluate; the checkpoint loader is stood in for."""
    from seqjax.main import eval as eval_cli

    saved = wikitext_config.save(tmp_path / "config.yaml")
    lm = UniformLM(wikitext_prepared.tokenizer.vocab_size)
    monkeypatch.setattr("seqjax.main.trained.load_for_inference",
                        lambda path, overrides: (load_config(saved, overrides), lm))
    eval_cli.main(
        ["--run", str(tmp_path), "--split", "test", "eval.mode=sliding", "eval.context=512", "eval.stride=256"]
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = wikitext_prepared.summary["test"]
    assert (result["split"], result["mode"], result["context"], result["stride"]) == ("test", "sliding", 512, 256)
    assert (result["tokens"], result["words"], result["bytes"]) == (
        summary["tokens"],
        summary["words"],
        summary["bytes"],
    )
    assert result["bits_per_byte"] == pytest.approx(summary["tokens"] * math.log2(lm.bias.shape[0]) / summary["bytes"])

    with pytest.raises(SystemExit):
        eval_cli.main(["--run", str(tmp_path), "eval.mode=chunks"])
    assert "eval.mode" in capsys.readouterr().err


SHARDED_RUN = """
import json, sys
sys.path.insert(0, "tests")
import jax
from flax import nnx
from test_eval import VOCAB, config, small_store
from seqjax.eval.evaluate import evaluate, windows_for
from seqjax.model import build_model
assert jax.device_count() == 2
from test_eval import load_tiny_config
model = build_model(load_tiny_config(), vocab_size=VOCAB, rngs=nnx.Rngs(3))
cfg = config("eval.mode=sliding", "eval.context=6", "eval.stride=2", "eval.batch_size=3")
result = evaluate(model, small_store(), cfg, progress=False)
print(json.dumps(result))
"""


@pytest.mark.slow
def test_two_devices_give_the_one_device_result(tiny_model):
    """The batch is split over two (forced host) devices; the odd eval.batch_size is rounded up to fit them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": with_devices(2), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SHARDED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    sharded = json.loads(out.stdout.strip().splitlines()[-1])
    single = evaluate(tiny_model, small_store(), config("eval.mode=sliding", "eval.context=6", "eval.stride=2",
                                                        "eval.batch_size=3"), progress=False)
    assert sharded["tokens"] == single["tokens"]
    assert sharded["nll_sum"] == pytest.approx(single["nll_sum"], rel=1e-5)


@pytest.mark.parametrize("context", [6, 40])
def test_packed_documents_equal_scoring_each_document_alone_in_fewer_rows(tiny_model, context):
    """eval.mode=documents packs short documents' windows into rows (eval.pack, the default): the same sums, per
    document too, as each document scored alone, in fewer rows than one window per row."""
    store = small_store(1, doc_lengths=(7, 1, 12, 3, 9, 2, 5, 30, 4))
    packed = evaluate(tiny_model, store, config("eval.mode=documents", f"eval.context={context}"),
                      progress=False, per_document=True)
    padded = evaluate(tiny_model, store, config("eval.mode=documents", f"eval.context={context}", "eval.pack=false"),
                      progress=False, per_document=True)
    assert packed["tokens"] == padded["tokens"] == store.predicted_tokens and packed["windows"] == padded["windows"]
    assert packed["nll_sum"] == pytest.approx(padded["nll_sum"], rel=1e-5)
    ours = np.asarray([d["nll"] for d in packed["per_document"]])
    np.testing.assert_allclose(ours, [d["nll"] for d in padded["per_document"]], rtol=1e-5)
    assert [d["tokens"] for d in packed["per_document"]] == np.diff(store.doc_offsets).tolist()
    if context == 40:  # every document fits one window: each is then scored exactly as alone
        np.testing.assert_allclose(ours, direct_nll_per_document(tiny_model, store), rtol=1e-5)
    windows = windows_for(store, config("eval.mode=documents", f"eval.context={context}"))
    assert windows.num_rows < len(windows)
    targets = windows.target_positions(np.arange(windows.num_rows))
    np.testing.assert_array_equal(np.sort(targets[targets >= 0]), np.arange(1, len(store.tokens)))


def test_eval_loss_normalization_examples_is_the_mean_of_each_documents_mean(tiny_model):
    store = small_store(2, doc_lengths=(3, 20, 6))
    tokens = evaluate(tiny_model, store, config("eval.mode=documents", "eval.context=32"), progress=False,
                      per_document=True)
    examples = evaluate(tiny_model, store, config("eval.mode=documents", "eval.context=32",
                                                  "eval.loss_normalization=examples"), progress=False)
    per = tokens["per_document"]
    assert tokens["loss"] == pytest.approx(tokens["nll_sum"] / tokens["tokens"])
    assert examples["loss"] == pytest.approx(np.mean([d["nll"] / d["tokens"] for d in per]), rel=1e-6)
    assert examples["loss"] != pytest.approx(tokens["loss"], rel=1e-3)  # short documents weigh more
