"""``python -m seqjax.prepare --config FILE [key=value ...]``: build or reuse the tokenizer and token stores.

Prints the resolved config, progress (stderr), and as its last line one JSON
object keyed by split with documents, tokens, bytes, words, tokens_per_word
and seconds (plus skipped_empty, lines, reused and the store folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from seqjax import cli
from seqjax.config import announce
from seqjax.data.build import prepare
from seqjax.data.corpus import SPLITS


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.prepare",
                   "Train or load the tokenizer and build (or reuse) the token store of each split.")
    p.add_argument(
        "--splits", default=",".join(SPLITS), help="comma-separated splits to prepare (default: %(default)s)"
    )
    cli.run(p, argv, build)
    return 0


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the requested splits and print what was built or reused; returns the summary."""
    config = cli.load(args)
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    announce(config, Path(config.data.cache_dir).expanduser(), "prepare.yaml")
    start = time.perf_counter()
    prepared = prepare(config, splits)
    config.save(prepared.root / "config.yaml")
    tokenizer = prepared.tokenizer
    print(f"# tokenizer {tokenizer.path} (vocab {tokenizer.vocab_size}, sha256 {tokenizer.hash[:12]})")
    print(f"# stores under {prepared.root}; total {time.perf_counter() - start:.2f}s")
    print(json.dumps(prepared.summary), flush=True)
    return prepared.summary


if __name__ == "__main__":
    sys.exit(main())
