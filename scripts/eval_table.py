"""The BENCHMARKS.md perplexity table: a trained run scored on valid and test under all three protocols.

    python scripts/eval_table.py --run runs/wikitext2_cpu [key=value ...]
    python scripts/eval_table.py --hf hf/llama data.variant=raw      # raw WikiText-2: the lm_eval protocol too

Prints a markdown table (every figure with its unit and protocol, the
literature's figures below it labelled as references) and, last, one JSON
object with every result. ``key=value`` overrides apply to all six runs
(e.g. ``eval.context=256 eval.stride=128``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from seqjax.core.files import json_text  # noqa: E402
from seqjax.eval.evaluate import evaluate, evaluate_lm_eval  # noqa: E402
from seqjax.eval.lm_eval import MODE as LM_EVAL  # noqa: E402
from seqjax.eval.lm_eval import read_lm_eval_split  # noqa: E402
from seqjax.eval.windows import MODES  # noqa: E402
from seqjax.main import cli, trained  # noqa: E402
from seqjax.store.build import prepare  # noqa: E402

SPLITS = ("valid", "test")
log = logging.getLogger("seqjax.eval_table")

# Published word-level WikiText-2 perplexities: references for scale, not claims about seqjax.
REFERENCES = [
    ("AWD-LSTM (Merity et al., 2017), word-level vocabulary", {"valid": 68.6, "test": 65.8}),
    ("GPT-2 117M zero-shot (Radford et al., 2019), BPE scored per word", {"test": 29.41}),
]


def fmt(value, digits: int) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def table(results: list[dict], label: str) -> str:
    lines = [
        "| model | split | mode | context / stride | tokens | words | token ppl | word ppl | bits/byte |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {label} | {r['split']} | {r['mode']} | {r['context']} / {r.get('stride', r['context'])} | "
            f"{r['tokens']:,} | "
            f"{r['words']:,} | {fmt(r['token_perplexity'], 2)} | {fmt(r['word_perplexity'], 2)} | "
            f"{fmt(r['bits_per_byte'], 4)} |"
        )
    for name, figures in REFERENCES:
        for split, value in figures.items():
            lines.append(f"| *reference:* {name} | {split} | (paper) | – | – | – | – | {value} | – |")
    return "\n".join(lines)


def main() -> int:
    p = cli.parser("python scripts/eval_table.py", "valid and test perplexity in all three units and protocols")
    trained.add_checkpoint_args(p)
    cli.run(p, None, score_all)
    return 0


def score_all(args: argparse.Namespace) -> None:
    config, model = trained.load_checkpoint(args)
    trained.trained_tokenizer(args, config)  # a tokenizer the model cannot read is refused before the stores are built
    prepared = prepare(config, splits=SPLITS)
    results = []
    for split in SPLITS:
        for mode in MODES:
            cfg = dataclasses.replace(config, eval=dataclasses.replace(config.eval, split=split, mode=mode))
            result = evaluate(model, prepared.stores[split], cfg, split=split)
            log.info("%s", json_text(result))
            results.append(result)
        if (config.data.corpus, config.data.variant) == ("wikitext2", "raw"):  # the harness's task reads raw pages
            cfg = dataclasses.replace(config, eval=dataclasses.replace(config.eval, split=split, mode=LM_EVAL))
            docs = read_lm_eval_split(cfg, split, prepared.tokenizer)
            results.append(evaluate_lm_eval(model, docs, cfg, split=split))
            log.info("%s", json_text(results[-1]))
    source = args.run or args.checkpoint or args.hf
    label = f"seqjax {Path(source).name}"
    print(table(results, label))
    print(json_text({"run": source, "variant": config.data.variant,
                      "vocab_size": prepared.tokenizer.vocab_size, "results": results}))


if __name__ == "__main__":
    sys.exit(main())
