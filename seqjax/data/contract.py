"""The batch contract (docs/design.md, contract 1) and the one function that builds it:
:func:`contract_batch`.

Every batch seqjax feeds a model, from every training strategy and every
evaluation protocol, is a dict of five ``[rows, width]`` arrays, built here
from stream *pieces* (see :mod:`seqjax.data.plan`). A piece of ``m`` tokens
``x0 .. x(m-1)`` is one sequence: inputs ``x0 .. x(m-2)``, targets
``x1 .. x(m-1)``, one segment id, positions from 0.

For a stream ``[0, 5, 6, 7, 0, 8, 9]`` and one row of width 6 holding the
pieces ``(start=0, length=4)`` and ``(start=4, length=3)``::

    inputs       0 5 6 | 0 8 | 0
    targets      5 6 7 | 8 9 | 0
    segment_ids  1 1 1 | 2 2 | 0
    positions    0 1 2 | 0 1 | 0
    weights      1 1 1 | 1 1 | 0

Instruction data scores only some targets: ``scores`` (a
:class:`seqjax.data.scored.TargetWeights`) gives the weight of each target by
its stream position, e.g. 0 on a prompt, so the weights above become
``0 0 1 | 0 1 | 0``; no field is added.

Evaluation windows (:mod:`seqjax.eval.windows`) go through the same
builder and then zero the weights of the targets a window is not responsible
for. Grain's own packers emit rows of their own; :func:`from_grain_packed`
only renames their fields to the contract's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypedDict

import numpy as np

from seqjax.core.errors import ConfigError
from seqjax.data.ragged import exclusive_cumsum, positions_from_segments


class Batch(TypedDict):
    """Contract 1 (docs/design.md): five arrays of shape [batch, seq_len], numpy on the host,
    jax.Array on devices.

    Every strategy, evaluation and the train step take and give this one type. Some data (preference
    pairs, images) add optional fields, each listed in :data:`OPTIONAL_FIELDS` with who reads it.
    """

    inputs: Any  # int32: the token ids the model reads
    targets: Any  # int32: the token after inputs[b, t] in the same sequence
    segment_ids: Any  # int32: 1, 2, ... per sequence in the row; 0 on padding
    positions: Any  # int32: position inside its segment, 0 at each segment's first token
    weights: Any  # float32: loss weight of targets[b, t]; 0 on padding and on anything not scored


# ("inputs", "targets", "segment_ids", "positions", "weights")
FIELDS = tuple(Batch.__annotations__)


@dataclass(frozen=True)
class OptionalField:
    """A field a batch may carry beyond the five (docs/design.md, contract 1): its dtype, what it
    holds, what gives it, and who reads it (``model``: the forward pass takes it as a keyword
    argument; else the objectives that name it in their ``reads``). Its leading axis is the batch's
    rows, so micro-batches cut it like the five.

    ``gives(config)``: whether a run of ``config`` has batches that carry it. The data gives most
    fields (``contract_batch`` builds them); ``added_by`` names the part of the loop that adds a
    field to the data's batches instead (a precomputed reference's table, the rollouts of an RL
    run)."""

    dtype: Any
    meaning: str
    given_by: str  # what gives it, as a message names it ("data.format=preference")
    gives: Callable[[Any], bool]  # (the run's config) -> whether its batches carry the field
    model: bool = False
    # an objective must read it: a batch that carries it means something else to one that does not
    needs_reader: bool = False
    added_by: str | None = None  # the loop's part that adds it (None: the data's batches carry it)
    per_row: bool = False  # one value a row ([B, 1]) instead of one a position ([B, T])


def _rollout_field(dtype, meaning: str, needs_reader: bool = False) -> OptionalField:
    """A field the rollouts of an RL run carry (seqjax.data.rollouts builds the batch, the rollouts source adds
    what the model gives)."""
    return OptionalField(dtype, meaning, "data.format=prompt (an RL run's rollouts)",
                         lambda c: c.data.format == "prompt", needs_reader=needs_reader,
                         added_by="the rollouts source (seqjax.train.rollouts)", per_row=meaning.startswith("[B, 1]"))


# The optional fields, by name: the one table of what may enter a batch besides the contract's five.
OPTIONAL_FIELDS: dict[str, OptionalField] = {
    "pair_ids": OptionalField(
        np.int32,
        "preference pairs (seqjax.data.pairs): 2p - 1 on pair p's chosen sequence of the row, 2p on its "
        "rejected one, 0 on a shared prompt and on padding", "data.format=preference",
        lambda c: c.data.format == "preference", needs_reader=True),
    "prefix_ids": OptionalField(
        np.int32,
        "data.shared_prompt, and an RL group's prompt packed once: the segment id of the prompt a completion also "
        "attends to (0: none); the mask's one extension (seqjax.model.mask)",
        "data.shared_prompt=true, or rl.layout=prompt_once",
        lambda c: (c.data.format == "preference" and c.data.shared_prompt)
        or (c.data.format == "prompt" and c.rl.layout == "prompt_once"), model=True),
    "pair_index": OptionalField(
        np.int32,
        "preference pairs: 1 + the pair's number in the store, on both its sequences (0 on a shared prompt "
        "and on padding); what precomputed reference log-probabilities are looked up by",
        "data.format=preference", lambda c: c.data.format == "preference"),
    "reference_logps": OptionalField(
        np.float32,
        "train.precompute_reference: each sequence's reference log-probability, on its last scored target "
        "(0 elsewhere), looked up in the run's table", "train.precompute_reference",
        lambda c: c.data.format == "preference" and c.train.precompute_reference,
        added_by="the train loop (seqjax.train.precompute)"),
    # an RL run's rollouts (seqjax.data.rollouts, docs/rl.md)
    "completion": _rollout_field(np.int32, "1 + the completion's number in its generation batch, on its tokens"),
    "advantages": _rollout_field(np.float32, "the completion's advantage, on its scored targets", needs_reader=True),
    "token_share": _rollout_field(
        np.float32, "[B, 1]: the generation batch's scored completion tokens / (its steps x rows), summing to "
        "DAPO's normalizer over a step's rows"),
    "old_logps": _rollout_field(
        np.float32, "per target: the log-probability under the policy that sampled it (0 where not scored)"),
    "fresh": _rollout_field(
        np.int32, "[B, 1]: 1 where the policy is still the one that sampled the row (its ratio is exactly 1)"),
    "rollout_reference_logps": _rollout_field(
        np.float32, "per target: the reference model's log-probability (rl.beta > 0)"),
    "reference_is_policy": _rollout_field(
        np.int32, "[B, 1]: 1 where the reference's weights were the sampling policy's (on a fresh row the KL is then "
        "exactly 0; rollout_reference_logps holds the sampling policy's for later passes)"),
}

# Images (seqjax.data.image_rows, docs/vision.md): chats with images, read by a vision-language
# model's forward pass. Each row carries its own images in a patch stream of P =
# data.patches_per_row patches.
OPTIONAL_FIELDS.update({
    name: OptionalField(dtype, meaning, "data.image_processor (chats with images)",
                        lambda c: getattr(c.data, "image_processor", None) is not None, model=True)
    for name, dtype, meaning in (
        ("positions_3d", np.int32, "[B, T, 3] each example's (time, row, column) rope index, from 0"),
        ("image_index", np.int32, "[B, T] which of its row's image tokens an image-pad token takes; -1 on text"),
        ("patches", np.float32, "[B, P, patch_dim] each row's images' patches, right-padded"),
        ("patch_segment_ids", np.int32, "[B, P] image 1, 2, ... of the row; 0 on padding"),
        ("patch_rows", np.int32, "[B, P] a patch's row in its image's grid"),
        ("patch_columns", np.int32, "[B, P] a patch's column in its image's grid"),
        ("patch_heights", np.int32, "[B, P] the height of a patch's image, in patches"),
        ("patch_widths", np.int32, "[B, P] the width of a patch's image, in patches"))})


def given_fields(config: Any, data_only: bool = False) -> tuple[str, ...]:
    """The fields batches of a run of ``config`` carry: the five, and the optional ones it gives (``data_only``:
    the data's own, without what the loop adds)."""
    return FIELDS + tuple(name for name, field in OPTIONAL_FIELDS.items()
                          if field.gives(config) and not (data_only and field.added_by))


def check_reads(reads: tuple[str, ...], config: Any, who: str) -> None:
    """Refuse, before any work, a reader (``who``: ``train.objective=dpo``) of a field a run of ``config``
    does not give."""
    for name in reads:
        if name not in given_fields(config):
            raise ConfigError(
                f"{who} reads the batch field {name!r}, which data.format={config.data.format} does not give; "
                f"expected {OPTIONAL_FIELDS[name].given_by}")
    for name, field in OPTIONAL_FIELDS.items():
        if field.needs_reader and field.gives(config) and name not in reads:
            raise ConfigError(
                f"{who} does not read the batch field {name!r} that {field.given_by} gives ({field.meaning}); "
                "expected an objective that does (train.objective: docs/preference.md, docs/rl.md)")


def model_fields(batch: dict[str, Any]) -> dict[str, Any]:
    """The optional fields of ``batch`` the model's forward pass reads, as its keyword arguments."""
    return {
        name: batch[name]
        for name, field in OPTIONAL_FIELDS.items() if field.model and name in batch
    }


def contract_batch(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                   row_of_piece: np.ndarray, n_rows: int, width: int, scores: Any = None,
                   offsets: np.ndarray | None = None,
                   piece_fields: dict[str, np.ndarray] | None = None) -> Batch:
    """The batch contract for rows made of stream pieces: the single definition used by every
    strategy.

    Pieces are given in row order, and in order inside a row; each gets the next
    segment id of its row (1, 2, ...), positions restart at 0, and the row is
    right-padded with segment id 0 and weight 0. ``scores[p]``, when given,
    is the weight of the target at stream position ``p`` (else 1).

    Preference pairs (:mod:`seqjax.data.pairs`) add ``offsets[j]``, where piece ``j``'s positions
    start, and ``piece_fields``: fields of one int32 value per piece, spread as its segment id is.

    Speed: every prediction is computed once in row-major order and written
    with one boolean-mask assignment per field (rows are filled from column 0),
    so the cost is a few linear numpy passes over the batch.
    """
    # int32 index arithmetic whenever the stream allows it: np.repeat and friends run ~10x faster
    # than on int64
    index = np.int32 if len(tokens) < np.iinfo(np.int32).max else np.int64
    starts = np.asarray(starts, index)
    predicted = (np.asarray(lengths) - 1).astype(np.int32)
    per_row = np.bincount(row_of_piece, weights=predicted, minlength=n_rows).astype(np.int64)
    if n_rows and per_row.max() > width:
        raise AssertionError(f"a row holds {per_row.max()} predictions, more than its width {width}")
    first_piece_of_row = np.searchsorted(row_of_piece, np.arange(n_rows), "left")
    segment = (np.arange(len(starts)) - first_piece_of_row[row_of_piece] + 1).astype(np.int32)
    piece_first = exclusive_cumsum(predicted)[:-1].astype(index)
    position = np.arange(int(per_row.sum()), dtype=index) - np.repeat(piece_first, predicted)
    source = position + np.repeat(starts, predicted)
    if isinstance(tokens, np.ndarray):
        tokens = np.asarray(tokens)  # a plain view of a memmap: cheaper fancy indexing
    # (else a TokenStream over several shards, indexed the same way without being read whole)
    inputs = tokens[source]
    # inside a piece the target is the next input; only each piece's last target is read from the
    # stream
    targets = np.empty_like(inputs)
    targets[:-1] = inputs[1:]
    piece_last = exclusive_cumsum(predicted)[1:] - 1
    targets[piece_last[predicted > 0]] = tokens[(starts + predicted)[predicted > 0]]
    fields = {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": np.repeat(segment, predicted),
        "positions": position if offsets is None else position +
        np.repeat(np.asarray(offsets, index), predicted),
        **{
            name: np.repeat(np.asarray(values, np.int32), predicted)
            for name, values in (piece_fields or {}).items()
        },
    }
    if scores is not None:
        # the target of input source[i] is the stream's next token
        fields["weights"] = scores[source + 1]
    return _as_rows(fields, per_row, n_rows, width, weighted=scores is not None)


def _as_rows(fields: dict[str, np.ndarray], per_row: np.ndarray, n_rows: int, width: int,
             weighted: bool) -> Batch:
    """Each field's values, in row-major order, as ``[n_rows, width]`` right-padded with 0; the
    weights, unless given, are 1 on every filled place."""
    if per_row.sum() == n_rows * width:  # every row full (the common case): a reshape, no mask
        out = {
            key: np.asarray(values,
                            np.float32 if key == "weights" else np.int32).reshape(n_rows, width)
            for key, values in fields.items()
        }
        if not weighted:
            out["weights"] = np.ones((n_rows, width), np.float32)
        return out
    filled = np.arange(width) < per_row[:, None]
    out = {}
    for key, values in fields.items():
        out[key] = np.zeros((n_rows, width), np.float32 if key == "weights" else np.int32)
        out[key][filled] = values
    if not weighted:
        out["weights"] = filled.astype(np.float32)
    return out


def from_grain_packed(element: dict[str, np.ndarray]) -> Batch:
    """Grain's packers name fields ``<key>_segment_ids`` / ``<key>_positions``; give them the
    contract's names.

    Positions are recomputed from the segment ids so a split continuation
    restarts at 0 as the contract says, whatever the packer did.
    """
    segment_ids = np.asarray(element["inputs_segment_ids"], np.int32)
    return {
        "inputs": np.asarray(element["inputs"], np.int32),
        "targets": np.asarray(element["targets"], np.int32),
        "segment_ids": segment_ids,
        "positions": positions_from_segments(segment_ids),
        "weights": (segment_ids > 0).astype(np.float32) *
        np.asarray(element.get("weights", 1.0), np.float32),
    }
