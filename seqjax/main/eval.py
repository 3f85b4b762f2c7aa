"""``python -m seqjax.eval --run DIR [--split valid|test] [key=value ...]``: a trained run's
perplexity on a split.

The last stdout line is one JSON object: tokens, words, bytes, ``nll_sum``
and the perplexity in all three units under the ``eval.*`` protocol (see
:mod:`seqjax.eval.evaluate`, which does the work); ``eval.mode=lm_eval`` adds the
harness's byte_perplexity, and ``checkpoint_step`` names the step scored. With
``--run`` the result is also kept in the run's ``eval_results.json``, keyed
``split/mode/step<N>``. ``--hf DIR`` scores a Hugging Face folder directly.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from seqjax.config.load import load_config
from seqjax.core.errors import UsageError
from seqjax.core.files import json_text, write_text_atomic
from seqjax.eval.evaluate import evaluate, evaluate_lm_eval
from seqjax.eval.lm_eval import MODE as LM_EVAL
from seqjax.eval.lm_eval import read_lm_eval_split
from seqjax.eval.objective import evaluate_objective
from seqjax.main import cli, trained
from seqjax.objectives import resolve
from seqjax.store.build import prepare
from seqjax.weights import sources
from seqjax.weights.reference import reference_for

RESULTS_FILE = "eval_results.json"

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.eval",
                   "Perplexity of a trained model on a split (last line: one JSON object).")
    trained.add_checkpoint_args(p)
    p.add_argument("--split", choices=("valid", "test"), help="split to score (default: eval.split)")
    p.add_argument(
        "--per-example", metavar="FILE.jsonl", help=
        "also write one JSON line per scored document (example): its index in the split's store, "
        "targets scored, weight, nll and mean nll; per preference pair: its log-probabilities, the reference's, "
        "and the rewards")
    cli.run(p, argv, score)
    return 0


def score(args: argparse.Namespace) -> dict[str, Any]:
    """Load the checkpoint, prepare the split's store (reused from the cache), evaluate, print the
    JSON line."""
    overrides = list(args.overrides) + ([f"eval.split={args.split}"] if args.split else [])
    config, model = trained.load_checkpoint(args, overrides)
    if config.data.image_processor is not None and config.eval.mode == LM_EVAL:
        raise UsageError("eval.mode=lm_eval: got it with chats with images (data.image_processor), which are scored "
                         "in the batches training builds; expected blocks, sliding or documents")
    if config.data.image_processor is not None and args.per_example:
        raise UsageError("--per-example: got it with chats with images (data.image_processor), which are scored in "
                         "the batches training builds; expected it without")
    # a tokenizer the model cannot read is refused before the store is built
    trained.trained_tokenizer(args, config)
    split = config.eval.split
    if args.per_example and config.eval.mode == LM_EVAL:
        raise UsageError(
            "--per-example: got it with eval.mode=lm_eval, expected blocks, sliding or documents (the "
            "harness's pages are not a token store's documents)")
    if config.eval.mode == LM_EVAL:  # raw pages with the model's tokenizer, no token store
        docs = read_lm_eval_split(config, split, prepare(config, splits=()).tokenizer)
        result = evaluate_lm_eval(model, docs, config, split=split)
    elif config.data.format == "preference":  # the objective and TRL's metrics, against the run's reference
        store = prepare(config, splits=(split,)).stores[split]
        result = evaluate_objective(model, _reference(args, config, model), store, config, split=split,
                                    per_example=bool(args.per_example))
        if args.per_example:  # one line a pair: its log-probabilities, the reference's, the rewards
            _write_rows(args.per_example, result.pop("per_example"), "pairs")
    elif config.data.image_processor is not None:  # chats with images: scored in the batches training builds
        store = prepare(config, splits=(split,)).stores[split]
        result = evaluate_objective(model, None, store, config, split=split)
    else:
        prepared = prepare(config, splits=(split,))
        result = evaluate(model, prepared.stores[split], config, split=split,
                          per_document=bool(args.per_example))
        if args.per_example:
            _write_rows(args.per_example, result.pop("per_document"), "documents")
    result["checkpoint_step"] = getattr(model, "checkpoint_step", None)  # None: an HF folder (--hf)
    if args.run:
        try:
            record(Path(args.run), result, config)
        except OSError as err:  # a run folder we may read but not write: the score still prints
            log.warning("could not record the result in %s (%s)",
                        Path(args.run) / RESULTS_FILE, err.strerror)
    print(json_text(result), flush=True)
    return result


def _write_rows(path: str, rows: list[dict[str, Any]], what: str) -> None:
    write_text_atomic(Path(path), "".join(json_text(row) + "\n" for row in rows))
    log.info("wrote %d %s' figures to %s", len(rows), what, path)


def _reference(args: argparse.Namespace, config, model):
    """The reference the pairs are scored against: none for an objective without one (simpo, orpo, sft: their
    rewards are beta times the per-token mean); a model that never trained here (``--hf``, an imported run) is
    its own; a run's is the one it trained against."""
    if not resolve(config.train.objective, config.train.objective_weights).reference:
        return None
    own = bool(getattr(args, "hf", None)) or getattr(model, "params_only", False)
    trained = True
    if not own:
        saved = load_config(sources.locate(args.run or args.checkpoint, "--run" if args.run else "--checkpoint",
                                           (sources.RUN, sources.STEP)).config_file)
        trained = resolve(saved.train.objective, saved.train.objective_weights).reference
    return reference_for(config, model, own=own, trained=trained)


def record(run_dir: Path, result: dict[str, Any], config) -> Path:
    """Add the result to the run's eval_results.json, keyed split/mode/step, as lm-eval's
    --output_path keeps it.

    Earlier results stay; the same split, mode and step scored again is replaced by the newer score.
    """
    path = run_dir / RESULTS_FILE
    try:
        results = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        results = {}  # a file cut by a kill: start a fresh record rather than refuse to score
    results[f"{config.eval.split}/{config.eval.mode}/step{result['checkpoint_step']}"] = result
    return write_text_atomic(path, json_text(results, indent=2))
