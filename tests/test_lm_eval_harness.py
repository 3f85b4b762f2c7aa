"""seqjax's lm_eval mode against the lm-evaluation-harness's own code (0.4.13), where it imports without torch.

The harness's pieces run here as the harness runs them: its wikitext
detokenizer and ``process_results`` (loaded from the installed package's
task file), ``get_rolling_token_windows`` + ``make_disjoint_window``, and the
``weighted_perplexity`` / ``bits_per_byte`` aggregations. scripts/setup.sh
installs ``lm-eval`` without its dependencies (torch is not needed for these)
plus ``sacrebleu``, which its metrics module imports. Which tokens a page
becomes is checked against transformers' tokenizer of an export, which is what
the harness calls (``tokenizer(page)``, default special tokens, since 0.4.9.2).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.eval.lm_eval import harness_pages, harness_words, rolling_windows, wikitext_detokenize

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval test extra (scripts/setup.sh installs it)")
from lm_eval.api.metrics import bits_per_byte, weighted_perplexity  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from test_lm_eval import rows_of  # noqa: E402


def wikitext_task():
    """The harness's tasks/wikitext/preprocess_wikitext.py, loaded from the installed package by path."""
    path = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "preprocess_wikitext.py"
    spec = importlib.util.spec_from_file_location("harness_wikitext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES = [
    " = Valkyria = \n \n The game @-@ like series , ( a pet ) is \" good \" . It 's 1 @,@ 000 @.@ 5 ° C . \n",
    " = = Plot = = \n \n [ x ] { y } ' z ' : a ; b ! c ? N s ' d \n = = = Deep = = = \n",
]


def real_pages(wikitext_dir) -> list[str]:
    path = wikitext_dir / "wikitext-2-raw" / "wiki.valid.raw" if wikitext_dir else None
    return harness_pages(path.read_text(encoding="utf-8")) if path and path.is_file() else []


def test_the_detokenizer_is_the_harness_s_on_every_page():
    from conftest import wikitext_dir

    task = wikitext_task()
    pages = PAGES + real_pages(wikitext_dir())
    for page in pages:
        assert wikitext_detokenize(page) == task.wikitext_detokenizer({"page": page})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(2, 12))
def test_rolling_windows_are_the_harness_s_get_rolling_token_windows(lengths, context):
    rng = np.random.default_rng(sum(lengths) * context)
    docs = [rng.integers(2, 60, n).tolist() for n in lengths]
    expected = []
    for doc in docs:
        for window in get_rolling_token_windows(token_list=doc, prefix_token=1, max_seq_len=context, context_len=1):
            inputs, scored = make_disjoint_window(window)
            # the model reads (context + continuation)[:-1] and scores the continuation
            expected.append(((list(inputs) + list(scored))[:-1][-context:], list(scored)))
    assert rows_of(rolling_windows(docs, 1, 64, context)) == expected


def test_words_bytes_and_the_aggregations_are_the_harness_s():
    task = wikitext_task()
    rng = np.random.default_rng(0)
    loglikelihoods = (-rng.uniform(10, 500, len(PAGES))).tolist()
    per_page = [task.process_results({"page": p}, [ll]) for p, ll in zip(PAGES, loglikelihoods)]
    assert [r["word_perplexity"][1] for r in per_page] == [harness_words(p) for p in PAGES]
    assert [r["byte_perplexity"][1] for r in per_page] == [len(p.encode("utf-8")) for p in PAGES]
    nll, words, n_bytes = -sum(loglikelihoods), sum(map(harness_words, PAGES)), sum(len(p.encode()) for p in PAGES)
    # the formulas of seqjax.eval.evaluate.evaluate_lm_eval
    assert weighted_perplexity([r["word_perplexity"] for r in per_page]) == pytest.approx(math.exp(nll / words))
    assert weighted_perplexity([r["byte_perplexity"] for r in per_page]) == pytest.approx(math.exp(nll / n_bytes))
    assert bits_per_byte([r["bits_per_byte"] for r in per_page]) == pytest.approx(nll / (n_bytes * math.log(2)))


def test_pages_are_encoded_as_the_harness_s_tokenizer_call_encodes_them(tmp_path):
    """Since 0.4.9.2 the harness encodes a page with ``tokenizer(page)``: an export's opening BOS included."""
    from transformers import AutoTokenizer  # the harness's tokenizer class, as it loads an export

    from hf_support import write_chat_llama_folder, write_llama_folder
    from seqjax.store.tokenizer import Tokenizer

    for folder, eos, bos in ((write_llama_folder(tmp_path / "gpt2like"), "<|endoftext|>", "<|endoftext|>"),
                             (write_chat_llama_folder(tmp_path / "llama"), "</s>", "<s>")):
        ours = Tokenizer(folder / "tokenizer.json", eos, bos)
        # the export's tokenizer.json is the run's plus an opening-token post-processor when it had none
        from seqjax.hf.folders import _tokenizer_with_opening_token

        (tmp_path / "export").mkdir(exist_ok=True)
        (tmp_path / "export" / "tokenizer.json").write_text(_tokenizer_with_opening_token(folder / "tokenizer.json",
                                                                                          bos))
        (tmp_path / "export" / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "%s", "eos_token": "%s"}' % (bos, eos))
        theirs = AutoTokenizer.from_pretrained(tmp_path / "export")
        for page in PAGES:
            text = wikitext_detokenize(page)
            assert ours.encode_default(text) == theirs(text).input_ids
            assert ours.encode_default(text)[0] == ours.bos_id and ours.encode_default(text)[1:] == \
                ours.encode_text(text)
