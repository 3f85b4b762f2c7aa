"""Preference pairs in rows: each pair packed whole, its two sequences side by side in one row.

A preference store (``data.format=preference``, :mod:`seqjax.store.pairs`) holds pair ``k`` as
examples ``2k`` (prompt + chosen) and ``2k + 1`` (prompt + rejected), both starting with the
prompt's ``n`` ids. A packer sees each pair as one item; a row then holds, per pair::

    one pair per sequence         [ p0 .. p(n-1) c0 .. ] [ p0 .. p(n-1) r0 .. ]
    data.shared_prompt=true       [ p0 .. p(n-2) ] [ p(n-1) c0 .. ] [ p(n-1) r0 .. ]

With a shared prompt the prompt is one segment (its first n - 1 ids, every prediction inside the
prompt), and each completion is a segment that starts at the prompt's last id (it predicts the
completion's first token, a different target for each), at position n - 1, and attends to the
prompt's segment (its ``prefix_ids``) but not to the other completion. Every completion token
then sees exactly what it sees in its own sequence, at the same positions: the same numbers, the
prompt computed once (``n - 1`` predictions fewer per pair).

The batch carries ``pair_ids``: ``2p - 1`` on pair ``p``'s chosen sequence, ``2p`` on its
rejected one (pairs numbered 1, 2, ... in each row), 0 on a shared prompt and padding; the
preference objectives sum log-probabilities of the scored targets by it. ``prefix_ids``: the
segment id of the prompt a completion also attends to (0: none), with a shared prompt only.
``pair_index``: 1 + the pair's number in the store (what a precomputed reference is looked up by).

Too long a pair (``data.overlong``): ``truncate`` cuts each sequence to its first ``seq_len // 2``
ids and drops a pair whose prompt alone reaches that, as TRL 1.16 does with ``max_length`` =
``seq_len // 2`` (both halves then fit a row); ``drop`` drops a pair with a sequence longer than
that; ``error`` refuses it.
"""

from __future__ import annotations

import numpy as np

from seqjax.core.errors import DataError
from seqjax.data.ragged import exclusive_cumsum, ragged_arange
from seqjax.store.reader import TokenStore


def prompt_lengths(store: TokenStore) -> np.ndarray:
    """Each pair's prompt length ``n``: where its chosen sequence's first scored target is."""
    starts, _ = store.doc_spans()
    chosen = np.asarray(starts[0::2], np.int64)
    scored = np.flatnonzero(np.asarray(store.mask) > 0)
    return scored[np.searchsorted(scored, chosen)] - chosen


def pair_sequences(store: TokenStore, pairs: np.ndarray, seq_len: int, overlong: str
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(pairs kept, chosen length, rejected length, prompt length)`` of ``pairs`` after
    ``data.overlong`` (lengths in ids, cut to ``seq_len // 2`` under truncate)."""
    _, lengths = store.doc_spans()
    limit = seq_len // 2
    n = prompt_lengths(store)[pairs]
    chosen, rejected = lengths[2 * pairs], lengths[2 * pairs + 1]
    long = (chosen > limit) | (rejected > limit)
    if overlong == "error" and long.any():
        k = int(pairs[np.flatnonzero(long)[0]])
        raise DataError(
            f"data.overlong=error: pair {k} has a sequence of {max(chosen[long][0], rejected[long][0])} "
            f"ids, more than data.seq_len // 2 = {limit} (each half of a packed pair)")
    keep = ~long if overlong == "drop" else n < limit
    return (pairs[keep], np.minimum(chosen[keep], limit), np.minimum(rejected[keep], limit), n[keep])


def pair_predictions(chosen: np.ndarray, rejected: np.ndarray, n: np.ndarray,
                     shared: bool) -> np.ndarray:
    """Predictions a pair takes in a row: both sequences', or the prompt's once when shared."""
    return chosen + rejected - 2 - (np.where(n >= 2, n - 1, 0) if shared else 0)


def pair_pieces(store: TokenStore, pairs: np.ndarray, chosen: np.ndarray, rejected: np.ndarray,
                n: np.ndarray, shared: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, lengths, count per pair)``: the stream pieces of each pair, in order."""
    starts, _ = store.doc_spans()
    cs, rs = starts[2 * pairs], starts[2 * pairs + 1]
    if not shared:
        pieces = np.stack([cs, chosen, rs, rejected], axis=1).reshape(-1, 2)
        return pieces[:, 0], pieces[:, 1], np.full(len(pairs), 2, np.int64)
    prefix = n >= 2  # (a one-id prompt has nothing to share: its completions start at it)
    tail = np.where(prefix, n - 1, 0)
    table = np.stack([cs, n, cs + tail, chosen - tail, rs + tail, rejected - tail],
                     axis=1).reshape(-1, 3, 2)
    keep = np.ones((len(pairs), 3), bool)
    keep[:, 0] = prefix
    table = table[keep]
    return table[:, 0], table[:, 1], keep.sum(axis=1)


def expand(row_ptr: np.ndarray, proxies: np.ndarray, pieces_start: np.ndarray,
           pieces_length: np.ndarray,
           per_pair: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A packer's rows of pairs (``proxies``: each row's pair numbers, ``row_ptr`` their rows) as
    rows of the pairs' pieces: ``(starts, lengths, row_ptr)``."""
    first = exclusive_cumsum(per_pair)
    owner, j = ragged_arange(per_pair[proxies])
    piece = first[proxies][owner] + j
    rows = np.repeat(np.arange(len(row_ptr) - 1), np.diff(row_ptr))
    counts = np.bincount(rows, weights=per_pair[proxies], minlength=len(row_ptr) - 1).astype(np.int64)
    return pieces_start[piece], pieces_length[piece], exclusive_cumsum(counts)


def piece_labels(store: TokenStore, starts: np.ndarray, lengths: np.ndarray, row_of_piece: np.ndarray,
                 shared: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(position offsets, {"pair_ids": ..., "pair_index": ..., "prefix_ids": ...})`` of the pieces
    of some rows, in row order (the contract's ``offsets`` and ``piece_fields``), read off where
    each piece starts; ``prefix_ids`` only with a shared prompt."""
    doc_starts, _ = store.doc_spans()
    doc = np.searchsorted(doc_starts, starts, "right") - 1
    offset = starts - doc_starts[doc]
    chosen = doc % 2 == 0
    n = prompt_lengths(store)[doc // 2]
    is_prefix = shared & chosen & (offset == 0) & (lengths == n) & (n >= 2)
    first_of_row = np.searchsorted(row_of_piece, row_of_piece, "left")
    segment = np.arange(len(starts)) - first_of_row + 1
    opens = chosen & ~is_prefix
    # pair p of its row: how many chosen sequences its row has up to here
    before = np.cumsum(opens) - np.cumsum(opens)[first_of_row] + opens[first_of_row]
    pair_ids = np.where(is_prefix, 0, 2 * before - chosen)
    prefix = np.where(~is_prefix & (offset > 0), segment - np.where(chosen, 1, 2), 0)
    fields = {"pair_ids": pair_ids.astype(np.int32),
              "pair_index": np.where(is_prefix, 0, doc // 2 + 1).astype(np.int32)}
    if shared:  # (without a shared prompt, no prefix_ids: the kernels, which refuse them, stay open)
        fields["prefix_ids"] = prefix.astype(np.int32)
    return offset, fields


def check_pairs(store: TokenStore) -> None:
    """A preference store holds whole pairs (an even number of examples, both of a pair opening with
    the same prompt)."""
    if store.mask is None or store.num_docs % 2:
        raise DataError(
            f"token store {store.path}: expected preference pairs (two examples each, with a "
            f"scored mask), got {store.num_docs} documents; rebuild it with data.format=preference")


def overlong_pairs(store: TokenStore, seq_len: int, overlong: str) -> dict:
    """What ``data.overlong`` does to the pairs (the train log's line, summary.json's
    ``overlong``)."""
    every = np.arange(store.num_docs // 2)
    _, lengths = store.doc_spans()
    limit = seq_len // 2
    long = (lengths[0::2] > limit) | (lengths[1::2] > limit)
    kept = pair_sequences(store, every, seq_len, "drop" if overlong == "error" else overlong)[0]
    prompt_long = prompt_lengths(store) >= limit
    return {"policy": overlong, "pairs": int(len(every)), "limit": limit, "seq_len": seq_len,
            "longer_than_a_row": int(long.sum()), "dropped": int(len(every) - len(kept)),
            "prompt_too_long": int(prompt_long.sum()), "truncated": int((long & ~prompt_long).sum())
            if overlong == "truncate" else 0}


def add_to_table(logps: np.ndarray, batch: dict[str, np.ndarray], values: np.ndarray) -> None:
    """Add a batch's per-target values to its pairs' rows of the table (chosen: column 0)."""
    scored = (batch["weights"] > 0) & (batch["pair_index"] > 0)
    pair, ids = batch["pair_index"][scored] - 1, batch["pair_ids"][scored]
    np.add.at(logps, (pair, 1 - ids % 2), values[scored])


def slot_pairs(batch: dict[str, np.ndarray]) -> np.ndarray:
    """[B, T // 2]: the store's number of the pair in each row's pair slot (the preference objectives' per-pair
    columns, :func:`seqjax.objectives.preference.pair_sums`), -1 where a slot holds none.

    >>> slot_pairs({"pair_ids": np.array([[1, 1, 2, 2, 3, 4]]), "pair_index": np.array([[5, 5, 5, 5, 2, 2]])})
    array([[ 4,  1, -1]])
    """
    pair_ids, index = np.asarray(batch["pair_ids"]), np.asarray(batch["pair_index"])
    out = np.full((pair_ids.shape[0], pair_ids.shape[1] // 2), -1, np.int64)
    row, t = np.nonzero((pair_ids > 0) & (index > 0))
    out[row, (pair_ids[row, t] - 1) // 2] = index[row, t] - 1
    return out


def with_reference(batch: dict[str, np.ndarray], logps: np.ndarray) -> dict[str, np.ndarray]:
    """``batch`` and its ``reference_logps`` field: each sequence's value on its last scored target.

    >>> batch = {"weights": np.array([[0, 1, 1, 0, 1, 0]], np.float32),
    ...          "pair_ids": np.array([[1, 1, 1, 2, 2, 0]]), "pair_index": np.array([[4, 4, 4, 4, 4, 0]])}
    >>> with_reference(batch, np.array([[0, 0], [0, 0], [0, 0], [-3.5, -7.0]]))["reference_logps"].tolist()
    [[0.0, 0.0, -3.5, 0.0, -7.0, 0.0]]
    """
    weights, pair_ids, pair_index = batch["weights"], batch["pair_ids"], batch["pair_index"]
    flat = np.flatnonzero(((weights > 0) & (pair_index > 0)).reshape(-1))
    out = np.zeros(weights.size, np.float32)
    if len(flat):
        row = flat // weights.shape[1]
        key = row.astype(np.int64) * (2 * weights.shape[1] + 2) + pair_ids.reshape(-1)[flat]
        last = flat[np.r_[key[1:] != key[:-1], True]]
        out[last] = logps[pair_index.reshape(-1)[last] - 1, 1 - pair_ids.reshape(-1)[last] % 2]
    return {**batch, "reference_logps": out.reshape(weights.shape)}
