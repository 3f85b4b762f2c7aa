"""Documents -> token chunks on every core of a host, handed back in the order the documents were read.

The reader (one process) cuts the documents into chunks of about
``chunk_chars`` characters; a pool of worker processes encodes them
(:meth:`seqjax.data.tokenizer.Tokenizer.encode_documents`) and counts their
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
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from seqjax.data.corpus import count_lines, count_words
from seqjax.data.tokenizer import Tokenizer

# At most this many chunks per worker are queued or being encoded at once.
IN_FLIGHT_PER_WORKER = 2


@dataclass
class EncodedChunk:
    """Some documents as the store holds them (see ``ShardWriter.add_chunk``), and what they counted."""

    ids: np.ndarray
    doc_lengths: np.ndarray
    line_lengths: np.ndarray
    bytes: int
    words: int
    lines: int


def encode_chunk(tokenizer: Tokenizer, documents: list[str]) -> EncodedChunk:
    """Encode non-empty documents and count their UTF-8 bytes, words and lines (the summary's units)."""
    ids, doc_lengths, line_lengths = tokenizer.encode_documents(documents)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32  # what crosses the process boundary
    return EncodedChunk(
        ids=ids.astype(dtype),
        doc_lengths=doc_lengths,
        line_lengths=line_lengths,
        bytes=sum(len(d.encode("utf-8")) for d in documents),
        words=sum(count_words(d) for d in documents),
        lines=sum(count_lines(d) for d in documents),
    )


_worker_tokenizer: Tokenizer | None = None


def _start_worker(path: str, eot_token: str) -> None:
    global _worker_tokenizer
    os.environ["RAYON_NUM_THREADS"] = "1"  # one encoding thread per worker process: the pool spreads the cores
    _worker_tokenizer = Tokenizer(path, eot_token)


def _encode_in_worker(documents: list[str]) -> EncodedChunk:
    assert _worker_tokenizer is not None, "the pool initializer loads the tokenizer"
    return encode_chunk(_worker_tokenizer, documents)


def available_cores() -> int:
    """Cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def encode_in_order(tokenizer: Tokenizer, chunks: Iterable[list[str]], workers: int) -> Iterator[EncodedChunk]:
    """Each chunk of documents encoded, in the order given, by ``workers`` processes (in this one when 1)."""
    if workers <= 1:
        for chunk in chunks:
            yield encode_chunk(tokenizer, chunk)
        return
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(str(tokenizer.path), tokenizer.eot_token)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
