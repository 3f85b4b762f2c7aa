"""Groups of sampled completions as contract batches (GRPO's rollouts, docs/rl.md): built by the one
builder, :func:`seqjax.data.contract.contract_batch`, in one of three layouts (``rl.layout``).

A group is a prompt of ``n`` ids and its ``G`` completions. ``prompt_once``, the default, packs the
group whole
in one row with the prompt once::

    [ p0 .. p(n-2) ] [ p(n-1) a0 .. a(m1-1) ] [ p(n-1) b0 .. b(m2-1) ] ... (G completions)

the prompt's first ``n - 1`` ids one segment, and each completion a segment that starts at the
prompt's last id (which predicts the completion's first token), continues the prompt's positions and
attends to the prompt's segment (its ``prefix_ids``) and to itself, never to another completion: the
mask of preference pairs' shared prompt (contract 2's one extension), from 2 completions to G. Every
completion token sees what it sees in its own sequence; the prompt is computed once instead of ``G``
times: ``n - 1 + sum(m)`` predictions where one sequence per completion takes ``G (n - 1) +
sum(m)``. ``prompt_per_completion`` (Tunix's way) packs each completion with its own copy of the
prompt, and ``padded`` (TRL's) puts one completion in a row.

The rows of a generation batch are dealt to its ``rl.steps_per_generation`` optimizer steps, and
within a step to its data-parallel shards, longest first into the least loaded (LPT), so each
shard's attention work is even. A step's batch has ``data.batch_size`` rows of ``data.seq_len``;
empty rows pad it (weight 0).

Besides the contract's five, each batch carries ``prefix_ids`` (prompt_once), ``completion`` (1 +
the completion's number in the generation batch, on its tokens; 0 elsewhere), ``advantages`` (its
advantage, on its scored targets) and ``token_share`` ([rows, 1]: the generation batch's scored
completion tokens over its steps and rows, so a step's rows sum to DAPO's normalizer as TRL computes
it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqjax.core.errors import DataError
from seqjax.data.contract import contract_batch
from seqjax.data.document_rows import fit
from seqjax.data.ragged import exclusive_cumsum


@dataclass
class Group:
    """One prompt's rollouts: its ids, its completions' ids (without any token after the stop), each
    completion's advantage and whether it was cut at the length limit; ``masked``: a completion the
    loss leaves out (``rl.mask_truncated_completions``)."""

    prompt: np.ndarray
    completions: list[np.ndarray]
    advantages: np.ndarray
    masked: np.ndarray


def _units(groups: list[Group], layout: str):
    """The stream (tokens, each target's weight), and the packing units: each unit's pieces
    (starts, lengths, position offsets, prefix order, completion number), in stream order."""
    tokens, scores = [], []
    starts, lengths, offsets, order, completion, unit_of = [], [], [], [], [], []
    at, number, unit = 0, 0, 0
    for group in groups:
        prompt = np.asarray(group.prompt, np.int64)
        n = len(prompt)
        shared = layout == "prompt_once" and n >= 2
        if shared:  # the prompt's first n - 1 predictions, once
            tokens.append(prompt)
            scores.append(np.zeros(n, np.float32))
            starts.append(at), lengths.append(n), offsets.append(0)
            order.append(0), completion.append(0)
            unit_of.append(unit)
            at += n
        for k, ids in enumerate(group.completions):
            ids = np.asarray(ids, np.int64)
            # (the prompt's last id predicts the completion's first)
            head = prompt[-1:] if shared else prompt
            piece = np.concatenate([head, ids])
            weight = np.zeros(len(piece), np.float32)
            weight[len(head):] = 0.0 if group.masked[k] else 1.0
            tokens.append(piece)
            scores.append(weight)
            number += 1
            starts.append(at), lengths.append(len(piece)), offsets.append(n - 1 if shared else 0)
            order.append(k + 1 if shared else 0), completion.append(number), unit_of.append(unit)
            at += len(piece)
            if layout != "prompt_once":
                unit += 1
        if layout == "prompt_once":
            unit += 1
    stream = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    pieces = {name: np.asarray(values, np.int64) for name, values in (
        ("starts", starts), ("lengths", lengths), ("offsets", offsets), ("order", order),
        ("completion", completion), ("unit", unit_of))}
    return stream, np.concatenate(scores) if scores else np.zeros(0, np.float32), pieces


def _rows(unit_cost: np.ndarray, layout: str, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each packing unit's (row, rank in its row): best fit, longest first (one unit a row when
    padded); a unit longer than a row is one line."""
    too_long = np.flatnonzero(unit_cost > seq_len)
    if len(too_long):
        what = "a group with its prompt" if layout == "prompt_once" else "a completion with its prompt"
        raise DataError(
            f"rl.layout={layout}: {what} takes {int(unit_cost[too_long[0]])} predictions, more "
            f"than data.seq_len={seq_len}; expected data.seq_len to hold the prompt and "
            f"{'rl.num_generations x ' if layout == 'prompt_once' else ''}rl.max_completion_length "
            "tokens")
    return fit(unit_cost, seq_len, 1 if layout == "padded" else None, open_rows=max(1, len(unit_cost)),
               best=True, decreasing=True)


def rows_needed(prompt_lengths: np.ndarray, group: int, max_completion: int, layout: str, seq_len: int) -> int:
    """The rows a generation batch of prompts of these lengths takes at worst (every one of its
    ``group`` completions ``max_completion`` tokens long), laid out as :func:`rollout_batches` lays
    them out.

    >>> rows_needed(np.array([10, 6]), 4, 8, "prompt_once", 64), rows_needed(np.array([10, 6]),
    4, 8, "padded", 64) (2, 8)"""
    groups = [Group(np.zeros(n, np.int64), [np.zeros(max_completion, np.int64)] * group, np.zeros(group),
                    np.zeros(group, bool)) for n in prompt_lengths]
    _, _, pieces = _units(groups, layout)
    unit_cost = np.bincount(pieces["unit"], weights=pieces["lengths"] - 1).astype(np.int64)
    row, _ = _rows(unit_cost, layout, seq_len)
    return int(row.max()) + 1 if len(row) else 0


def with_advantages(batch: dict[str, np.ndarray], advantages: np.ndarray) -> dict[str, np.ndarray]:
    """``batch``'s ``advantages`` field, in place: each completion's advantage (``advantages``
    [N], by the completion's number in its generation batch) on its scored targets, 0 elsewhere."""
    number = batch["completion"]
    values = np.asarray(advantages, np.float32)
    batch["advantages"] = np.where((number > 0) & (batch["weights"] > 0), values[np.maximum(number - 1, 0)],
                                   0.0).astype(np.float32) if len(values) else np.zeros_like(batch["weights"])
    return batch


def rollout_batches(groups: list[Group], layout: str, seq_len: int, batch_size: int, steps: int,
                    shards: int = 1) -> list[dict[str, np.ndarray]]:
    """``steps`` contract batches of ``batch_size`` rows of ``seq_len`` holding every completion of
    ``groups`` (a generation batch), as :mod:`this module <seqjax.data.rollouts>` lays them out; one
    line when a unit cannot fit a row or the rows do not fit the steps."""
    stream, scores, pieces = _units(groups, layout)
    predictions = pieces["lengths"] - 1
    unit_cost = np.bincount(pieces["unit"], weights=predictions).astype(np.int64)
    row, rank = _rows(unit_cost, layout, seq_len)
    rows = int(row.max()) + 1 if len(row) else 0
    if rows > steps * batch_size:
        raise DataError(
            f"rl: a generation batch of {len(groups)} groups ({layout}) takes {rows} rows of "
            f"data.seq_len={seq_len}, more than data.batch_size={batch_size} x "
            f"rl.steps_per_generation={steps}; expected more rows a step (data.batch_size), longer "
            "rows, or fewer prompts a step (rl.prompts_per_step)")
    # each piece in its unit's row, the unit's pieces in order
    piece_row = row[pieces["unit"]]
    piece_rank = rank[pieces["unit"]] * (len(predictions) + 1) + np.arange(len(predictions))
    order = np.lexsort((piece_rank, piece_row))
    placed = {name: values[order] for name, values in pieces.items()}
    row_ptr = exclusive_cumsum(np.bincount(piece_row, minlength=rows))
    slot = _deal(np.bincount(piece_row, weights=predictions.astype(np.float64) ** 2, minlength=rows), steps,
                 batch_size, shards)
    scored = float(scores.sum())
    out = []
    for step in range(steps):
        chosen = np.flatnonzero(slot[:, 0] == step)
        chosen = chosen[np.argsort(slot[chosen, 1])]
        out.append(_step_batch(stream, scores, placed, row_ptr, chosen, slot[chosen, 1], batch_size, seq_len,
                               groups, layout, scored / steps))
    return out


def _deal(cost: np.ndarray, steps: int, batch_size: int, shards: int) -> np.ndarray:
    """Each row's (step, slot): rows longest first into the least loaded (step, shard) with room
    (LPT), a shard's rows contiguous in its step (``slot``: the row's place in the step's batch)."""
    per_shard = batch_size // shards
    load = np.zeros((steps, shards))
    used = np.zeros((steps, shards), np.int64)
    out = np.zeros((len(cost), 2), np.int64)
    for r in np.argsort(-cost, kind="stable"):
        room = used < per_shard
        step, shard = np.unravel_index(np.argmin(np.where(room, load, np.inf)), load.shape)
        out[r] = step, shard * per_shard + used[step, shard]
        load[step, shard] += cost[r]
        used[step, shard] += 1
    return out


def _step_batch(stream, scores, placed, row_ptr, rows, slots, batch_size, seq_len, groups, layout,
                tokens_per_step) -> dict[str, np.ndarray]:
    """One step's batch: the pieces of ``rows`` at ``slots`` of a ``batch_size``-row batch, the
    rest empty."""
    take = [np.arange(row_ptr[r], row_ptr[r + 1]) for r in rows]
    index = np.concatenate(take) if take else np.zeros(0, np.int64)
    row_of_piece = np.repeat(np.asarray(slots, np.int64), [len(t) for t in take])
    # contract_batch fills rows in order: pieces sorted by their slot
    sort = np.argsort(row_of_piece, kind="stable")
    index, row_of_piece = index[sort], row_of_piece[sort]
    first = np.searchsorted(row_of_piece, row_of_piece, "left")
    segment = np.arange(len(index)) - first + 1
    order = placed["order"][index]
    prefix = np.where(order > 0, segment - order, 0)
    fields = {"completion": placed["completion"][index]}
    if layout == "prompt_once":
        fields["prefix_ids"] = prefix
    batch = contract_batch(stream, placed["starts"][index], placed["lengths"][index], row_of_piece, batch_size,
                           seq_len, scores=scores, offsets=placed["offsets"][index], piece_fields=fields)
    with_advantages(batch, np.concatenate([np.asarray(g.advantages, np.float32) for g in groups] or [np.zeros(0)]))
    batch["token_share"] = np.full((batch_size, 1), tokens_per_step / batch_size, np.float32)
    return batch
