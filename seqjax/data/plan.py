"""The plan of an epoch, a window at a time: which stream pieces fill which row, a pure function of
``(seed, epoch)``.

An epoch is cut into *windows* of about ``data.plan_window_tokens`` tokens, and
only the window being read is planned, so planning memory follows the window,
not the corpus (a billion tokens plan like sixteen million). The shuffle has
two levels: the windows' order, from ``(seed, epoch)``, then the rows inside a
window, from ``(seed, epoch, window)``.

- **Stream strategies** (window, random_offset, sequential, random_window,
  concat_chunk) have arithmetic rows (:class:`seqjax.data.strategies.Rows`):
  the epoch's rows are exactly those of a whole-epoch plan, and a window is a
  range of ``C`` of them, ``C`` a multiple of ``data.batch_size``. Only the
  last window may be partial, and it is always served last, so only the
  epoch's last batch can hold empty rows, as before. random_offset still
  draws one offset per epoch, so every token after it is predicted exactly
  once per epoch.
- **Document strategies** (pack, length_grouped) and **block** plan each
  window of whole documents as they would plan a store of only those
  documents: documents are shuffled and packed (or grouped, or cut into
  blocks) inside their window. Each document is still used exactly once per
  epoch; a window's last batch is completed with empty rows.

A store that fits one window (WikiText-2's 3M tokens, at the default) is
planned in one piece: its epoch is one window, shuffled as one.

Which kind a strategy is, its rows function, and whether it shuffles come from
the table in :mod:`seqjax.data.strategies`.

Row plans (:class:`RowPlan`): an epoch as integer arrays, so batch ``k`` is random access and
statistics need no token read.

Every strategy describes an epoch as a :class:`RowPlan`: for each row, the
*pieces* that fill it, each a contiguous slice of the token stream. A piece of
``m`` tokens is one sequence: it gives ``m - 1`` inputs and targets under its
own segment id, so no target ever crosses a segment boundary (docs/design.md,
contract 1). :func:`seqjax.data.contract.contract_batch` turns the pieces of
any set of rows into the batch arrays.

Why plans and not generators: a plan is a few integer arrays computed once per
epoch from ``(seed, epoch)``, so batch ``k`` is random access (exact resume
from a step number), shards are index arithmetic (process ``p`` reads a
contiguous slice of every global batch), and statistics (padding, coverage)
are computed without reading a token.

A worked example: rows ``[piece 0 | piece 1]`` and ``[piece 2]`` are
``starts=[10, 20, 40]``, ``lengths=[5, 4, 9]``, ``row_ptr=[0, 2, 3]``; with
``seq_len=8`` row 0 holds 4 + 3 = 7 predictions (one slot of padding) and row 1 holds 8.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from seqjax.config.tree import Config
from seqjax.core.errors import DataError
from seqjax.data import document_rows, image_rows, pairs
from seqjax.data.ragged import exclusive_cumsum, ragged_arange
from seqjax.data.scored import scored_in
from seqjax.data.strategies import STRATEGIES, Rows, item_overlong
from seqjax.store.image_chats import read_image_spec
from seqjax.store.reader import TokenStore


@dataclass
class RowPlan:
    """The rows of one epoch, in the order they are served.

    ``starts[j]`` / ``lengths[j]``: stream index and token count of piece ``j``
    (``lengths >= 2``); the pieces of row ``r`` are ``row_ptr[r]:row_ptr[r + 1]``,
    in order. ``widths``: the padded length of each global batch (all
    ``seq_len`` except for length-grouped batches). Rows past the last real row
    of the last batch are empty (all padding), so no row of the epoch is lost.
    """

    starts: np.ndarray
    lengths: np.ndarray
    row_ptr: np.ndarray
    batch_size: int
    widths: np.ndarray

    @classmethod
    def from_rows(cls, starts, lengths, row_ptr, batch_size: int, width: int | np.ndarray) -> "RowPlan":
        row_ptr = np.asarray(row_ptr, np.int64)
        n_batches = -(-(len(row_ptr) - 1) // batch_size)
        widths = np.broadcast_to(np.asarray(width, np.int64), (n_batches,)).copy()
        return cls(np.asarray(starts, np.int64), np.asarray(lengths, np.int64), row_ptr, batch_size,
                   widths)

    @classmethod
    def from_spans(cls, starts, lengths, batch_size: int, width: int) -> "RowPlan":
        """One piece per row."""
        return cls.from_rows(starts, lengths, np.arange(len(starts) + 1), batch_size, width)

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def num_batches(self) -> int:
        return len(self.widths)

    @property
    def segments_per_row(self) -> np.ndarray:
        return np.diff(self.row_ptr)

    def take(self, rows: np.ndarray) -> "RowPlan":
        """The rows ``rows`` in that order; ``-1`` makes an empty (all padding) row."""
        starts, lengths, row_of_piece = self.pieces(rows)
        counts = np.bincount(row_of_piece, minlength=len(rows))
        width = int(self.widths[0]) if len(self.widths) else 0
        return RowPlan.from_rows(starts, lengths, exclusive_cumsum(counts), self.batch_size, width)

    def split_at(self, boundaries: np.ndarray, parents: bool = False):
        """Split every piece at the stream positions in ``boundaries`` (sorted) that fall strictly
        inside it.

        Used with the EOT positions (``doc_offsets - 1``) to give each document
        its own segment: the EOT ends one piece (as the last target) and opens
        the next (as the first input), so the row keeps every input/target pair
        and only segment ids and positions change.
        """
        last = self.starts + self.lengths - 1
        lo = np.searchsorted(boundaries, self.starts, "right")
        hi = np.searchsorted(boundaries, last, "left")
        cuts = np.maximum(hi - lo, 0)
        owner, j = ragged_arange(cuts + 1)
        first = boundaries[np.clip(lo[owner] + j - 1, 0, len(boundaries) - 1)]
        end = boundaries[np.clip(lo[owner] + j, 0, len(boundaries) - 1)]
        starts = np.where(j == 0, self.starts[owner], first)
        ends = np.where(j == cuts[owner], last[owner], end)
        row_ptr = exclusive_cumsum(cuts + 1)[self.row_ptr]
        plan = RowPlan(starts, ends - starts + 1, row_ptr, self.batch_size, self.widths)
        return (plan, owner) if parents else plan  # (parents: the piece each new one was cut from)

    def clip(self, span_starts: np.ndarray, span_lengths: np.ndarray, parents: bool = False):
        """Every piece cut to the spans it overlaps (sorted, disjoint), the rest of it dropped, and
        parts that predict nothing (one token) dropped too.

        Used with an instruction store's example spans (``store.doc_spans``): each example gets its
        own segment holding exactly its ids, and the separators between examples belong to none.
        """
        span_ends = span_starts + span_lengths
        ends = self.starts + self.lengths
        first = np.searchsorted(span_ends, self.starts, "right")
        count = np.maximum(np.searchsorted(span_starts, ends, "left") - first, 0)
        owner, j = ragged_arange(count)
        span = first[owner] + j
        starts = np.maximum(self.starts[owner], span_starts[span])
        lengths = np.minimum(ends[owner], span_ends[span]) - starts
        keep = lengths >= 2
        kept = np.bincount(owner[keep], minlength=len(self.starts))
        row_ptr = exclusive_cumsum(kept)[self.row_ptr]
        plan = RowPlan(starts[keep], lengths[keep], row_ptr, self.batch_size, self.widths)
        return (plan, owner[keep]) if parents else plan

    def batch_rows(self, batches: np.ndarray, process_index: int = 0,
                   process_count: int = 1) -> np.ndarray:
        """Rows of global batches ``batches`` that process ``process_index`` reads: a contiguous
        slice of each."""
        local = self.batch_size // process_count
        first = np.asarray(batches, np.int64)[:, None] * self.batch_size + process_index * local
        return (first + np.arange(local)).reshape(-1)

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, lengths, row_of_piece)`` of rows ``rows``; a row ``-1`` or past the end is
        empty."""
        rows = np.asarray(rows, np.int64)
        valid = (rows >= 0) & (rows < self.num_rows)
        safe = np.where(valid, rows, 0)
        counts = np.where(valid, self.row_ptr[safe + 1] - self.row_ptr[safe], 0)
        owner, j = ragged_arange(counts)
        piece = self.row_ptr[safe][owner] + j
        return self.starts[piece], self.lengths[piece], owner


def per_document(plan: RowPlan, store: TokenStore, parents: bool = False):
    """``plan``'s pieces cut so that each document is its own segment: a text store's at its EOTs
    (each EOT ends one document as its last target and opens the next as its first input), an
    instruction store's to each example's ids exactly (:meth:`TokenStore.doc_spans`). With
    ``parents``, also the index of the piece each new one was cut from."""
    if store.mask is None or not (store.examples or any(s.examples for s in store.source_stores)):
        return plan.split_at(np.asarray(store.doc_offsets, np.int64) - 1, parents)
    return plan.clip(*store.doc_spans(), parents)


def coverage(plan: RowPlan, n_tokens: int) -> np.ndarray:
    """How many times each stream position is a target in this plan (a difference array, O(n))."""
    diff = np.zeros(n_tokens + 1, np.int64)
    np.add.at(diff, plan.starts + 1, 1)
    np.add.at(diff, plan.starts + plan.lengths, -1)
    return np.cumsum(diff[:-1])


class EpochPlanner:
    """Plans of epochs for one (config, store), a window at a time; every plan is a pure function of
    its arguments.

    ``windows(e)`` is the serving order of epoch ``e``'s windows,
    ``window_plan(e, w)`` the rows of window ``w`` (in serving order), and
    ``plan(e)`` the whole epoch joined (for reports and tests; it holds the
    epoch in memory). For example, with 10 full windows of 4 batches each,
    batch 13 of an epoch is batch 1 of the fourth window served.
    """

    def __init__(self, config: Config, store: TokenStore):
        self.config = config
        self.data = config.data
        self.strategy = STRATEGIES[config.data.strategy]
        self.store = store
        self.seed = config.run.seed
        d = self.data
        if self.strategy.rows is not None:
            per_window = -(-d.plan_window_tokens // (d.seq_len * d.batch_size))
            self.window_rows = max(1, per_window) * d.batch_size
        else:
            # windows of whole documents, cut where the stream passes each multiple of
            # plan_window_tokens
            cuts = np.searchsorted(
                store.doc_offsets,
                np.arange(1, store.num_tokens // d.plan_window_tokens + 1) * d.plan_window_tokens)
            if d.format == "preference":  # a window holds whole pairs (examples 2k and 2k + 1)
                pairs.check_pairs(store)
                cuts -= cuts % 2
            self.doc_bounds = np.unique(np.concatenate([[0], cuts[(cuts > 0) & (cuts < store.num_docs)],
                                                        [store.num_docs]]))
        self._plans: dict[tuple[int, int], RowPlan] = {}
        self._epochs: dict[int, tuple[Rows | None, np.ndarray]] = {}
        self.image_spec = None  # chats with images: the processor's settings, and each example's patches
        if store.images is not None:
            self.image_spec = read_image_spec(d.image_processor)
            if self.image_spec is None:
                raise DataError("the token store holds images; expected data.image_processor set as it was built")
            self.patch_counts = store.images.patch_counts(self.image_spec.patch_size)

    def rng(self, epoch: int, window: int | None = None) -> np.random.Generator:
        key = [self.seed, epoch] if window is None else [self.seed, epoch, window]
        return np.random.default_rng(key)

    @functools.cached_property
    def _static_rows(self) -> Rows:
        return self.strategy.rows(self.store, self.data, self.seed, 0, self.rng(0))

    def _epoch(self, epoch: int) -> tuple[Rows | None, np.ndarray]:
        """The epoch's rows (stream strategies) and its windows' serving order, both from ``(seed,
        epoch)``."""
        if epoch not in self._epochs:
            # an iterator and a resume
            self._epochs = {e: v for e, v in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = self._new_epoch(epoch)
        return self._epochs[epoch]

    def _new_epoch(self, epoch: int) -> tuple[Rows | None, np.ndarray]:
        rng = self.rng(epoch)
        rows = None
        if self.strategy.rows is not None:
            rows = self.strategy.rows(self.store, self.data, self.seed, epoch, rng) if self.strategy.per_epoch \
                else self._static_rows
            full, partial = divmod(rows.count, self.window_rows)
            order = np.arange(full)
            if self.data.shuffle and self.strategy.shuffles:
                order = rng.permutation(full)
            return rows, np.append(order, [full] if partial else []).astype(np.int64)
        count = len(self.doc_bounds) - 1
        shuffle = self.data.shuffle and self.strategy.shuffles
        return None, rng.permutation(count) if shuffle else np.arange(count)

    def windows(self, epoch: int) -> np.ndarray:
        """The ids of epoch ``epoch``'s windows in the order they are served."""
        return self._epoch(epoch)[1]

    def window_plan(self, epoch: int, position: int) -> RowPlan:
        """The rows of the window served at ``position`` in epoch ``epoch``; the current and
        previous are kept."""
        key = (epoch, position)
        if key not in self._plans:
            self._plans = {k: p for k, p in self._plans.items() if k == max(self._plans, default=key)}
            self._plans[key] = self._window_plan(epoch, position)
        return self._plans[key]

    def window_batches(self, epoch: int, position: int) -> int:
        """Global batches in that window; arithmetic for stream strategies, planned for the
        others."""
        rows, order = self._epoch(epoch)
        if rows is not None:
            w = int(order[position])
            return -(-(min((w + 1) * self.window_rows, rows.count) - w * self.window_rows) //
                     self.data.batch_size)
        return self.window_plan(epoch, position).num_batches

    def plan(self, epoch: int) -> RowPlan:
        """The whole epoch, its windows joined in serving order (each window's rows padded to whole
        batches)."""
        plans = [self.window_plan(epoch, i) for i in range(len(self.windows(epoch)))]
        return join(plans, self.data.batch_size) if plans else self._empty()

    def _empty(self) -> RowPlan:
        return RowPlan.from_rows([], [], [0], self.data.batch_size, self.data.seq_len)

    def _window_plan(self, epoch: int, position: int) -> RowPlan:
        rows, order = self._epoch(epoch)
        w = int(order[position])
        rng = self.rng(epoch, w)
        if rows is not None:
            return self._span_rows(
                rows.spans(w * self.window_rows, min((w + 1) * self.window_rows, rows.count)), rng)
        first, end = int(self.doc_bounds[w]), int(self.doc_bounds[w + 1])
        if self.strategy.window_spans is not None:
            return self._span_rows(self.strategy.window_spans(self.store, self.data, first, end), rng)
        return self._document_rows(first, end, rng)

    def _span_rows(self, spans: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> RowPlan:
        """One span per row, shuffled where the strategy allows, one segment per document piece
        unless asked not to."""
        d = self.data
        starts, lengths = spans
        plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len)
        if d.shuffle and self.strategy.shuffles:
            plan = plan.take(rng.permutation(plan.num_rows))
        if not d.cross_document_attention and len(starts):
            if self.store.mask is not None:  # instruction examples: each one's ids exactly
                return per_document(plan, self.store)
            # the EOTs (segment boundaries) inside this window's stretch of the stream, not the
            # whole store's
            offsets = self.store.doc_offsets
            lo, hi = np.searchsorted(offsets, [starts.min(), (starts + lengths).max()])
            plan = plan.split_at(np.asarray(offsets[max(lo - 1, 0) : hi + 1], np.int64) - 1)
        return plan

    def _document_rows(self, first: int, end: int, rng: np.random.Generator) -> RowPlan:
        """Documents first..end-1 in (shuffled) order after data.overlong, arranged by the
        strategy's table entry."""
        d = self.data
        if d.format == "preference":
            return self._pair_rows(first // 2, end // 2, rng)
        count = end - first
        order = first + (rng.permutation(count) if d.shuffle else np.arange(count))
        starts, lengths = document_rows.document_items(self.store.doc_spans(), order, d.seq_len,
                                                       item_overlong(d), scored_in(self.store))
        if self.image_spec is not None:
            return self._image_rows(starts, lengths, rng)
        strategy = STRATEGIES[d.strategy]
        arranged = strategy.document_rows(starts, lengths, self.config)
        widths = arranged.widths if arranged.widths is not None else d.seq_len
        plan = RowPlan.from_rows(arranged.starts, arranged.lengths, arranged.row_ptr, d.batch_size,
                                 widths)
        return plan.take(rng.permutation(
            plan.num_rows)) if d.shuffle and strategy.reshuffle_rows else plan

    def _image_rows(self, starts: np.ndarray, lengths: np.ndarray, rng: np.random.Generator) -> RowPlan:
        """Examples with images (``starts``, ``lengths``: in order, after data.overlong) into rows of both
        budgets: data.seq_len tokens and data.patches_per_row patches (:mod:`seqjax.data.image_rows`)."""
        d = self.data
        docs = self.store.documents_at(starts)
        patches = self.patch_counts[docs]
        over = np.flatnonzero(patches > d.patches_per_row)
        if len(over):
            raise DataError(f"example {int(docs[over[0]])}: its images take {int(patches[over[0]])} patches, more "
                            f"than data.patches_per_row={d.patches_per_row}; expected a budget that holds the "
                            "largest example's")
        # each row a bin; as many rows open as 64 batches have (scripts/bench_vision.py: fewer
        # starve the fit)
        row, _ = image_rows.pack_two_budgets(lengths - 1, patches, 1, d.seq_len, d.patches_per_row,
                                             open_batches=64 * d.batch_size, max_segments=d.max_segments_per_row)
        plan = RowPlan.from_rows(*document_rows.rows_from_assignment(starts, lengths, row), d.batch_size, d.seq_len)
        return plan.take(rng.permutation(plan.num_rows)) if d.shuffle else plan

    def _pair_rows(self, first: int, end: int, rng: np.random.Generator) -> RowPlan:
        """Pairs first..end-1 in (shuffled) order after data.overlong, each packed whole as one item
        of the strategy's (:mod:`seqjax.data.pairs`)."""
        d = self.data
        order = first + (rng.permutation(end - first) if d.shuffle else np.arange(end - first))
        kept, chosen, rejected, n = pairs.pair_sequences(self.store, order, d.seq_len,
                                                         d.resolved_overlong)
        predictions = pairs.pair_predictions(chosen, rejected, n, d.shared_prompt)
        strategy = STRATEGIES[d.strategy]
        config = self.config
        # (it counts segments: a pair is two, three with a shared prompt)
        if d.max_segments_per_row is not None:
            per_pair = max(1, d.max_segments_per_row // (3 if d.shared_prompt else 2))
            config = dataclasses.replace(config,
                                         data=dataclasses.replace(d, max_segments_per_row=per_pair))
        arranged = strategy.document_rows(np.arange(len(kept)), predictions + 1, config)
        starts, lengths, per_pair = pairs.pair_pieces(self.store, kept, chosen, rejected, n,
                                                      d.shared_prompt)
        starts, lengths, row_ptr = pairs.expand(arranged.row_ptr, arranged.starts, starts, lengths,
                                                per_pair)
        widths = arranged.widths if arranged.widths is not None else d.seq_len
        plan = RowPlan.from_rows(starts, lengths, row_ptr, d.batch_size, widths)
        return plan.take(rng.permutation(
            plan.num_rows)) if d.shuffle and strategy.reshuffle_rows else plan

    def check_rows(self, whole_batch: bool = True) -> None:
        """Refuse a strategy that gives no row, or (``whole_batch``) an epoch smaller than a batch,
        before any work.

        A mixture's source only needs rows: the batch draws them from every source.
        """
        d = self.data
        rows, order = self._epoch(0)
        if rows is not None:
            count = rows.count
        elif len(order) == 1:
            count = self.window_plan(0, 0).num_rows
        else:  # many windows: a corpus this large holds a batch; the first window must give rows
            count = max(self.window_plan(0, 0).num_rows, d.batch_size)
        if count == 0:
            dropped = d.resolved_overlong == "drop" and self.strategy.documents
            why = " (data.overlong=drop dropped every document)" if dropped else ""
            raise DataError(
                f"data.strategy={d.strategy}: the store gives no rows at data.seq_len={d.seq_len}{why}"
            )
        if whole_batch and count < d.batch_size and self.strategy.has_epochs:
            raise DataError(
                f"data.batch_size={d.batch_size} is larger than one epoch of data: data.strategy={d.strategy} gives "
                f"{count} rows of data.seq_len={d.seq_len} "
                f"from {self.store.num_tokens} tokens in {self.store.num_docs} documents")


def join(plans: list[RowPlan], batch_size: int) -> RowPlan:
    """Plans one after another, each padded with empty rows to whole batches (as the iterator serves
    them)."""
    starts, lengths, counts, widths = [], [], [], []
    for plan in plans:
        starts.append(plan.starts)
        lengths.append(plan.lengths)
        padded = plan.num_batches * batch_size
        counts.append(
            np.concatenate([plan.segments_per_row,
                            np.zeros(padded - plan.num_rows, np.int64)]))
        widths.append(plan.widths)
    row_ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))])
    joined = RowPlan(np.concatenate(starts), np.concatenate(lengths), row_ptr.astype(np.int64),
                     batch_size,
                     np.concatenate(widths).astype(np.int64))
    last = plans[-1]
    # the epoch's last rows stay past the end, as a one-window plan has them
    if last.num_rows % batch_size:
        keep = len(row_ptr) - 1 - (last.num_batches * batch_size - last.num_rows)
        joined.row_ptr = joined.row_ptr[: keep + 1]
    return joined
