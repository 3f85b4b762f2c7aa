"""The table of sequence strategies (``data.strategy``): what each one cuts, and the properties the
pipeline relies on.

The other modules ask this table rather than test strategy names: no module
but this one compares ``data.strategy`` or ``data.packer`` with a name.

==============  ==========================  =========  =========  ====  ==========================
strategy        rows come from              per epoch  shuffles   pads  store must hold
==============  ==========================  =========  =========  ====  ==========================
window          windows every ``stride``    no         yes        no    one full row
random_offset   chunks after a random       yes        yes        yes   a token to predict
                offset
sequential      ``batch_size`` streams      yes        no         no    a row per stream
random_window   windows drawn per step      yes        no         no    one full row
concat_chunk    HF group_texts blocks       no         yes        no    one full row
block           fairseq token blocks        no         yes        yes   a token to predict
pack            documents, packed           (plan)     yes        yes   documents within overlong
length_grouped  one document per row        (plan)     yes        yes   documents within overlong
==============  ==========================  =========  =========  ====  ==========================

"per epoch": the spans change every epoch (a new offset or draw), so they are
recomputed; otherwise they are computed once and only their order changes.
"shuffles": ``data.shuffle`` permutes the rows; sequential and random_window
keep their own order (continuity, or draws that are already random).
"pads": a row may hold fewer than ``seq_len`` predictions; the strategies that
never pad give full rows only (tests/test_pipeline.py checks it). "documents
within overlong": under ``data.overlong=error`` no document may be longer than
a row.

``pack`` takes a packer (``data.packer``), the second table here:

====================  ==============================  ===========  ====================
packer                places each document            keeps whole  runs in
====================  ==============================  ===========  ====================
greedy                next-fit, in order              yes          the row plan
first_fit             first open row it fits          yes          the row plan
best_fit              the row it leaves fullest       yes          the row plan
best_fit_decreasing   best-fit, longest first         yes          the row plan
fill                  concatenated, cut every row     no           the row plan
grain_first_fit       Grain's FirstFitPack            yes          Grain's iterator
grain_best_fit        Grain's BestFitPack             yes          Grain's iterator
grain_concat_split    Grain's ConcatThenSplit         no           Grain's iterator
====================  ==============================  ===========  ====================

Every rule that relates a strategy or a packer to another key is a property of
these rows, checked by :func:`check_config` right after a command loads its
config (``seqjax.main.cli.load``) and again by the pipeline: only the strategies
that keep documents whole take instruction data; ``data.overlong`` applies where
rows are whole documents; a packer that cuts documents cannot cap segments; a
mixture needs a strategy whose rows can be moved between sources and a packer
that runs in the row plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from seqjax.config.tree import Config, ConfigError, DataConfig
from seqjax.core.errors import DataError, StoreError
from seqjax.data import document_rows, grain_packing, sequences
from seqjax.store.reader import TokenStore


@dataclass(frozen=True)
class Rows:
    """An epoch of a stream strategy as arithmetic: ``count`` rows, and ``spans(lo, hi)`` the spans
    of rows lo..hi-1.

    Rows are computed a window at a time, so planning never holds a whole
    epoch's spans (see :mod:`seqjax.data.plan`).
    """

    count: int
    spans: Callable[[int, int], tuple[np.ndarray, np.ndarray]]


# (store, data config, run.seed, epoch, the epoch's rng) -> the epoch's rows
RowsFn = Callable[[TokenStore, DataConfig, int, int, np.random.Generator], Rows]
# (store, data config, first document, end document) -> (starts, lengths) of that window of
# documents
WindowSpansFn = Callable[[TokenStore, DataConfig, int, int], tuple[np.ndarray, np.ndarray]]
# (item starts, item lengths, config) -> the items arranged into rows (documents kept whole)
DocumentRowsFn = Callable[[np.ndarray, np.ndarray, Config], document_rows.Arranged]


@dataclass(frozen=True)
class Strategy:
    """One ``data.strategy``: how it cuts the store and what the pipeline may assume about its
    rows."""

    rows: RowsFn | None  # stream strategies whose rows are arithmetic: planned in windows of rows
    # block: spans of a window of documents; both None: rows are whole documents
    window_spans: WindowSpansFn | None
    per_epoch: bool  # the spans differ every epoch, so they are recomputed
    shuffles: bool  # data.shuffle permutes the rows
    pads: bool  # a row may hold fewer than seq_len predictions
    needs_full_row: bool  # the store must hold one row of seq_len + 1 tokens
    # False: random_window draws with replacement; an "epoch" is only a number of steps
    has_epochs: bool = True
    # what else the store must hold
    check_store: Callable[[TokenStore, DataConfig], None] | None = None
    # pack, length_grouped: whole documents (items) arranged into rows
    document_rows: DocumentRowsFn | None = None
    # The arranged rows are shuffled again: packing puts like documents together; a grouped order is
    # the point.
    reshuffle_rows: bool = False
    # batches padded to these widths, not all to seq_len
    bucket_widths: Callable[[Config], np.ndarray] | None = None
    # False: its rows continue one another (sequential), so a mixture cannot move them
    mixable: bool = True
    # Every document lands in one segment of one row (never cut at a row's end): what instruction
    # data needs.
    keeps_whole: Callable[[DataConfig], bool] = lambda d: False
    # what it does where data.overlong is refused
    cuts_overlong: str = "cuts a document longer than a row itself"
    # data.packer chooses how its documents are packed (the PACKERS table)
    takes_packer: bool = False

    @property
    def documents(self) -> bool:
        """Rows are whole documents (pack, length_grouped): ``data.overlong`` says what becomes of a
        longer one."""
        return self.document_rows is not None


@dataclass(frozen=True)
class Packer:
    """One ``data.packer`` of ``pack``: its function, and what the other keys may ask of it."""

    # seqjax's: (starts, lengths, capacity, max_segments, open_rows) -> CSR rows
    rows: Callable | None
    grain: grain_packing.GrainPacker | None = None  # Grain's: its own iterator, not a row plan
    # cuts documents at a row's end to fill every row: no segment cap, no instruction data
    splits: bool = False
    what: str = ""  # how a message names it

    @property
    def keeps_whole(self) -> bool:
        return not self.splits


PACKERS: dict[str, Packer] = {
    "greedy": Packer(document_rows.greedy_rows),
    "first_fit": Packer(document_rows.first_fit_rows),
    "best_fit": Packer(document_rows.best_fit_rows),
    "best_fit_decreasing": Packer(document_rows.best_fit_decreasing_rows),
    "fill": Packer(document_rows.fill_rows, splits=True, what="fills every row"),
    "grain_first_fit": Packer(None, grain=grain_packing.first_fit_bins),
    "grain_best_fit": Packer(None, grain=grain_packing.best_fit_bins),
    "grain_concat_split": Packer(None, grain=grain_packing.concat_then_split, splits=True,
                                 what="is Grain's concat-then-split, which"),
}


def _packed_rows(starts: np.ndarray, lengths: np.ndarray, config: Config) -> document_rows.Arranged:
    """``pack``: the items, in the order given, packed by ``data.packer``'s row of
    :data:`PACKERS`."""
    d = config.data
    return document_rows.Arranged(
        *PACKERS[d.packer].rows(starts, lengths, d.seq_len, d.max_segments_per_row, d.pack_buffer))


def random_window_steps(store: TokenStore, d: DataConfig) -> int:
    """random_window has no epochs; one 'epoch' is as many steps as read the stream's tokens
    once."""
    return max(1, (store.num_tokens - 1) // (d.batch_size * d.seq_len))


def _full(starts: np.ndarray, d: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    return starts, np.full(len(starts), d.seq_len + 1, np.int64)


def _window(store, d, seed, epoch, rng) -> Rows:
    """Every full window whose start is a multiple of the stride: row r starts at r * stride."""
    stride, last = d.resolved_stride, store.num_tokens - d.seq_len
    return Rows(max(0, -(-last // stride)),
                lambda lo, hi: _full(np.arange(lo, hi, dtype=np.int64) * stride, d))


def _random_offset(store, d, seed, epoch, rng) -> Rows:
    """sequences.chunk_spans after this epoch's offset: row r starts at offset + r * seq_len."""
    n = store.num_tokens
    offset = int(rng.integers(min(d.seq_len, n - 1)))  # leave a token to predict

    def spans(lo, hi):
        starts = offset + np.arange(lo, hi, dtype=np.int64) * d.seq_len
        return starts, np.minimum(d.seq_len + 1, n - starts)

    return Rows(len(range(offset, n - 1, d.seq_len)), spans)


def _sequential(store, d, seed, epoch, rng) -> Rows:
    """d2l sequential partitioning: row r is stream r % batch_size, its (r // batch_size)-th piece.

    After a random offset, the stream's inputs are cut into ``batch_size`` equal parts of ``S``
    tokens; batch ``k`` row ``b`` reads inputs ``offset + b*S + k*seq_len`` onward, so each row
    continues its row of the batch before.
    """
    offset = int(rng.integers(d.seq_len))
    stream = (store.num_tokens - offset - 1) // d.batch_size

    def spans(lo, hi):
        k, b = np.divmod(np.arange(lo, hi, dtype=np.int64), d.batch_size)
        return _full(offset + b * stream + k * d.seq_len, d)

    return Rows(stream // d.seq_len * d.batch_size, spans)


def _random_window(store, d, seed, epoch, rng) -> Rows:
    """sequences.random_window_spans: the draws of step s come from (seed, s), whatever window
    asks."""
    steps, b = random_window_steps(store, d), d.batch_size

    def spans(lo, hi):
        first = epoch * steps + lo // b
        starts, _ = sequences.random_window_spans(store.num_tokens, d.seq_len, b, seed,
                                                  range(first, epoch * steps + -(-hi // b)))
        return _full(starts[lo % b : lo % b + hi - lo], d)

    return Rows(steps * b, spans)


def _concat_chunk(store, d, seed, epoch, rng) -> Rows:
    """HF run_clm's group_texts, row for row: blocks of seq_len + 1 tokens, each map batch's
    remainder dropped.

    The examples are the stream cut at each document's opening EOT; group_texts concatenates each
    batch of ``HF_MAP_BATCH`` examples and cuts it into blocks. Row r is found in its map batch by
    the running row count.
    """
    block = d.seq_len + 1
    group_starts = np.asarray(store.doc_offsets[:-1][:: sequences.HF_MAP_BATCH], np.int64) - 1
    group_ends = np.append(group_starts[1:], store.num_tokens)
    per_group = (group_ends - group_starts) // block
    ends = np.cumsum(per_group)

    def spans(lo, hi):
        r = np.arange(lo, hi, dtype=np.int64)
        g = np.searchsorted(ends, r, "right")
        return _full(group_starts[g] + (r - (ends[g] - per_group[g])) * block, d)

    return Rows(int(ends[-1]) if len(ends) else 0, spans)


def _block(store, d, first, end):
    """sequences.block_spans on the documents first..end-1 (a window never crosses into the
    next)."""
    # the window's opening, closing EOT
    lo, hi = int(store.doc_offsets[first]) - 1, int(store.doc_offsets[end]) - 1
    if d.break_mode == "none":
        starts, lengths = sequences.chunk_spans(hi - lo + 1, d.seq_len)
        return starts + lo, lengths
    lines = np.asarray(store.line_offsets)
    a, b = np.searchsorted(lines, [lo + 1, hi + 1])
    return sequences.block_spans(lines[a:b + 1], np.asarray(store.doc_offsets[first:end + 1]),
                                 hi + 1, d.seq_len, d.break_mode)


def _streams_fit(store: TokenStore, d: DataConfig) -> None:
    """sequential: each of the batch_size streams holds a row even after the largest random offset
    (seq_len - 1)."""
    if (store.num_tokens - d.seq_len) // d.batch_size < d.seq_len:
        raise DataError(
            f"data.batch_size={d.batch_size} is larger than one epoch of data: data.strategy=sequential needs "
            f"{d.batch_size} streams of at least data.seq_len={d.seq_len} tokens after a random offset, "
            f"the store holds {store.num_tokens} tokens")


STRATEGIES: dict[str, Strategy] = {
    "window": Strategy(_window, None, per_epoch=False, shuffles=True, pads=False,
                       needs_full_row=True),
    "random_offset": Strategy(_random_offset, None, per_epoch=True, shuffles=True, pads=True,
                              needs_full_row=False),
    "sequential": Strategy(_sequential, None, per_epoch=True, shuffles=False, pads=False,
                           needs_full_row=False, check_store=_streams_fit, mixable=False),
    "random_window": Strategy(_random_window, None, per_epoch=True, shuffles=False, pads=False,
                              needs_full_row=True, has_epochs=False),
    "concat_chunk": Strategy(_concat_chunk, None, per_epoch=False, shuffles=True, pads=False,
                             needs_full_row=True),
    "block": Strategy(
        None, _block, per_epoch=False, shuffles=True, pads=True, needs_full_row=False,
        keeps_whole=lambda d: d.break_mode == "complete_doc",
        cuts_overlong="cuts a document longer than a row itself into blocks, as fairseq does"),
    "pack": Strategy(None, None, per_epoch=True, shuffles=True, pads=True, needs_full_row=False,
                     document_rows=_packed_rows, reshuffle_rows=True, takes_packer=True,
                     keeps_whole=lambda d: PACKERS[d.packer].keeps_whole),
    "length_grouped": Strategy(None, None, per_epoch=True, shuffles=True, pads=True,
                               needs_full_row=False, document_rows=document_rows.grouped_rows,
                               bucket_widths=document_rows.bucket_lengths,
                               keeps_whole=lambda d: True),
}


def keeps_documents_whole(d: DataConfig) -> bool:
    """Whether every document (an instruction example) lands in one segment of one row, never cut at
    a row's end.

    Only such strategies take instruction data. (``data.overlong=split`` still cuts an example
    longer than a row, on purpose, into pieces that are each their own segment.)
    """
    return STRATEGIES[d.strategy].keeps_whole(d)


def packer(d: DataConfig) -> Packer | None:
    """``data.packer``'s row when the strategy packs, else None."""
    return PACKERS[d.packer] if STRATEGIES[d.strategy].takes_packer else None


def check_config(config: Config) -> None:
    """The rules that tie ``data.strategy`` and ``data.packer`` to the other keys, as the tables
    state them; one :class:`ConfigError` naming the key, the value and what is allowed. Every
    command runs it after loading."""
    d = config.data
    strategy, packing = STRATEGIES[d.strategy], packer(d)
    if d.sources and packing is not None and packing.grain is not None:
        raise ConfigError(
            f"data.packer: got {d.packer!r}, expected a seqjax packer with data.sources: Grain's packers "
            "run their own iterator, which a mixture cannot draw rows from")
    if d.sources and not strategy.mixable:
        raise ConfigError(
            f"data.strategy: got {d.strategy!r}, expected another strategy with data.sources: "
            f"{d.strategy}'s rows continue each other from batch to batch, and a mixture moves rows "
            "between sources")
    if d.overlong not in (None, "split") and not strategy.documents:
        whole = " and ".join(name for name, row in STRATEGIES.items() if row.documents)
        raise ConfigError(
            f"data.overlong: got {d.overlong!r} with data.strategy={d.strategy}, expected split (the "
            f"default): only {whole} apply it; {d.strategy} {strategy.cuts_overlong}")
    if packing is not None and packing.splits and d.max_segments_per_row is not None:
        raise ConfigError(
            f"data.max_segments_per_row: got {d.max_segments_per_row}, expected null: packer "
            f"{d.packer} {packing.what} cannot cap segments; unset it or pick another packer")
    if d.format == "preference" and (not strategy.documents or (packing is not None and packing.rows is None)):
        raise ConfigError(
            f"data.strategy: got {label(d)}, expected pack (with a seqjax packer: greedy, first_fit, best_fit, "
            "best_fit_decreasing) or length_grouped for data.format=preference, which packs each pair whole "
            "(its two sequences in one row)")
    if d.image_processor is not None and (d.strategy != "pack" or d.packer != "best_fit"):
        raise ConfigError(f"data.strategy: got {label(d)} with images, expected pack with packer best_fit, which "
                          "images extend to two budgets: a row's tokens and its patches (seqjax.data.image_rows)")
    instruction = {source.format for source in d.resolved_sources()} != {"text"}
    if instruction and not keeps_documents_whole(d):
        how = {"pack": f" with packer={d.packer!r}", "block": f" with break_mode={d.break_mode!r}"}
        splitting = " or ".join(name for name, row in PACKERS.items() if row.splits)
        raise ConfigError(
            f"data.strategy: got {d.strategy!r}{how.get(d.strategy, '')}, expected pack (any packer but "
            f"{splitting}), length_grouped or block with data.break_mode=complete_doc for instruction "
            "data: the others cut examples at arbitrary tokens")


def batch_widths(config: Config) -> np.ndarray:
    """The padded widths a batch of this strategy may have: its buckets, or ``seq_len`` alone."""
    widths = STRATEGIES[config.data.strategy].bucket_widths
    return widths(config) if widths is not None else np.asarray([config.data.seq_len])


def item_overlong(d: DataConfig) -> str:
    """The overlong policy applied to documents before they are arranged into rows.

    A packer that cuts documents at each row's end (``fill``) splits overlong documents itself
    (across rows), so they reach it whole.
    """
    packing = packer(d)
    overlong = d.resolved_overlong
    return "keep" if packing is not None and packing.rows is not None and packing.splits and overlong == "split" \
        else overlong


def uses_grain_packer(d: DataConfig) -> bool:
    """``pack`` with one of Grain's packers: Grain's own iterator, not a row plan
    (seqjax.data.grain_packing)."""
    packing = packer(d)
    return packing is not None and packing.grain is not None


def grain_packed(config: Config, store: TokenStore, **kwargs):
    """This process's batches from the Grain packer ``data.packer`` names
    (:func:`grain_packing.grain_packed`)."""
    return grain_packing.grain_packed(config, store, PACKERS[config.data.packer].grain, **kwargs)


def label(d: DataConfig) -> str:
    """The strategy as reports name it: ``window``, ``pack/best_fit``, ..."""
    return f"{d.strategy}/{d.packer}" if packer(d) is not None else d.strategy


def check(config: Config, store: TokenStore, process_count: int = 1) -> None:
    """What the store must hold for the configured strategy, checked before any work (the config
    checked itself).

    A message names the key, the value and what would fit, e.g. ``data.strategy=window:
    the token store holds 5 tokens, fewer than one row needs (data.seq_len + 1 = 9)``.
    """
    d = config.data
    if store.num_docs < 1 or store.predicted_tokens < 1:
        raise DataError("the token store is empty: it holds no tokens to predict")
    vocab = config.model.vocab_size or store.vocab_size
    if store.max_id >= vocab:
        where = f"token store {store.path}" if store.path else "the token store"
        raise StoreError(
            f"{where} holds token id {store.max_id}, outside the vocabulary of {vocab} "
            f"({'model.vocab_size' if config.model.vocab_size else 'its tokenizer'}): the model would read past its "
            "embedding. Rebuild the store with the model's tokenizer (python -m seqjax.prepare) or fix model.vocab_size"
        )
    if d.batch_size % process_count:
        raise ConfigError(
            f"data.batch_size: got {d.batch_size}, expected a multiple of the process count {process_count}"
        )
    strategy = STRATEGIES[d.strategy]
    if strategy.documents:
        document_rows.check_overlong(store.doc_predictions, d.seq_len, d.resolved_overlong)
    if strategy.needs_full_row:
        sequences.check_fits(store.num_tokens, d.seq_len, d.strategy)
    if strategy.check_store is not None:
        strategy.check_store(store, d)
