"""``python -m seqjax.eval --run DIR [--split valid|test] [key=value ...]``: a trained run's perplexity on a split.

The last stdout line is one JSON object: tokens, words, bytes, ``nll_sum``
and the perplexity in all three units under the ``eval.*`` protocol (see
:mod:`seqjax.evaluate`, which does the work); ``eval.mode=lm_eval`` adds the
harness's byte_perplexity. ``--hf DIR`` scores a Hugging Face folder directly.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from seqjax import cli, trained
from seqjax.data.build import prepare
from seqjax.data.lm_eval import MODE as LM_EVAL
from seqjax.data.lm_eval import read_lm_eval_split
from seqjax.evaluate import evaluate, evaluate_lm_eval
from seqjax.files import json_text


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.eval", "Perplexity of a trained model on a split (last line: one JSON object).")
    trained.add_checkpoint_args(p)
    p.add_argument("--split", choices=("valid", "test"), help="split to score (default: eval.split)")
    cli.run(p, argv, score)
    return 0


def score(args: argparse.Namespace) -> dict[str, Any]:
    """Load the checkpoint, prepare the split's store (reused from the cache), evaluate, print the JSON line."""
    overrides = list(args.overrides) + ([f"eval.split={args.split}"] if args.split else [])
    config, model = trained.load_checkpoint(args, overrides)
    trained.trained_tokenizer(args, config)  # a tokenizer the model cannot read is refused before the store is built
    split = config.eval.split
    if config.eval.mode == LM_EVAL:  # raw pages with the model's tokenizer, no token store
        docs = read_lm_eval_split(config, split, prepare(config, splits=()).tokenizer)
        result = evaluate_lm_eval(model, docs, config, split=split)
    else:
        prepared = prepare(config, splits=(split,))
        result = evaluate(model, prepared.stores[split], config, split=split)
    print(json_text(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
