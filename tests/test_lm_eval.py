"""eval.mode=lm_eval: the lm-evaluation-harness wikitext task, rule by rule, window by window, unit by unit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_support import tiny_tokenizer
from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.eval.evaluate import evaluate_lm_eval
from seqjax.eval.lm_eval import harness_pages, harness_words, lm_eval_docs, rolling_windows, wikitext_detokenize
from seqjax.model import build_model


@pytest.mark.parametrize("raw, detokenized", [
    ("The dog 's bone", "The dog's bone"),
    ("the players ' union", "the players' union"),
    ("a 4 @-@ 3 win , 1 @,@ 000 fans , 2 @.@ 5 goals", "a 4-3 win, 1,000 fans, 2.5 goals"),
    ("He left . Then : this ; that ! Why ?", "He left. Then: this; that! Why ?"),
    ("a ( b c ) [ d ] { e } \" f \" ' g '", "a (b c) [d] {e} \"f\" 'g'"),
    (" = = = Sub = = = \n", " === Sub ===\n"),
    ("20 ° C", "20°C"),
    ("end \n next", "end\nnext"),
    ("by N votes", "by 1 votes"),
])
def test_the_detokenizer_applies_each_harness_rule(raw, detokenized):
    assert wikitext_detokenize(raw) == detokenized


def test_pages_start_at_top_level_titles_and_lose_nothing_but_the_separators():
    text = " \n = First = \n \n Text one . \n = = Section = = \n more \n \n = Second = \n \n two \n"
    pages = harness_pages(text)
    assert pages == [" = First = \n \n Text one . \n = = Section = = \n more \n ", " = Second = \n \n two \n"]
    # the leading blank line (whitespace only) is dropped; joining the rest gives the file back
    assert "\n".join([" "] + pages) == text
    assert harness_pages(" = A = \n") == [" = A = \n"]


def test_words_and_bytes_are_counted_on_the_original_page():
    page = " = A = \n \n The cat @-@ like dog , ( a pet ) . \n"
    # split at whitespace runs: '' = A = The cat @-@ like dog , ( a pet ) . '' -> 16 pieces
    assert harness_words(page) == 16
    assert len(page.encode("utf-8")) == 47
    assert wikitext_detokenize(page) == " = A =\n\nThe cat-like dog, (a pet).\n"


def rows_of(windows):
    """(inputs read, targets scored) of each window, from the batch rows seqjax builds."""
    batch = windows.rows(np.arange(len(windows)))
    out = []
    for inputs, targets, weights, segments in zip(batch["inputs"], batch["targets"], batch["weights"],
                                                  batch["segment_ids"]):
        out.append((inputs[segments > 0].tolist(), targets[weights > 0].tolist()))
    return out


def test_rolling_windows_match_a_hand_computed_case():
    tokens = list(range(10, 19))  # nine tokens, prefix 1, windows of 4
    assert rows_of(rolling_windows([tokens], 1, 64, 4)) == [
        ([1, 10, 11, 12], [10, 11, 12, 13]),
        ([13, 14, 15, 16], [14, 15, 16, 17]),
        ([14, 15, 16, 17], [18]),  # the last window moves back to read 4 tokens and scores only the new one
    ]
    assert rows_of(rolling_windows([[5, 6]], 1, 64, 4)) == [([1, 5], [5, 6])]


def harness_rolling(tokens: list[int], prefix: int, length: int) -> list[tuple[list[int], list[int]]]:
    """The harness's loglikelihood_rolling windows (context_len 1), written out as a plain loop: the oracle."""
    if not tokens:
        return []
    first = min(length, len(tokens))
    windows = [([prefix] + tokens[: first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, length)
        end = done + n
        windows.append((tokens[end - length - 1 : end - 1], tokens[end - n : end]))
        done = end
    return windows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(2, 12))
def test_rolling_windows_equal_the_harness_algorithm(lengths, context):
    rng = np.random.default_rng(sum(lengths) * context)
    docs = [rng.integers(2, 60, n).tolist() for n in lengths]
    expected = [w for doc in docs for w in harness_rolling(doc, 1, context)]
    assert rows_of(rolling_windows(docs, 1, 64, context)) == expected


@pytest.mark.parametrize("special_tokens", [True, False])  # harness >= 0.4.9.2, and <= 0.4.9.1
def test_units_follow_the_harness_definitions_on_a_uniform_model(tmp_path, special_tokens):
    tokenizer = tiny_tokenizer(tmp_path)
    config = load_config(None, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
                                "model.init_std=0.0", "model.attention=xla", "data.seq_len=8", "eval.batch_size=4"])
    model = build_model(config, tokenizer.vocab_size, rngs=nnx.Rngs(0))  # all-zero weights: uniform predictions
    pages = [" = The cat = \n \n the cat sat on a mat . \n ", " = Dog = \n \n a dog ran far away \n"]
    docs = lm_eval_docs(pages, tokenizer, context=8, special_tokens=special_tokens)
    result = evaluate_lm_eval(model, docs, config, split="test", progress=False)
    # today's harness also scores the opening token its tokenizer adds to each page
    tokens = sum(len(tokenizer.encode_text(wikitext_detokenize(p))) + special_tokens for p in pages)
    words = sum(harness_words(p) for p in pages)
    n_bytes = sum(len(p.encode()) for p in pages)
    ln_v = math.log(tokenizer.vocab_size)
    assert (result["tokens"], result["words"], result["bytes"], result["documents"]) == (tokens, words, n_bytes, 2)
    assert result["nll_sum"] == pytest.approx(tokens * ln_v, rel=1e-6)
    assert result["word_perplexity"] == pytest.approx(tokenizer.vocab_size ** (tokens / words), rel=1e-5)
    assert result["byte_perplexity"] == pytest.approx(tokenizer.vocab_size ** (tokens / n_bytes), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(tokens * math.log2(tokenizer.vocab_size) / n_bytes, rel=1e-6)


def test_the_real_splits_have_the_harness_page_counts(wikitext):
    # EleutherAI/wikitext_document_level, wikitext-2-raw-v1: 60 validation and 62 test pages
    for split, count in (("valid", 60), ("test", 62)):
        text = (wikitext / "wikitext-2-raw" / f"wiki.{split}.raw").read_text(encoding="utf-8")
        assert len(harness_pages(text)) == count


def test_lm_eval_needs_raw_wikitext_and_defaults_to_the_model_length():
    with pytest.raises(ConfigError, match="eval.mode: got 'lm_eval' on data.corpus=wikitext2 tokens, expected"):
        load_config(None, ["eval.mode=lm_eval"])
    config = load_config(None, ["eval.mode=lm_eval", "data.variant=raw", "model.max_seq_len=512", "data.seq_len=64"])
    assert config.eval_context == 512
    assert load_config(None, ["eval.mode=lm_eval", "data.variant=raw", "eval.context=32"]).eval_context == 32
