"""The one place that wires a config and a token store into a Grain pipeline of contract batches.

Design, for speed and exact resumption:

- each epoch's rows are planned up front as a :class:`~seqjax.data.batching.RowPlan`,
  a pure function of ``(run.seed, epoch)`` computed with vectorized numpy;
- the epoch is a random-access ``grain.MapDataset`` of *global batch index ->
  this process's slice of that batch*, built by the single contract builder;
- :class:`EpochsIterDataset` chains the epochs; its iterator state is just
  ``{"epoch", "batch"}`` (JSON), so resuming replays nothing and skips nothing.

Grain's own packers (``packer=grain_*``) are the exception: they are Grain
``IterDataset`` transforms over a shuffled, repeated document dataset, and
their state is Grain's own.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import grain
import grain.experimental as gx
import numpy as np

from seqjax.config import Config, ConfigError
from seqjax.data import packing, sequences
from seqjax.data.batching import DataError, RowPlan, contract_batch, coverage, from_grain_packed, length_grouped_order
from seqjax.data.store import TokenStore

SPAN_STRATEGIES = ("window", "random_offset", "sequential", "random_window", "concat_chunk", "block")
GRAIN_PACKERS = ("grain_first_fit", "grain_best_fit", "grain_concat_split")


# ---------------------------------------------------------------------------
# Validation


def check(config: Config, store: TokenStore, process_count: int = 1) -> None:
    """Every bad input this layer can see, raised before any work: a clear message naming the key and value."""
    d = config.data
    if store.num_docs < 1 or store.predicted_tokens < 1:
        raise DataError("the token store is empty: it holds no tokens to predict")
    if d.stride is not None and d.stride < 1:
        raise ConfigError(f"data.stride: got {d.stride}, expected at least 1")
    if d.batch_size % process_count:
        raise ConfigError(f"data.batch_size: got {d.batch_size}, expected a multiple of the process count {process_count}")
    if d.strategy == "pack" and d.packer == "fill" and d.max_segments_per_row is not None:
        raise ConfigError("data.max_segments_per_row: packer fill fills every row and cannot cap segments; unset it or pick another packer")
    if d.strategy == "pack" and d.packer == "grain_concat_split" and d.max_segments_per_row is not None:
        raise ConfigError("data.max_segments_per_row: Grain's concat-then-split cannot cap segments; unset it or pick another packer")
    if d.strategy in ("pack", "length_grouped"):
        packing.check_overlong(store.doc_lengths, d.seq_len, d.overlong)
    elif d.strategy in ("window", "random_window", "concat_chunk"):  # full rows only; the others pad a short tail
        sequences.check_fits(store.num_tokens, d.seq_len, d.strategy)
    # sequential streams must hold one row each even after the largest random offset (seq_len - 1)
    if d.strategy == "sequential" and (store.num_tokens - d.seq_len) // d.batch_size < d.seq_len:
        raise DataError(
            f"data.batch_size={d.batch_size} is larger than one epoch of data: data.strategy=sequential needs "
            f"{d.batch_size} streams of at least data.seq_len={d.seq_len} tokens after a random offset, "
            f"the store holds {store.num_tokens} tokens"
        )


def bucket_lengths(config: Config) -> np.ndarray:
    """length_grouped widths: ``data.bucket_lengths`` or powers of two, always with ``seq_len`` as the last."""
    d = config.data
    chosen = d.bucket_lengths or [1 << k for k in range(1, d.seq_len.bit_length()) if 1 << k < d.seq_len]
    return np.unique(np.asarray([*chosen, d.seq_len], np.int64))


# ---------------------------------------------------------------------------
# Epoch plans


class EpochPlanner:
    """Plans of epochs for one (config, store): ``plan(epoch)`` is a pure function of ``(seed, epoch)``."""

    def __init__(self, config: Config, store: TokenStore):
        self.config = config
        self.data = config.data
        self.store = store
        self.seed = config.run.seed
        self.document_ends = np.asarray(store.doc_offsets, np.int64) - 1  # EOT positions: segment boundaries
        self._plans: dict[int, RowPlan] = {}

    def rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    @functools.cached_property
    def steps_per_epoch(self) -> int:
        """random_window has no epochs; one 'epoch' is as many steps as read the stream's tokens once."""
        d = self.data
        return max(1, (self.store.num_tokens - 1) // (d.batch_size * d.seq_len))

    @functools.cached_property
    def static_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Spans that do not depend on the epoch (only their order does)."""
        d, s = self.data, self.store
        if d.strategy == "window":
            return sequences.window_spans(s.num_tokens, d.seq_len, d.resolved_stride)
        if d.strategy == "concat_chunk":
            return sequences.concat_chunk_spans(s.doc_offsets, s.num_tokens, d.seq_len + 1)
        return sequences.block_spans(s.line_offsets, s.doc_offsets, s.num_tokens, d.seq_len, d.break_mode)

    def spans(self, epoch: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        d, n = self.data, self.store.num_tokens
        if d.strategy == "random_offset":
            return sequences.chunk_spans(n, d.seq_len, int(rng.integers(min(d.seq_len, n - 1))))  # leave a token to predict
        if d.strategy == "sequential":
            return sequences.sequential_spans(n, d.seq_len, d.batch_size, int(rng.integers(d.seq_len)))
        if d.strategy == "random_window":
            steps = range(epoch * self.steps_per_epoch, (epoch + 1) * self.steps_per_epoch)
            return sequences.random_window_spans(n, d.seq_len, d.batch_size, self.seed, steps)
        return self.static_spans

    def plan(self, epoch: int) -> RowPlan:
        """The epoch's plan, kept for the current and the previous epoch (an iterator and a resume may both ask)."""
        if epoch not in self._plans:
            self._plans = {e: p for e, p in self._plans.items() if e == epoch - 1}
            self._plans[epoch] = self._plan(epoch)
        return self._plans[epoch]

    def _plan(self, epoch: int) -> RowPlan:
        d = self.data
        rng = self.rng(epoch)
        if d.strategy in SPAN_STRATEGIES:
            starts, lengths = self.spans(epoch, rng)
            plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len)
            if d.shuffle and d.strategy not in ("sequential", "random_window"):
                plan = plan.take(rng.permutation(plan.num_rows))
            if not d.cross_document_attention:
                plan = plan.split_at(self.document_ends)
        else:
            order = rng.permutation(self.store.num_docs) if d.shuffle else np.arange(self.store.num_docs)
            fill_splits = d.strategy == "pack" and d.packer == "fill" and d.overlong == "split"
            starts, lengths = packing.document_items(self.store.doc_offsets, order, d.seq_len, "keep" if fill_splits else d.overlong)
            if d.strategy == "pack":
                rows = packing.pack(starts, lengths, d.packer, d.seq_len, d.max_segments_per_row, d.pack_buffer)
                plan = RowPlan.from_rows(*rows, d.batch_size, d.seq_len)
                if d.shuffle:
                    plan = plan.take(rng.permutation(plan.num_rows))
            else:
                rows, widths = length_grouped_order(lengths - 1, d.batch_size, d.mega_batch_mult, bucket_lengths(self.config))
                plan = RowPlan.from_spans(starts, lengths, d.batch_size, d.seq_len).take(rows)
                plan.widths = widths
        if plan.num_rows == 0:
            why = " (data.overlong=drop dropped every document)" if d.overlong == "drop" and d.strategy in ("pack", "length_grouped") else ""
            raise DataError(f"data.strategy={d.strategy}: the store gives no rows at data.seq_len={d.seq_len}{why}")
        return plan


# Batches are built this many token slots at a time: numpy's per-call overhead dominates a single batch.
BUILD_SLOTS = 1 << 18


def epoch_dataset(planner: EpochPlanner, epoch: int, process_index: int, process_count: int) -> grain.MapDataset:
    """Random access to this process's batches of one epoch: ``ds[k]`` is its slice of global batch ``k``.

    Consecutive batches are built together (a group of about ``BUILD_SLOTS``
    tokens) and the last group is kept, so sequential reads cost one
    vectorized build per group while any ``k`` can still be read directly.
    """
    plan = planner.plan(epoch)
    tokens = planner.store.tokens
    local = plan.batch_size // process_count
    group = max(1, BUILD_SLOTS // (local * int(plan.widths.max())))
    cache: dict[int, dict[str, np.ndarray]] = {}

    def build(g: int) -> dict[str, np.ndarray]:
        batches = np.arange(g * group, min((g + 1) * group, plan.num_batches))
        rows = plan.batch_rows(batches, process_index, process_count)
        width = int(plan.widths[batches].max())
        return contract_batch(tokens, *plan.pieces(rows), len(rows), width)

    def batch(k: int) -> dict[str, np.ndarray]:
        g, i = divmod(k, group)
        built = cache.get(g)
        if built is None:  # (a race between reader threads only builds a group twice)
            built = build(g)
            cache.clear()
            cache[g] = built
        width = int(plan.widths[k])
        return {key: value[i * local : (i + 1) * local, :width] for key, value in built.items()}

    return grain.MapDataset.range(plan.num_batches).map(batch)


class EpochsIterDataset(grain.IterDataset):
    """Epoch after epoch of a per-epoch ``MapDataset`` factory; state ``{"epoch", "batch"}`` for exact resumption."""

    def __init__(self, make_epoch: Callable[[int], grain.MapDataset]):
        super().__init__()
        self._make_epoch = make_epoch

    def __iter__(self) -> "_EpochsIterator":
        return _EpochsIterator(self._make_epoch)


class _EpochsIterator(grain.DatasetIterator):
    def __init__(self, make_epoch: Callable[[int], grain.MapDataset]):
        super().__init__()
        self._make_epoch = make_epoch
        self._epoch, self._batch = 0, 0
        self._current: tuple[int, grain.MapDataset] | None = None

    def _dataset(self) -> grain.MapDataset:
        if self._current is None or self._current[0] != self._epoch:
            self._current = (self._epoch, self._make_epoch(self._epoch))
        return self._current[1]

    def __next__(self) -> dict[str, np.ndarray]:
        ds = self._dataset()
        while self._batch >= len(ds):
            self._epoch, self._batch = self._epoch + 1, 0
            ds = self._dataset()
        item = ds[self._batch]
        self._batch += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "batch": self._batch}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._batch = int(state["epoch"]), int(state["batch"])


# ---------------------------------------------------------------------------
# Grain's packers, for comparison


def grain_packed(config: Config, store: TokenStore, *, process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None) -> grain.IterDataset:
    """Documents (after the overlong policy) through Grain's FirstFit/BestFit/ConcatThenSplit, as contract rows."""
    d = config.data
    starts, lengths = packing.document_items(store.doc_offsets, np.arange(store.num_docs), d.seq_len, d.overlong)
    tokens = store.tokens

    def sequence(i: int) -> dict[str, np.ndarray]:
        s, m = starts[i], lengths[i]
        return {"inputs": np.asarray(tokens[s : s + m - 1], np.int32), "targets": np.asarray(tokens[s + 1 : s + m], np.int32)}

    ds = grain.MapDataset.range(len(starts))[process_index::process_count]
    if d.shuffle:
        ds = ds.shuffle(seed=config.run.seed)
    # In-memory data: Grain recommends no reader threads (they only contend for the GIL).
    ds = ds.repeat(num_epochs).map(sequence).to_iter_dataset(grain.ReadOptions(num_threads=0))
    length_struct = {"inputs": d.seq_len, "targets": d.seq_len}
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


# ---------------------------------------------------------------------------
# The entry point


def build_pipeline(config: Config, store: TokenStore, *, process_index: int = 0, process_count: int = 1) -> grain.IterDataset:
    """An infinite ``grain.IterDataset`` of this process's batches: dicts of the five contract arrays.

    Local shape ``[data.batch_size // process_count, L]`` (``L = data.seq_len``,
    or a bucket length for ``length_grouped``). Batches are a pure function of
    ``(run.seed, step, process_index, process_count)``; processes read disjoint
    slices of every global batch.
    """
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index: got {process_index}, expected 0 <= index < process_count={process_count}")
    check(config, store, process_count)
    d = config.data
    local = d.batch_size // process_count
    if d.strategy == "pack" and d.packer in GRAIN_PACKERS:
        return grain_packed(config, store, process_index=process_index, process_count=process_count).batch(local, drop_remainder=True)
    planner = EpochPlanner(config, store)
    first = planner.plan(0)
    if first.num_rows < d.batch_size and d.strategy != "random_window":
        raise DataError(
            f"data.batch_size={d.batch_size} is larger than one epoch of data: data.strategy={d.strategy} gives "
            f"{first.num_rows} rows of data.seq_len={d.seq_len} from {store.num_tokens} tokens in {store.num_docs} documents"
        )
    return EpochsIterDataset(functools.partial(epoch_dataset, planner, process_index=process_index, process_count=process_count))


def epoch_stats(config: Config, store: TokenStore, epoch: int = 0) -> dict[str, Any]:
    """What one epoch gives: rows, padding, coverage, segments, and how fast its batches are built (tokens/s)."""
    check(config, store)
    d = config.data
    t0 = time.perf_counter()
    if d.strategy == "pack" and d.packer in GRAIN_PACKERS:
        batches = list(grain_packed(config, store, num_epochs=1).batch(d.batch_size, drop_remainder=False))
        seconds = time.perf_counter() - t0
        segs = np.concatenate([b["segment_ids"].max(axis=1) for b in batches])
        real = int(sum(b["weights"].sum() for b in batches))
        slots = sum(b["weights"].size for b in batches)
        dropped = store.predicted_tokens - real
        counts = {"documents_truncated": None, "documents_split": None}
        rows, n_batches = len(segs), len(batches)
    else:
        planner = EpochPlanner(config, store)
        plan = planner.plan(epoch)
        batches = iter(EpochsIterDataset(functools.partial(epoch_dataset, planner, process_index=0, process_count=1)))
        batches.set_state({"epoch": epoch, "batch": 0})
        for _ in range(plan.num_batches):  # the training path: sequential reads, one build per group
            next(batches)
        seconds = time.perf_counter() - t0
        segs = plan.segments_per_row
        row_width = np.repeat(plan.widths, d.batch_size)[: plan.num_rows]
        slots = int(row_width[segs > 0].sum())  # the empty rows that complete the last batch are not padding of a row
        segs = segs[segs > 0]
        real = int((plan.lengths - 1).sum())
        counts, dropped = document_coverage(plan, store)
        rows, n_batches = int(len(segs)), plan.num_batches
    return {
        "strategy": d.strategy if d.strategy != "pack" else f"pack/{d.packer}",
        "rows": rows,
        "seq_len": d.seq_len,
        "real_tokens": real,
        "padding_fraction": 1.0 - real / slots if slots else 0.0,
        "tokens_dropped": int(dropped),
        **counts,
        "segments_per_row_mean": float(segs.mean()) if len(segs) else 0.0,
        "segments_per_row_max": int(segs.max()) if len(segs) else 0,
        "batches_per_epoch": n_batches,
        "tokens_per_s": real / seconds if seconds > 0 else float("inf"),
    }


def document_coverage(plan: RowPlan, store: TokenStore) -> tuple[dict[str, int], int]:
    """Documents cut across rows or left partly unpredicted, and stream tokens never predicted this epoch."""
    covered = coverage(plan, store.num_tokens)[1:] > 0
    doc_of = np.searchsorted(store.doc_offsets, np.arange(1, store.num_tokens), "right") - 1
    predicted = np.bincount(doc_of, weights=covered, minlength=store.num_docs)
    truncated = int(np.sum((predicted > 0) & (predicted < store.doc_lengths)))
    pieces = plan.split_at(np.asarray(store.doc_offsets) - 1)
    piece_doc = np.searchsorted(store.doc_offsets, pieces.starts + 1, "right") - 1
    piece_row = np.repeat(np.arange(pieces.num_rows), pieces.segments_per_row)
    pairs = np.unique(np.stack([piece_doc, piece_row]), axis=1)
    split = int(np.sum(np.bincount(pairs[0], minlength=store.num_docs) > 1))
    return {"documents_truncated": truncated, "documents_split": split}, int((~covered).sum())
