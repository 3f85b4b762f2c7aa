"""``python -m seqjax.data --config FILE [key=value ...]``: what the configured strategy makes of
the training split.

Prints one line on stdout, a JSON object with the
epoch's statistics (rows, padding, coverage, segments, tokens/s); for a
mixture (``data.sources``), the rows and tokens each source gave over
``--steps`` batches beside its weight: the realized proportions. With
``--dump FILE.npz --batches N`` it also writes the first N batches with every
contract field, stacked as ``[N, batch, L]`` (length_grouped batches are
padded to the widest of them). ``--plot FILE.png`` draws the first batch's
layout: rows by positions, a colour per example, prompt tokens pale
(:mod:`seqjax.data.picture`). ``--show-config`` prints the resolved config on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from seqjax.core.errors import UsageError
from seqjax.data import strategies
from seqjax.data.contract import given_fields
from seqjax.data.image_rows import PATCH_FIELDS
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from seqjax.data.ragged import ragged_arange, starts_in_groups
from seqjax.data.stats import epoch_stats, mixture_stats
from seqjax.main import cli
from seqjax.store.build import prepare

log = logging.getLogger("seqjax.data")  # the command's name, as its log lines show it


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.data",
                   "What the configured sequence strategy makes of a split: epoch statistics as JSON, "
                   "optionally a dump of batches.")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"),
                   help="which split's store to cut")
    p.add_argument("--dump", metavar="FILE.npz", help="write the first --batches batches here")
    p.add_argument("--show-config", action="store_true", help="print the resolved config (YAML) on stderr")
    p.add_argument("--batches", type=int, default=1, help="how many batches --dump writes")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the first batch's layout (examples, prompts, padding)")
    p.add_argument("--steps", type=int, default=256,
                   help="a mixture (data.sources): batches its realized proportions are counted over")
    cli.run(p, argv, describe)
    return 0


def sources_of(config, store, n_batches: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the first ``n_batches`` batches came from: ``documents`` [n, batch, width], the index
    in the split's store of the document (example) each slot's target belongs to (-1 on padding: the
    index ``eval --per-example`` reports), and ``epochs`` [n], each batch's epoch. Read from the
    epochs' row plans, which the batches are built from."""
    planner, batch = EpochPlanner(config, store), config.data.batch_size
    offsets = np.asarray(store.doc_offsets, np.int64)
    documents = np.full((n_batches, batch, width), -1, np.int64)
    epochs = np.zeros(n_batches, np.int64)
    epoch, first, plan = 0, 0, planner.plan(0)
    for k in range(n_batches):
        while k - first >= plan.num_batches:  # the next epoch's batches follow this one's
            epoch, first = epoch + 1, first + plan.num_batches
            plan = planner.plan(epoch)
        epochs[k] = epoch
        starts, lengths, row = plan.pieces(np.arange((k - first) * batch, (k - first + 1) * batch))
        slot = starts_in_groups(lengths - 1, row, batch)  # each piece's first slot in its row
        owner, j = ragged_arange(lengths - 1)
        target = starts[owner] + 1 + j
        documents[k, row[owner], slot[owner] + j] = np.searchsorted(offsets, target, "right") - 1
    return documents, epochs


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """Check, build the pipeline, optionally dump its first batches, and print the epoch's
    statistics."""
    for flag, value in (("--batches", args.batches), ("--steps", args.steps)):
        if value < 1:
            raise UsageError(f"{flag}: got {value}, expected at least 1")
    if args.dump and (Path(args.dump).is_dir() or not args.dump.endswith(".npz")):
        raise UsageError(f"--dump {args.dump}: expected a file name ending in .npz (numpy would write "
                         f"{args.dump.rstrip('/')}.npz beside it otherwise)")
    config = cli.load(args)
    if args.show_config:  # (stderr: stdout holds the one JSON line, for jq)
        print(f"# resolved config\n{config.to_yaml()}", file=sys.stderr, flush=True)
    if config.data.format == "prompt":
        return describe_groups(args, config)
    store = prepare(config, splits=(args.split,)).stores[args.split]
    # checks the store against the config before any batch is built
    pipeline = build_pipeline(config, store)
    stats = mixture_stats(config, store, args.steps) if store.sources else epoch_stats(config, store)
    if args.dump:
        batches = list(islice(iter(pipeline), args.batches))
        width = max(b["inputs"].shape[1] for b in batches)
        arrays = {  # the five, and the optional ones (pairs: pair_ids, prefix_ids; images: positions_3d, patches..)
            k: np.stack([b[k] if k in PATCH_FIELDS else np.pad(
                b[k], ((0, 0), (0, width - b[k].shape[1])) + ((0, 0),) * (b[k].ndim - 2)) for b in batches])
            for k in given_fields(config, data_only=True)
        }
        if not strategies.uses_grain_packer(config.data) and not store.sources:
            arrays["documents"], arrays["epochs"] = sources_of(config, store, len(batches), width)
        np.savez(Path(args.dump), **arrays)
        log.info("wrote %d batches to %s", len(batches), args.dump)
    if args.plot:
        from seqjax.data.picture import draw_batch  # (matplotlib: only when asked)

        title = f"{strategies.label(config.data)}, seq_len {config.data.seq_len}"
        owners = None
        if config.mesh.context > 1:
            from seqjax.model.context import chunk_owners  # (the model's modules load JAX: only for a split row)

            owners = chunk_owners(config.mesh.context)
        draw_batch(next(iter(pipeline)), Path(args.plot), title, owners)
        log.info("drew the first batch's layout in %s", args.plot)
    print(json.dumps(stats), flush=True)
    return stats


def describe_groups(args: argparse.Namespace, config) -> dict[str, Any]:
    """An RL run's first generation batch laid out as ``rl.layout`` packs it, with completions from
    ``rl.rollouts_file``, else each at ``rl.max_completion_length`` tokens (the most a group can
    take: what the rows must hold). Its statistics beside one sequence per completion; ``--plot``
    draws it."""
    # (an RL run's pieces, and JAX with them: only for data.format=prompt, so the other formats
    # start faster)
    from seqjax.data.rollouts import Group, rollout_batches
    from seqjax.store.replay import read_rollouts  # (likewise)
    from seqjax.train.rollouts import load_prompts, sized_rows  # (likewise)

    if args.dump:
        raise UsageError("--dump: data.format=prompt has no batches before the policy samples them; expected "
                         "--plot or the statistics alone")
    tokenizer = prepare(config, splits=()).tokenizer
    prompts, stop_ids = load_prompts(config, tokenizer)
    config = sized_rows(config, prompts, shards=1)  # (the rows a run would take)
    rl = config.rl
    given = read_rollouts(config, tokenizer, prompts, stop_ids).completions if rl.rollouts_file else {}
    groups = []
    for prompt in prompts[:rl.generation_prompts]:
        made = given.get(prompt.index) or [[stop_ids[0]] * rl.max_completion_length] * rl.num_generations
        completions = [np.asarray(c, np.int64) for c in made[:rl.num_generations]]
        groups.append(Group(prompt.ids, completions, np.zeros(len(completions), np.float32),
                            np.zeros(len(completions), bool)))
    batches = rollout_batches(groups, rl.layout, config.data.seq_len, config.data.batch_size,
                              rl.steps_per_generation)
    positions = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
    slots = sum(b["segment_ids"].size for b in batches)
    alone = sum(len(g.prompt) - 1 + len(c) for g in groups for c in g.completions)
    stats = {"layout": rl.layout, "prompts": len(prompts), "groups": len(groups),
             "completions": sum(len(g.completions) for g in groups),
             "completions_from": rl.rollouts_file or f"each at rl.max_completion_length={rl.max_completion_length}",
             "steps": len(batches), "rows": len(batches) * config.data.batch_size, "positions": positions,
             "positions_one_sequence_per_completion": alone, "padding": round(1 - positions / slots, 4)}
    if args.plot:
        from seqjax.data.picture import draw_batch  # (matplotlib: only when asked)

        title = f"rl.layout={rl.layout}, {rl.num_generations} completions a prompt, seq_len {config.data.seq_len}"
        draw_batch(batches[0], Path(args.plot), title)
        log.info("drew the first step's groups in %s", args.plot)
    print(json.dumps(stats), flush=True)
    return stats
