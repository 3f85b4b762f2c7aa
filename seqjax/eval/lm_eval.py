"""The lm-evaluation-harness ``wikitext`` task, reimplemented on seqjax's windows
(``eval.mode=lm_eval``).

The harness scores WikiText-2 raw (``wikitext-2-raw-v1``) one Wikipedia page
at a time, and reports word_perplexity, byte_perplexity and bits_per_byte.
Its steps, each reproduced here:

1. **Pages** (the ``EleutherAI/wikitext_document_level`` split of
   ``wiki.{valid,test}.raw``): the file is cut at ``\\n``; a page starts at
   every line that, with ``= = =`` read as ``===`` and ``= =`` as ``==`` and
   stripped, starts with ``"= "`` and ends with ``" ="`` (a top-level title:
   a section heading becomes ``== ... ==``). A page is its lines joined by
   ``\\n``; whitespace-only pages are dropped, except the last one.
2. **Detokenizer** (:func:`wikitext_detokenize`): WikiText's spaced-out
   punctuation (``" @-@ "``, ``" , "``, ``"( x )"``, ...) is closed up again.
3. **Tokens**: the detokenized page encoded as one string. Harness 0.4.9.2
   and later (0.4.13 today) encode it with the tokenizer's default special
   tokens (:meth:`Tokenizer.encode_default`: a Llama's, or an exported seqjax
   model's, opening BOS is then the page's first scored token);
   ``eval.lm_eval_special_tokens=false`` encodes it without them
   (:meth:`Tokenizer.encode_text`), as 0.4.9.1 and earlier did. The *prefix*
   token is the tokenizer's beginning-of-text token (``tokenizer.bos_token``),
   else its end-of-text token, as the harness's ``prefix_token_id``.
4. **Rolling windows** (``loglikelihood_rolling`` with the model's max length
   L and a context of 1): the first window reads ``[prefix] + t[0 : L-1]``
   and scores ``t[0 : L]``; each next one scores the next (up to) L tokens
   and reads the L tokens before each of them, so the last window is moved
   back to read a full L. This is seqjax's ``documents`` mode on the unit
   ``[prefix] + t``, with no closing end-of-text.
5. **Units**, summed over pages: the log-likelihood over the words and bytes
   of the *original* page (before detokenizing): words =
   ``len(re.split(r"\\s+", page))`` (a leading space counts an empty word, as
   in the harness), bytes = UTF-8 bytes. word_perplexity = exp(nll / words),
   byte_perplexity = exp(nll / bytes), bits_per_byte = nll / (bytes ln 2).

Example: the page ``" = A = \\n \\n The cat @-@ like dog , ( a pet ) . \\n"`` is scored as
``" = A =\\n\\nThe cat-like dog, (a pet).\\n"``, and counts 16 words (the empty pieces before the
first and after the last space included) and 47 bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from seqjax.config.tree import Config
from seqjax.eval.windows import EvalWindows, unit_windows
from seqjax.store.corpus import find_sources, read_text
from seqjax.store.reader import TokenStore
from seqjax.store.tokenizer import Tokenizer

MODE = "lm_eval"

# The detokenizer, in the harness's order: (kind, pattern, replacement). "text" replaces a literal
# string, "regex" a regular expression (the harness's contraction rule is a regex whose replacement
# is literal text).
_DETOKENIZE = [
    ("text", "s '", "s'"),
    ("regex", r"/' [0-9]/", "/'[0-9]/"),
    ("text", " @-@ ", "-"),
    ("text", " @,@ ", ","),
    ("text", " @.@ ", "."),
    *[("text", f" {mark} ", f"{mark} ") for mark in (":", ";", ".", "!", "?", ",")],
    *[("regex", rf"{re.escape(a)}\s*([^{re.escape(b)}]*?)\s*{re.escape(b)}", f"{a}\\1{b}")
      for a, b in (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))],
    ("text", "= = = =", "===="),
    ("text", "= = =", "==="),
    ("text", "= =", "=="),
    ("text", " \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    ("text", " \n", "\n"),
    ("text", "\n ", "\n"),
    ("text", " N ", " 1 "),
    ("text", " 's", "'s"),
]


def wikitext_detokenize(page: str) -> str:
    """The harness's ``wikitext_detokenizer``: WikiText's tokenized spacing undone, rule by rule in
    its order."""
    for kind, pattern, replacement in _DETOKENIZE:
        page = page.replace(pattern, replacement) if kind == "text" else re.sub(
            pattern, replacement, page)
    return page


def _is_page_title(line: str) -> bool:
    line = line.replace("= = =", "===").replace("= =", "==").strip()
    return line.startswith("= ") and line.endswith(" =")


def harness_pages(text: str) -> list[str]:
    """A raw WikiText file cut into the harness's pages (step 1 of the module docstring)."""
    pages, lines = [], []
    for line in text.split("\n"):
        if _is_page_title(line):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def harness_words(page: str) -> int:
    """Words as the harness counts them: the pieces of the original page split at whitespace
    runs."""
    return len(re.split(r"\s+", page))


@dataclass(frozen=True)
class LmEvalDocs:
    """One split as the harness scores it: the pages, their token units and windows, and the
    harness's counts."""

    pages: list[str]
    windows: EvalWindows
    words: int
    bytes: int
    tokens: int  # tokens scored: every token of every detokenized page


def rolling_windows(encoded: list[list[int]], prefix_id: int, vocab_size: int,
                    context: int) -> EvalWindows:
    """The harness's rolling windows over each token list, as seqjax evaluation windows (step 4).

    For ``[10 .. 18]``, prefix 1 and context 4 the three windows read
    ``[1 10 11 12]``, ``[13 14 15 16]``, ``[14 15 16 17]`` and score
    ``10 11 12 13``, ``14 15 16 17`` and ``18``.
    """
    stream = TokenStore.from_documents(encoded, eot_id=prefix_id, vocab_size=vocab_size)
    offsets = np.asarray(stream.doc_offsets, np.int64)
    unit_start, unit_end = offsets[:-1] - 1, offsets[1:] - 2
    starts, ends, lo, hi = unit_windows(unit_start, unit_end, context, context, right_align_last=True)
    # one segment per window: a window never leaves its unit (ends), so no page sees another
    return EvalWindows(stream, MODE, context, context, starts, ends, lo, hi,
                       cross_document_attention=True)


def lm_eval_docs(pages: list[str], tokenizer: Tokenizer, context: int,
                 special_tokens: bool = True) -> LmEvalDocs:
    """Encode each detokenized page and lay out the rolling windows of ``context`` tokens (steps 2
    to 4).

    The units sit in one stream, ``[prefix] t(page 0) [prefix] t(page 1) ... [prefix]``; window
    bounds come from :func:`seqjax.eval.windows.unit_windows`, as for the documents mode, with each
    unit ending at its page's last token (the prefix after it is never read or scored).
    """
    # harness >= 0.4.9.2 / <= 0.4.9.1
    encode = tokenizer.encode_default if special_tokens else tokenizer.encode_text
    encoded = [encode(wikitext_detokenize(page)) for page in pages]
    return LmEvalDocs(
        pages=pages,
        windows=rolling_windows(encoded, tokenizer.bos_id, tokenizer.vocab_size, context),
        words=sum(harness_words(page) for page in pages),
        bytes=sum(len(page.encode("utf-8")) for page in pages),
        tokens=sum(len(ids) for ids in encoded),
    )


def read_lm_eval_split(config: Config, split: str, tokenizer: Tokenizer) -> LmEvalDocs:
    """The raw WikiText-2 ``split`` as the harness's pages, tokenized, windowed at
    ``config.eval_context``."""
    (path,) = find_sources(config, split)
    return lm_eval_docs(harness_pages(read_text(path)), tokenizer, config.eval_context,
                        config.eval.lm_eval_special_tokens)
