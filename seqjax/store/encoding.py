"""Documents -> token chunks on every core of a host, handed back in the order the documents were
read.

The reader (one process) cuts the documents into chunks of about
``chunk_chars`` characters; a pool of worker processes encodes them
(:meth:`seqjax.store.tokenizer.Tokenizer.encode_documents`) and counts their
bytes, words and lines; the results come back in submission order, so the
store's stream does not depend on the number of workers or on which finished
first. At most ``2 * workers`` chunks are in flight, so memory stays bounded
whatever the corpus size.

Workers are *spawned*, not forked: prepare may run inside a process that has
already started JAX's threads (training calls it), and forking such a process
can deadlock. Each worker loads the tokenizer once and encodes with one Rust
thread, so the cores are shared by processes, not oversubscribed.

For example, ``encode_in_order(tok, iter([["a b\\n", "c"], ["d"]]), workers=2)``
yields two :class:`EncodedChunk` objects, the first holding documents
``"a b\\n"`` and ``"c"``, whichever worker finished first.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from seqjax.store.corpus import count_lines, count_words
from seqjax.store.examples import ExampleSpec, encode_example, pair_examples
from seqjax.store.pairs import degenerate
from seqjax.store.tokenizer import Tokenizer

# At most this many chunks per worker are queued or being encoded at once.
IN_FLIGHT_PER_WORKER = 2


@dataclass
class EncodedChunk:
    """Some documents as the store holds them (see ``ShardWriter.add_chunk``), and what they
    counted."""

    ids: np.ndarray
    doc_lengths: np.ndarray
    line_lengths: np.ndarray
    bytes: int
    words: int
    lines: int
    # instruction examples: one per stored token (see ShardWriter.add_chunk)
    weights: np.ndarray | None = None
    scored_tokens: int = 0
    scored_bytes: int = 0
    dropped_unscored: int = 0
    # preference: pairs of equal completions, of an empty one, and those left out
    # (data.degenerate_pairs)
    pairs_identical: int = 0
    pairs_empty: int = 0
    pairs_dropped: int = 0
    # chats with images: every example's images in order (uint8 [H, W, 3]), and how many each
    # example has
    images: list[np.ndarray] | None = None
    doc_images: np.ndarray | None = None
    image_files: list[tuple[str, int, int]] | None = None  # the image files they read: (path, bytes, mtime_ns)


def encode_examples(tokenizer: Tokenizer, spec: ExampleSpec,
                    records: list[tuple[str, dict]]) -> EncodedChunk:
    """Records as stored examples: their ids exactly, a weight per stored token (the separator
    after each example weighs 0: it belongs to no example), and what they counted.

    An example with nothing scored (a single token has no target) is dropped and counted.
    """
    ids, lengths, weights, images, doc_images, files = [], [], [], [], [], []
    counts = {"bytes": 0, "scored_tokens": 0, "scored_bytes": 0, "dropped_unscored": 0}
    if spec.format == "preference":
        counts |= {"pairs_identical": 0, "pairs_empty": 0, "pairs_dropped": 0}
    for where, record in records:
        if spec.format == "preference":  # a pair: two examples, prompt + chosen then prompt + rejected
            examples = pair_examples(spec, tokenizer, record, where)  # (each holds half the record's bytes)
            kind = degenerate(spec, record)
            if kind is not None:
                counts[f"pairs_{kind}"] += 1
            counts["pairs_dropped"] += not examples
        else:
            examples = (encode_example(spec, tokenizer, record, where), )
            if examples[0].scored == 0:
                counts["dropped_unscored"] += 1
                continue
        for example in examples:
            ids.append(example.ids)
            weights += [example.mask, np.zeros(1)]
            lengths.append(len(example.ids))
            images += example.images
            doc_images.append(len(example.images))
            files += example.image_files
            counts["bytes"] += example.bytes
            counts["scored_tokens"] += example.scored
            counts["scored_bytes"] += example.scored_bytes
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    doc_lengths = np.asarray(lengths, np.int64)
    return EncodedChunk(
        ids=np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype),
        doc_lengths=doc_lengths, line_lengths=doc_lengths.copy(), words=0, lines=len(lengths),
        weights=np.concatenate(weights).astype(spec.weights_dtype) if weights else np.zeros(
            0, spec.weights_dtype), **counts,
        **({"images": images, "doc_images": np.asarray(doc_images, np.int64), "image_files": files}
           if spec.image_spec is not None else {}))


def encode_chunk(tokenizer: Tokenizer, documents: list[str]) -> EncodedChunk:
    """Encode non-empty documents and count their UTF-8 bytes, words and lines (the summary's
    units)."""
    ids, doc_lengths, line_lengths = tokenizer.encode_documents(documents)
    # what crosses the process boundary
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    return EncodedChunk(
        ids=ids.astype(dtype),
        doc_lengths=doc_lengths,
        line_lengths=line_lengths,
        bytes=sum(len(d.encode("utf-8")) for d in documents),
        words=sum(count_words(d) for d in documents),
        lines=sum(count_lines(d) for d in documents),
    )


def encode_any(tokenizer: Tokenizer, spec: ExampleSpec | None, chunk: list) -> EncodedChunk:
    """A chunk of documents (``spec`` None) or of ``(where, record)`` examples."""
    return encode_chunk(tokenizer, chunk) if spec is None else encode_examples(tokenizer, spec, chunk)


_worker: tuple[Tokenizer, ExampleSpec | None] | None = None


def _start_worker(path: str, eot_token: str, bos_token: str | None, spec: ExampleSpec | None) -> None:
    global _worker
    # Ctrl-C reaches the whole process group: the parent stops the pool and says so in one line; the
    # workers stay quiet rather than each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # one encoding thread per worker process: the pool spreads the cores
    os.environ["RAYON_NUM_THREADS"] = "1"
    _worker = (Tokenizer(path, eot_token, bos_token), spec)


def _encode_in_worker(chunk: list) -> EncodedChunk:
    assert _worker is not None, "the pool initializer loads the tokenizer"
    return encode_any(_worker[0], _worker[1], chunk)


def available_cores() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def encode_in_order(tokenizer: Tokenizer, chunks: Iterable[list], workers: int,
                    spec: ExampleSpec | None = None) -> Iterator[EncodedChunk]:
    """Each chunk of documents (or of examples, under ``spec``) encoded, in the order given, by
    ``workers`` processes (in this one when 1)."""
    if workers <= 1:
        for chunk in chunks:
            yield encode_any(tokenizer, spec, chunk)
        return
    context = multiprocessing.get_context("spawn")
    initargs = (str(tokenizer.path), tokenizer.eot_token, tokenizer.bos_token, spec)
    with context.Pool(workers, initializer=_start_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
