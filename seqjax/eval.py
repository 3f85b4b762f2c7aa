"""``python -m seqjax.eval --run DIR [--split valid|test] [key=value ...]``: a trained run's perplexity on a split.

The last stdout line is one JSON object: tokens, words, bytes, ``nll_sum``
and the perplexity in all three units under the ``eval.*`` protocol (see
:mod:`seqjax.evaluate`, which does the work).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from seqjax import cli
from seqjax.data.build import prepare
from seqjax.evaluate import evaluate
from seqjax.files import json_text


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.eval", "Perplexity of a trained model on a split (last line: one JSON object).")
    cli.add_checkpoint_args(p)
    p.add_argument("--split", choices=("valid", "test"), help="split to score (default: eval.split)")
    cli.run(p, argv, score)
    return 0


def score(args: argparse.Namespace) -> dict[str, Any]:
    """Load the checkpoint, prepare the split's store (reused from the cache), evaluate, print the JSON line."""
    overrides = list(args.overrides) + ([f"eval.split={args.split}"] if args.split else [])
    config, model = cli.load_checkpoint(args, overrides)
    cli.trained_tokenizer(args, config)  # a tokenizer the model cannot read is refused before the store is built
    split = config.eval.split
    prepared = prepare(config, splits=(split,))
    result = evaluate(model, prepared.stores[split], config, split=split)
    print(json_text(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
