"""``python -m seqjax.data --config FILE [key=value ...]``: what the configured strategy makes of the training split.

Prints the resolved config, then as its last line one JSON object with the
epoch's statistics (rows, padding, coverage, segments, tokens/s). With
``--dump FILE.npz --batches N`` it also writes the first N batches with every
contract field, stacked as ``[N, batch, L]`` (length_grouped batches are
padded to the widest of them).
"""

from __future__ import annotations

import json
import sys
from itertools import islice

import numpy as np

from seqjax.cli import parse, parser
from seqjax.data.contract import FIELDS


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m seqjax.data", "What the configured sequence strategy makes of a split: epoch statistics as JSON, optionally a dump of batches.")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"), help="which split's store to cut")
    p.add_argument("--dump", metavar="FILE.npz", help="write the first --batches batches here")
    p.add_argument("--batches", type=int, default=1, help="how many batches --dump writes")
    args, config = parse(p, argv)
    print("# resolved config", flush=True)
    print(config.to_yaml(), flush=True)

    from seqjax.data.build import prepare
    from seqjax.data.pipeline import build_pipeline
    from seqjax.data.stats import epoch_stats

    store = prepare(config, splits=(args.split,)).stores[args.split]
    try:
        pipeline = build_pipeline(config, store)
        stats = epoch_stats(config, store)
    except ValueError as err:  # DataError and ConfigError: bad input, said before any batch is built
        p.exit(2, f"{p.prog}: {err}\n")
    if args.dump:
        batches = list(islice(iter(pipeline), args.batches))
        width = max(b["inputs"].shape[1] for b in batches)
        arrays = {k: np.stack([np.pad(b[k], ((0, 0), (0, width - b[k].shape[1]))) for b in batches]) for k in FIELDS}
        np.savez(args.dump, **arrays)
        print(f"# wrote {len(batches)} batches to {args.dump}", flush=True)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
