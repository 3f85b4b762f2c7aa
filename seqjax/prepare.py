"""``python -m seqjax.prepare --config FILE [key=value ...]``: build or reuse the tokenizer and token stores.

Prints the resolved config, progress (stderr), and as its last line one JSON
object keyed by split with documents, tokens, bytes, words, tokens_per_word
and seconds (plus skipped_empty, lines, reused and the store folder).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Sequence

from seqjax import cli
from seqjax.data.corpus import SPLITS, CorpusError
from seqjax.data.store import StoreError
from seqjax.data.tokenizer import TokenizerError


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("seqjax.prepare", "Train or load the tokenizer and build (or reuse) the token store of each split.")
    p.add_argument("--splits", default=",".join(SPLITS), help="comma-separated splits to prepare (default: %(default)s)")
    args, config = cli.parse(p, argv)
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    cli.announce(config, Path(config.data.cache_dir).expanduser(), "prepare.yaml")
    from seqjax.data.build import prepare  # after the config is known good: imports tokenizers

    start = time.perf_counter()
    try:
        prepared = prepare(config, splits)
    except (CorpusError, StoreError, TokenizerError) as err:
        p.exit(2, f"{p.prog}: error: {err}\n")
    config.save(prepared.root / "config.yaml")
    print(f"# tokenizer {prepared.tokenizer.path} (vocab {prepared.tokenizer.vocab_size}, sha256 {prepared.tokenizer.hash[:12]})")
    print(f"# stores under {prepared.root}; total {time.perf_counter() - start:.2f}s")
    print(json.dumps(prepared.summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
