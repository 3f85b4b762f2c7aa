"""``python -m seqjax.prepare --config FILE [--verify] [key=value ...]``: build or reuse the
tokenizer and token stores.

Prints the resolved config, progress (stderr), and as its last line one JSON
object keyed by split with documents, tokens, bytes, words, tokens_per_word
and seconds (plus skipped_empty, lines, reused, shards and the store folder;
a mixture adds each source's line under ``sources``).

Under a multi-host launch (``dist.*`` or the ``SEQJAX_*`` variables, exactly as
for training) every process runs this command: each tokenizes its share of the
shards, and process 0 writes each manifest once all are done.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from seqjax.config.load import announce
from seqjax.main import cli
from seqjax.store.build import cache_dir, prepare
from seqjax.store.corpus import SPLITS
from seqjax.store.splits import has_split


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.prepare",
                   "Train or load the tokenizer and build (or reuse) the token store of each split.")
    p.add_argument(
        "--splits", default=None, help=
        f"comma-separated splits to prepare, of {','.join(SPLITS)} (default: those the config has files for)"
    )
    p.add_argument(
        "--verify", action="store_true",
        help="re-hash every source file and every store file, whatever their size and time say")
    cli.run(p, argv, build)
    return 0


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the requested splits and print what was built or reused; returns the summary."""
    config = cli.load(args)
    # every split the config gives (a corpus without test files has none to build)
    if args.splits is None:
        splits = [s for s in SPLITS if has_split(config, s)]
    else:
        splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    cache = cache_dir(config, writable=True)
    start = time.perf_counter()
    processes = _processes(config)
    prepared = prepare(config, splits, verify=args.verify, **processes)
    # (after the stores: a config whose files are missing gets its one line, and nothing before it)
    announce(config, cache, "prepare.yaml")
    # beside every store it built or reused: the settings that made it
    if processes["process_index"] == 0:
        for folder in {Path(entry["store"]).parent for entry in prepared.summary.values()}:
            config.save(folder / "config.yaml")
    tokenizer = prepared.tokenizer
    print(f"# tokenizer {tokenizer.path} (vocab {tokenizer.vocab_size}, sha256 {tokenizer.hash[:12]})")
    print(f"# stores under {prepared.root}; total {time.perf_counter() - start:.2f}s")
    print(json.dumps(prepared.summary), flush=True)
    return prepared.summary


def _processes(config) -> dict[str, Any]:
    """This process's place in a multi-host launch, and a barrier over all of them (one process: no
    barrier)."""
    single = {"process_index": 0, "process_count": 1, "barrier": None}
    # train.distributed's names
    if not (config.dist.coordinator_address or os.environ.get("SEQJAX_COORDINATOR")):
        return single
    # only a multi-host launch pays for importing JAX (seconds): its collectives are the barrier
    import jax
    from jax.experimental import multihost_utils  # (JAX, as above)

    from seqjax.train import distributed  # (JAX, as above: it joins the processes)

    if not distributed.initialize_distributed(config.dist):
        return single

    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "barrier": multihost_utils.sync_global_devices}
