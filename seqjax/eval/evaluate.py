"""Perplexity on a split, in the units and protocols the literature uses (the library behind
``python -m seqjax.eval``).

One figure, three units, all from the same summed negative log-likelihood
(nats) over the scored tokens:

- ``token_perplexity = exp(nll_sum / tokens)``: per token of *this* tokenizer
  (what HF's scripts report; not comparable across vocabularies);
- ``word_perplexity = exp(nll_sum / words)``: words are whitespace-separated
  words plus one end-of-line per line (245,569 for the word-level WikiText-2
  test split), the normalization of word-level papers (AWD-LSTM, GPT-2);
- ``bits_per_byte = nll_sum / (bytes * ln 2)``: over the UTF-8 bytes of the
  text scored; independent of any tokenizer.

The protocol (``eval.mode`` = blocks / sliding / documents, ``eval.context``,
``eval.stride``) decides which context each token is scored with
(``lm_eval``, the harness's wikitext task on raw pages, is :func:`evaluate_lm_eval`); see
:mod:`seqjax.eval.windows`, which also states the first-token rule
(each unit's opening ``<|endoftext|>`` is context only). Every protocol scores
every predicted token once, so ``tokens`` is the same in all three.

On instruction data (``data.format`` other than text) only the scored tokens
count (the answers, ``data.loss_on``): ``tokens`` is their number, the
perplexity is per scored token, bits per byte are over the UTF-8 bytes of the
scored text, and word perplexity is null.

Contract 3: per-batch sums come back from the device in float32 and are
accumulated on the host in float64; perplexity is exp(total / count), never
an average of per-batch perplexities. Training's periodic validation calls
:func:`evaluate`, so a number logged during training and one printed here
mean the same thing.
"""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from seqjax.config.tree import Config, ConfigError, ModelConfig
from seqjax.core.progress import progress_bar
from seqjax.data.contract import Batch
from seqjax.eval.lm_eval import MODE as LM_EVAL
from seqjax.eval.lm_eval import LmEvalDocs
from seqjax.eval.windows import EvalWindows, eval_windows
from seqjax.model import sharding
from seqjax.model.attention import resolve_backend
from seqjax.model.loss import token_nll
from seqjax.store.reader import TokenStore


def batch_bytes(cfg: ModelConfig, rows: int, context: int) -> int:
    """A lower bound on what one evaluation batch needs on a device: the float32 logits ``[rows,
    context, vocab]`` and, on the XLA attention path (which materializes them), one layer's float32
    scores ``[rows, heads, context, context]``."""
    logits = rows * context * cfg.vocab_size * 4
    dense = resolve_backend(cfg.attention, jnp.dtype(cfg.compute_dtype),
                            windows=cfg.has_windows) == "xla"
    return logits + (rows * cfg.n_heads * context * context * 4 if dense else 0)


def device_bytes() -> int | None:
    """Memory of one device: an accelerator's limit, or the host's RAM for the CPU; None when
    unknown."""
    # (a device of this process: the others have none)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if jax.default_backend() == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_fits(cfg: ModelConfig, rows: int, context: int) -> None:
    """Refuse, before any batch is built, an evaluation whose one batch cannot fit the device (one
    line)."""
    need, have = batch_bytes(cfg, rows, context), device_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"eval.context={context} with {rows} rows per device (eval.batch_size) needs at least {need / 1e9:,.1f} "
            f"GB for one batch (float32 logits over {cfg.vocab_size:,} tokens and attention scores of "
            f"{context:,}^2 per head), more than this device's {have / 1e9:,.1f} GB; lower eval.context or "
            "eval.batch_size")


def windows_for(store: TokenStore, config: Config) -> EvalWindows:
    """The evaluation windows ``config.eval`` asks for (``eval.context`` defaults to
    ``data.seq_len``)."""
    return eval_windows(
        store,
        config.eval.mode,
        config.eval_context,
        config.eval.stride,
        cross_document_attention=config.data.cross_document_attention,
        pack=config.eval.pack,
    )


@functools.partial(jax.jit, static_argnums=0)
def _score(graphdef: nnx.GraphDef, state: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """The batch's summed nll (nats, float32) and each slot's weighted nll ([B, T]; 0 where not
    scored): contract 3's terms, which ``lm_loss`` sums. The sum is taken here, so a batch sharded
    over processes reads as one number; the slots are fetched only for per-document figures."""
    model = nnx.merge(graphdef, state)
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    nll = token_nll(logits, batch["targets"], batch["weights"])
    return jnp.sum(nll), nll


class _Placement:
    """Where batches go: one device, or rows split over the mesh's ``data x fsdp`` axes.

    Every process builds the same global batch (the windows are a pure
    function of the store and config), so each device's rows are cut from it.
    Without a mesh and with several devices, the model is replicated over the
    mesh ``config.mesh`` describes.
    """

    def __init__(self, mesh: Mesh | None, config: Config):
        self.replicate_model = mesh is None and jax.device_count() > 1
        if self.replicate_model:
            mesh = sharding.build_mesh(config.mesh)
        self.mesh = mesh
        self.shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES) if mesh is not None else 1

    def batch_size(self, requested: int) -> int:
        """``requested`` rounded up to a multiple of the batch shards."""
        return -(-requested // self.shards) * self.shards

    def state(self, state: nnx.State) -> nnx.State:
        if not self.replicate_model:
            return state
        return sharding.place(state, jax.tree.map(lambda _: sharding.replicated(self.mesh), state))

    def put(self, batch: Batch) -> Batch:
        if self.mesh is None:
            return jax.device_put(batch)
        rows = sharding.batch_sharding(self.mesh)
        return sharding.place(batch, {k: rows for k in batch})


def _per(count: float | None, nll_sum: float, scale: float = 1.0) -> float | None:
    return None if not count else nll_sum / (count * scale)


@dataclass
class _Sums:
    """What scoring adds up: the nll (nats), the weight (the number of targets unless weights are
    fractional), the targets scored, and, when asked, each document's nll, weight and targets
    (``documents``, [n_docs, 3])."""

    nll: float = 0.0
    weight: float = 0.0
    tokens: int = 0
    documents: np.ndarray | None = None

    def add(self, scores: tuple[jax.Array, jax.Array], weights: np.ndarray, targets: np.ndarray | None,
            doc_offsets: np.ndarray) -> None:
        total, nll = scores
        scored = weights != 0
        self.nll += float(total)  # (waits for this batch's scores)
        self.weight += float(weights.sum(dtype=np.float64))
        self.tokens += int(scored.sum())
        # document d predicts stream positions doc_offsets[d] .. doc_offsets[d+1]-1
        if self.documents is not None:
            # rows on other processes' devices: every process needs them all
            if not nll.is_fully_addressable:
                nll = multihost_utils.process_allgather(nll, tiled=True)
            nll = np.asarray(nll, np.float64)
            doc = np.searchsorted(doc_offsets, targets[scored], "right") - 1
            n = len(self.documents)
            for column, values in enumerate((nll[scored], weights[scored].astype(np.float64), None)):
                self.documents[:, column] += np.bincount(doc, values, minlength=n)


def _score_windows(model: nnx.Module, windows: EvalWindows, config: Config, mesh: Mesh | None,
                   max_batches: int | None, progress: bool,
                   per_document: bool = False) -> tuple[_Sums, int, int, float]:
    """(the sums over ``windows`` under ``model``, rows scored, batches in all, seconds)."""
    placement = _Placement(mesh, config)
    batch_size = placement.batch_size(config.eval.batch_size)
    if hasattr(model, "cfg"):  # (a seqjax model: its shape says what a batch needs)
        check_fits(model.cfg, batch_size // placement.shards, windows.context)
    total = windows.num_batches(batch_size)
    n_batches = total if max_batches is None else min(max_batches, total)
    graphdef, state = nnx.split(model)
    state = placement.state(state)
    sums = _Sums(documents=np.zeros((windows.store.num_docs, 3)) if per_document else None)
    doc_offsets = np.asarray(windows.store.doc_offsets, np.int64) if per_document else None
    start = time.perf_counter()
    bar = progress_bar(total=n_batches, desc=f"eval {windows.mode}", unit="batch", enabled=progress)
    # the previous batch's scores: read after the next batch is dispatched (host and device overlap)
    pending = None
    with bar:
        for k, batch in zip(range(n_batches), windows.batches(batch_size)):
            scores = _score(graphdef, state, placement.put(batch))
            if pending is not None:
                sums.add(*pending)
            targets = None
            if per_document:
                rows = np.arange(k * batch_size, min((k + 1) * batch_size, windows.num_rows))
                targets = np.full(batch["weights"].shape, -1, np.int64)
                targets[: len(rows)] = windows.target_positions(rows)
            pending = (scores, batch["weights"], targets, doc_offsets)
            bar.update()
        if pending is not None:
            sums.add(*pending)
    return sums, n_batches * batch_size, total, time.perf_counter() - start


def evaluate(model: nnx.Module, store: TokenStore, config: Config, *, mesh: Mesh | None = None,
             max_batches: int | None = None, split: str | None = None, word_count: int | None = None,
             byte_count: int | None = None, progress: bool = True, per_document: bool = False) -> dict[str, Any]:
    """Score ``store`` with ``model`` under ``config.eval``; returns the figures as a JSON-ready
    dict.

    ``loss`` is the mean nll per scored token, or, under ``eval.loss_normalization=examples``, the
    mean of each document's mean. ``per_document`` adds each scored document's figures
    (``per_document``: index in the store, targets, weight, nll, mean), the rows ``python -m
    seqjax.eval --per-example FILE.jsonl`` writes.

    ``word_count`` / ``byte_count`` count the split's text; they default to
    the counts ``prepare`` wrote in the store's manifest (``stats``), the
    numbers its summary prints. With ``max_batches`` only a prefix of the
    windows is scored (training's quick validation): ``complete`` is then
    false and the word and byte figures, which need the whole split, are null.
    ``eval.mode=lm_eval`` reads raw text, not a store: see :func:`evaluate_lm_eval`.
    """
    if config.eval.mode == LM_EVAL:
        raise ConfigError(
            "eval.mode: got 'lm_eval', which scores raw WikiText-2 pages with python -m seqjax.eval, "
            "not a token store; expected blocks, sliding or documents here")
    windows = windows_for(store, config)
    by_example = config.eval.loss_normalization == "examples"
    sums, rows, total_batches, seconds = _score_windows(model, windows, config, mesh, max_batches, progress,
                                                        per_document=per_document or by_example)
    nll_sum, tokens, weight = sums.nll, sums.tokens, sums.weight
    complete = rows >= windows.num_rows
    if complete and tokens != store.scored_tokens:
        raise RuntimeError(
            f"scored {tokens} tokens, expected every scored token ({store.scored_tokens}) once")
    stats = store.manifest.get("stats", {})
    # instruction data: per scored token, and bits per byte of the scored text
    if store.mask is not None:
        # (a weighted nll has no per-byte reading)
        fractional = np.dtype(store.mask.dtype) != np.uint8
        stats = {"words": None, "bytes": None if fractional else stats.get("scored_bytes")}
    words = (word_count if word_count is not None else stats.get("words")) if complete else None
    n_bytes = (byte_count if byte_count is not None else stats.get("bytes")) if complete else None
    per_word = _per(words, nll_sum)
    per_byte = _per(n_bytes, nll_sum, math.log(2))
    return {
        "split": split or store.manifest.get("split") or config.eval.split,
        "mode": windows.mode,
        "context": windows.context,
        "stride": windows.stride,
        "cross_document_attention": windows.cross_document_attention,
        "complete": complete,
        "windows": windows.windows_in(rows),
        "loss_normalization": config.eval.loss_normalization,
        "loss": (_mean_of_means(sums.documents) if by_example else nll_sum / weight) if weight else None,
        "tokens": tokens,
        "words": words,
        "bytes": n_bytes,
        "nll_sum": nll_sum,
        "token_perplexity": math.exp(nll_sum / weight) if weight else None,
        "word_perplexity": None if per_word is None else math.exp(per_word),
        "bits_per_byte": per_byte,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
        **({"per_document": _per_document(sums.documents)} if per_document else {}),
    }


def _mean_of_means(documents: np.ndarray) -> float:
    """The mean over scored documents of each one's mean nll (train.loss_normalization=examples'
    weighting)."""
    scored = documents[:, 1] > 0
    return float(np.mean(documents[scored, 0] / documents[scored, 1]))


def _per_document(documents: np.ndarray) -> list[dict[str, Any]]:
    """One row per scored document (example) of the store, in store order: its index, targets, nll
    and mean."""
    return [{"document": int(d), "tokens": int(documents[d, 2]), "weight": float(documents[d, 1]),
             "nll": float(documents[d, 0]), "loss": float(documents[d, 0] / documents[d, 1])}
            for d in np.nonzero(documents[:, 1] > 0)[0]]


def evaluate_lm_eval(model: nnx.Module, docs: LmEvalDocs, config: Config, *, split: str,
                     mesh: Mesh | None = None, progress: bool = True) -> dict[str, Any]:
    """The lm-evaluation-harness ``wikitext`` figures of ``docs`` (:mod:`seqjax.eval.lm_eval`), by
    its definitions.

    word_perplexity = exp(nll / words), byte_perplexity = exp(nll / bytes) and
    bits_per_byte = nll / (bytes ln 2), with words and bytes counted on the
    original pages; token_perplexity is seqjax's, over the tokens scored.
    """
    sums, _, _, seconds = _score_windows(model, docs.windows, config, mesh, None, progress)
    nll_sum, tokens = sums.nll, sums.tokens
    if tokens != docs.tokens:
        raise RuntimeError(
            f"scored {tokens} tokens, expected every token of every page ({docs.tokens}) once")
    return {
        "split": split,
        "mode": LM_EVAL,
        "context": docs.windows.context,
        "documents": len(docs.pages),
        "windows": len(docs.windows),
        "tokens": tokens,
        "words": docs.words,
        "bytes": docs.bytes,
        "nll_sum": nll_sum,
        "token_perplexity": math.exp(nll_sum / tokens) if tokens else None,
        "word_perplexity": math.exp(nll_sum / docs.words),
        "byte_perplexity": math.exp(nll_sum / docs.bytes),
        "bits_per_byte": nll_sum / (docs.bytes * math.log(2)),
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
    }
