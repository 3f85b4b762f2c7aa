"""The CLIs' ``--run DIR`` / ``--checkpoint DIR`` / ``--hf DIR``: a trained model and the tokenizer
it reads.

Shared by ``seqjax.main.eval``, ``.generate`` and ``.export`` (and
scripts/eval_table.py). It sits with the CLIs, above data/ and train/, so the
plumbing every CLI shares (:mod:`seqjax.main.cli`) imports neither; only the tools
that read checkpoints pay for importing orbax and flax.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from seqjax.config.tree import Config
from seqjax.core.errors import UsageError
from seqjax.main.cli import compilation_cache
from seqjax.store.build import prepare
from seqjax.store.tokenizer import Tokenizer
from seqjax.weights.inference import check_tokenizer, load_folder, load_for_inference, with_adapter


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """``--run DIR``, ``--checkpoint DIR`` or ``--hf DIR``: the config comes from there, so
    ``--config`` is refused."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", metavar="DIR",
                       help="a training run folder (its newest readable checkpoint)")
    where.add_argument("--checkpoint", metavar="DIR", help="one checkpoint folder")
    where.add_argument(
        "--hf", metavar="DIR", help=
        "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json), read directly")
    p.add_argument(
        "--adapter", metavar="PEFT_DIR",
        help="a PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors) put on the model "
        "given as its base, with no training step")


def load_checkpoint(args: argparse.Namespace,
                    overrides: Sequence[str] | None = None) -> tuple[Config, Any]:
    """(config, model with trained weights) from ``--run``, ``--checkpoint`` or ``--hf``, with the
    overrides, and ``--adapter``'s adapters on it.

    Raises a SeqjaxError (exit 2 inside :func:`seqjax.main.cli.run`) for ``--config``, a missing
    folder, or a folder without a readable checkpoint.
    """
    if args.config:
        raise UsageError(
            "--config: the configuration comes from the checkpoint; pass key=value overrides instead"
        )
    overrides = list(args.overrides if overrides is None else overrides)
    if getattr(args, "hf", None):
        config, model = load_folder(args.hf, overrides)
    else:
        path = args.run or args.checkpoint
        if not Path(path).is_dir():
            raise UsageError(f"{'--run' if args.run else '--checkpoint'} {path!r}: no such folder")
        config, model = load_for_inference(path, overrides)
    if getattr(args, "adapter", None):
        config, model = with_adapter(config, model, args.adapter)
    compilation_cache(config)
    return config, model


def trained_tokenizer(args: argparse.Namespace, config: Config) -> Tokenizer:
    """The tokenizer ``config`` names (reused from the cache), refused unless it is the one the
    model can read.

    Checked before any token store is built: token ids beyond the model's
    vocabulary cannot raise under jit, they only turn the loss into NaN. A
    tokenizer of the right size but not the run's own (the checkpoint records
    its hash) would give meaningless numbers, so it is refused too.
    """
    tokenizer = prepare(config, splits=()).tokenizer
    where = args.run or args.checkpoint or getattr(args, "hf", None)
    # An HF folder records no training tokenizer hash; its own tokenizer.json is what --hf reads.
    overridden = any(o.startswith("tokenizer.") for o in args.overrides)
    check_tokenizer(
        where, tokenizer.hash, tokenizer.path, config.model.vocab_size, tokenizer.vocab_size,
        "drop the tokenizer.* overrides" if overridden else "the run folder's own tokenizer.json")
    return tokenizer
