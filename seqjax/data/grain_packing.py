"""Grain's own packers (``data.packer=grain_first_fit|grain_best_fit|grain_concat_split``), to compare with seqjax's.

They are Grain ``IterDataset`` transforms over a shuffled, repeated dataset of
documents, so their batches are not a row plan and their iterator state is
Grain's own. :func:`grain_packed` gives their rows the contract's field names
(:func:`seqjax.data.contract.from_grain_packed`).
"""

from __future__ import annotations

from typing import Any

import grain
import grain.experimental as gx
import numpy as np

from seqjax.config.tree import Config
from seqjax.data import document_rows
from seqjax.data.contract import from_grain_packed
from seqjax.data.scored import target_weights
from seqjax.store.reader import TokenStore


def grain_packed(config: Config, store: TokenStore, *, process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None) -> grain.IterDataset:
    """Documents (after the overlong policy) through Grain's FirstFit/BestFit/ConcatThenSplit, as contract rows."""
    d = config.data
    starts, lengths = document_rows.document_items(store.doc_offsets, np.arange(store.num_docs), d.seq_len, d.overlong)
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
    if d.shuffle:
        ds = ds.shuffle(seed=config.run.seed)
    # In-memory data: Grain recommends no reader threads (they only contend for the GIL).
    ds = ds.repeat(num_epochs).map(sequence).to_iter_dataset(grain.ReadOptions(num_threads=0))
    length_struct = {"inputs": d.seq_len, "targets": d.seq_len}
    if scores is not None:
        length_struct["weights"] = d.seq_len
    if d.packer == "grain_concat_split":
        ds = gx.ConcatThenSplitIterDataset(ds, length_struct=length_struct)
    else:
        packer = gx.FirstFitPackIterDataset if d.packer == "grain_first_fit" else gx.BestFitPackIterDataset
        ds = packer(ds, length_struct=length_struct, num_packing_bins=d.pack_buffer, seed=config.run.seed,
                    shuffle_bins=d.shuffle, max_sequences_per_bin=d.max_segments_per_row)
    return _JsonStateIterDataset(ds.map(from_grain_packed))


def _tuples(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _tuples(v) for k, v in state.items()}
    return tuple(_tuples(v) for v in state) if isinstance(state, (list, tuple)) else state


class _JsonStateIterDataset(grain.IterDataset):
    """Grain's ConcatThenSplit keeps tuples in its state and compares them with ``==``; a JSON
    checkpoint turns them into lists. Restoring them as tuples makes the state survive JSON."""

    def __iter__(self) -> grain.DatasetIterator:
        return _JsonStateIterator(iter(self._parent))


class _JsonStateIterator(grain.DatasetIterator):
    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(_tuples(state))
