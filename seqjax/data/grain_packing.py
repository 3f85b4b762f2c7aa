"""Grain's own packers (``data.packer=grain_first_fit|grain_best_fit|grain_concat_split``), to
compare with seqjax's.

They are Grain ``IterDataset`` transforms over a shuffled, repeated dataset of
documents, so their batches are not a row plan and their iterator state is
Grain's own. :func:`grain_packed` gives their rows the contract's field names
(:func:`seqjax.data.contract.from_grain_packed`), and they are packed one epoch at a time. Which of
the three runs is the packers' table's choice (:data:`seqjax.data.strategies.PACKERS`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import grain
import grain.experimental as gx
import numpy as np

from seqjax.config.tree import Config
from seqjax.data import document_rows
from seqjax.data.contract import from_grain_packed
from seqjax.data.scored import scored_in, target_weights
from seqjax.store.reader import TokenStore

# (an epoch's dataset of sequences, the fields' lengths, data config, seed) -> that dataset packed
# into rows
GrainPacker = Callable[[grain.IterDataset, dict[str, int], Any, int], grain.IterDataset]


def first_fit_bins(ds: grain.IterDataset, lengths: dict[str, int], d, seed: int) -> grain.IterDataset:
    """``grain_first_fit``: Grain's FirstFitPackIterDataset over ``data.pack_buffer`` bins."""
    return gx.FirstFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=d.pack_buffer,
                                      seed=seed, shuffle_bins=d.shuffle,
                                      max_sequences_per_bin=d.max_segments_per_row)


def best_fit_bins(ds: grain.IterDataset, lengths: dict[str, int], d, seed: int) -> grain.IterDataset:
    """``grain_best_fit``: Grain's BestFitPackIterDataset over ``data.pack_buffer`` bins."""
    return gx.BestFitPackIterDataset(ds, length_struct=lengths, num_packing_bins=d.pack_buffer,
                                     seed=seed, shuffle_bins=d.shuffle,
                                     max_sequences_per_bin=d.max_segments_per_row)


def concat_then_split(ds: grain.IterDataset, lengths: dict[str, int], d,
                      seed: int) -> grain.IterDataset:
    """``grain_concat_split``: Grain's ConcatThenSplitIterDataset (documents cut at each row's
    end)."""
    return gx.ConcatThenSplitIterDataset(ds, length_struct=lengths)


def grain_packed(config: Config, store: TokenStore, pack: GrainPacker, *, process_index: int = 0,
                 process_count: int = 1, num_epochs: int | None = None) -> grain.IterDataset:
    """This process's batches (``data.batch_size // process_count`` rows) from Grain's
    FirstFit/BestFit/ConcatThenSplit.

    Each epoch is packed on its own: the packer sees that epoch's documents (after the overlong
    policy) once, flushes its open bins at the epoch's end, and the epoch's last batch is completed
    with empty rows (segment id 0, weight 0), as seqjax's own planner completes it. Over a repeated
    dataset instead, Grain's packers keep up to ``data.pack_buffer`` bins open across the epoch's
    end and fill them with the next epoch's documents, so an "epoch" held some documents twice and
    others not at all.
    """
    rows = config.data.batch_size // process_count
    return _EpochByEpoch(
        lambda epoch: _packed_epoch(config, store, pack, epoch, process_index, process_count).batch(
            rows, drop_remainder=False).map(functools.partial(_complete, rows=rows)), num_epochs)


def _packed_epoch(config: Config, store: TokenStore, pack: GrainPacker, epoch: int, process_index: int,
                  process_count: int) -> grain.IterDataset:
    """One epoch's documents, in that epoch's shuffled order, through the configured Grain packer,
    as contract rows."""
    d = config.data
    starts, lengths = document_rows.document_items(store.doc_spans(), np.arange(store.num_docs),
                                                   d.seq_len, d.resolved_overlong, scored_in(store))
    tokens = store.tokens
    scores = target_weights(store, config.train.loss_normalization)

    def sequence(i: int) -> dict[str, np.ndarray]:
        s, m = starts[i], lengths[i]
        element = {
            "inputs": np.asarray(tokens[s : s + m - 1], np.int32),
            "targets": np.asarray(tokens[s + 1 : s + m], np.int32),
        }
        if scores is not None:  # instruction data: the packers carry each target's weight along
            element["weights"] = scores[np.arange(s + 1, s + m)]
        return element

    ds = grain.MapDataset.range(len(starts))[process_index::process_count]
    n = len(ds)
    # the epoch's slice of a repeated shuffle: each epoch its own order, from run.seed alone
    if d.shuffle:
        ds = ds.shuffle(seed=config.run.seed).repeat(epoch + 1)[epoch * n : (epoch + 1) * n]
    # In-memory data: Grain recommends no reader threads (they only contend for the GIL).
    ds = ds.map(sequence).to_iter_dataset(grain.ReadOptions(num_threads=0))
    length_struct = {"inputs": d.seq_len, "targets": d.seq_len}
    if scores is not None:
        length_struct["weights"] = d.seq_len
    return pack(ds, length_struct, d, config.run.seed + epoch).map(from_grain_packed)


def _complete(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """An epoch's last, short batch completed with empty rows (all zeros: segment id 0 is padding,
    weight 0)."""
    short = rows - len(batch["inputs"])
    return batch if short == 0 else {k: np.concatenate([v, np.zeros((short, *v.shape[1:]), v.dtype)])
                                     for k, v in batch.items()}


class _EpochByEpoch(grain.IterDataset):
    """``make(epoch)``'s datasets chained, ``num_epochs`` of them (None: forever); the state is the
    epoch and the epoch's own Grain state, kept JSON-safe."""

    def __init__(self, make: Callable[[int], grain.IterDataset], num_epochs: int | None):
        super().__init__()
        self._make, self._num_epochs = make, num_epochs

    def __iter__(self) -> grain.DatasetIterator:
        return _EpochByEpochIterator(self._make, self._num_epochs)


class _EpochByEpochIterator(grain.DatasetIterator):
    def __init__(self, make: Callable[[int], grain.IterDataset], num_epochs: int | None):
        super().__init__()
        self._make, self._num_epochs = make, num_epochs
        self._start(0)

    def _start(self, epoch: int) -> None:
        self._epoch, self._inner = epoch, iter(self._make(epoch))

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if self._num_epochs is not None and self._epoch >= self._num_epochs:
                raise StopIteration
            try:
                return next(self._inner)
            except StopIteration:
                self._start(self._epoch + 1)

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "inner": self._inner.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._start(int(state["epoch"]))
        # Grain's ConcatThenSplit keeps tuples in its state and compares them with ``==``; a JSON
        # checkpoint turns them into lists: restored as tuples, the state survives JSON.
        self._inner.set_state(_tuples(state["inner"]))


def _tuples(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _tuples(v) for k, v in state.items()}
    return tuple(_tuples(v) for v in state) if isinstance(state, (list, tuple)) else state
