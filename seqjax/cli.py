"""What every seqjax CLI shares, and the one place where bad input becomes a message and exit code 2.

Each CLI builds its parser with :func:`parser` (``--config FILE``, dotted
``key=value`` overrides, ``--help-config``, ``--log-level``), adds its own
flags, and hands its work to :func:`run`::

    def main(argv=None) -> int:
        p = cli.parser("seqjax-prepare", "Build the tokenizer and token stores.")
        return cli.run(p, argv, lambda args: prepare_and_report(cli.load(args)))

:func:`run` parses the flags, sets up logging, and runs the work. Every
:class:`~seqjax.errors.SeqjaxError` (config, corpus, tokenizer, store, data,
checkpoint, usage) raised anywhere inside it, reading files included, ends the
program with one line naming the key or file, the value and what is allowed,
and exit code 2 (:func:`refuse`). Anything else is a bug and keeps its
traceback.

Messages go through :mod:`logging` with one format (:data:`LOG_FORMAT`), to
stderr, drawn above any progress bar; stdout holds only a tool's results
(the resolved config, and a JSON summary as the last line).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence, TypeVar

from tqdm import tqdm

from seqjax.config import Config, ConfigError, describe_keys, load_config
from seqjax.errors import SeqjaxError, UsageError

EXIT_BAD_INPUT = 2
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger("seqjax")
T = TypeVar("T")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The shared flags; ``prog`` names the tool in messages (its console script's name when run as one)."""
    invoked = Path(sys.argv[0]).name
    if invoked.startswith("seqjax-"):  # seqjax-train, ...: name the tool as the user typed it
        prog = invoked
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", metavar="FILE", help="YAML config, for example configs/wikitext2_cpu.yaml")
    p.add_argument("--help-config", action="store_true", help="list every config key with its type and default")
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, type=str.upper,
                   help="how much goes to stderr (default: %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. data.seq_len=512 train.steps=100")
    return p


def run(p: argparse.ArgumentParser, argv: Sequence[str] | None, work: Callable[[argparse.Namespace], T]) -> T:
    """Parse the flags, set up logging and run ``work(args)``; a SeqjaxError becomes one line and exit code 2."""
    args = _parse_flags(p, argv)
    try:
        return work(args)
    except SeqjaxError as err:
        refuse(p, err)


def load(args: argparse.Namespace) -> Config:
    """The validated config from ``--config`` and the overrides (a ConfigError inside :func:`run` exits 2)."""
    return load_config(args.config, args.overrides)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Flags and the validated config, or exit 2 with the message: for tools that need nothing else from :func:`run`."""
    args = _parse_flags(p, argv)
    try:
        return args, load(args)
    except ConfigError as err:
        refuse(p, err)


def refuse(p: argparse.ArgumentParser, err: SeqjaxError) -> NoReturn:
    """Log ``err`` as one line (``config error: ...`` or ``error: ...``) and exit with code 2."""
    kind = "config error" if isinstance(err, ConfigError) else "error"
    log.error("%s: %s: %s", p.prog, kind, err)
    sys.exit(EXIT_BAD_INPUT)


def _parse_flags(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    if args.help_config:
        print(describe_keys())
        sys.exit(0)
    return args


class _ProgressAwareHandler(logging.Handler):
    """Writes each record to the current ``sys.stderr`` through tqdm, so a line never lands inside a progress bar.

    Looking ``sys.stderr`` up per record (not once at setup) keeps messages
    visible to whatever replaced it since: a test's capture, a redirect.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own policy: report and carry on
            self.handleError(record)


def configure_logging(level: str = "INFO") -> None:
    """Send seqjax's messages to stderr in :data:`LOG_FORMAT` at ``level``; calling it again only changes the level."""
    if not any(isinstance(h, _ProgressAwareHandler) for h in log.handlers):
        handler = _ProgressAwareHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
        log.addHandler(handler)
        log.propagate = False  # one line per message, even where the root logger has handlers of its own
    log.setLevel(level)


# ---------------------------------------------------------------------------
# The CLIs that read a trained run: seqjax.eval, seqjax.generate, scripts/eval_table.py


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """``--run DIR``, ``--checkpoint DIR`` or ``--hf DIR``: the config comes from there, so ``--config`` is refused."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", metavar="DIR", help="a training run folder (its newest readable checkpoint)")
    where.add_argument("--checkpoint", metavar="DIR", help="one checkpoint folder")
    where.add_argument("--hf", metavar="DIR",
                       help="a Hugging Face Llama folder (config.json, *.safetensors, tokenizer.json), read directly")


def load_checkpoint(args: argparse.Namespace, overrides: Sequence[str] | None = None):
    """(config, model with trained weights) from ``--run``, ``--checkpoint`` or ``--hf``, with the overrides.

    Raises a SeqjaxError (exit 2 inside :func:`run`) for ``--config``, a missing
    folder, or a folder without a readable checkpoint.
    """
    # orbax and flax take about a second to import; only the CLIs that read checkpoints pay for them
    from seqjax.train import checkpoint

    if args.config:
        raise UsageError("--config: the configuration comes from the checkpoint; pass key=value overrides instead")
    overrides = list(args.overrides if overrides is None else overrides)
    if getattr(args, "hf", None):
        # safetensors and the HF mapping: only --hf pays for them
        from seqjax import hf

        return hf.load(args.hf, overrides)
    path = args.run or args.checkpoint
    if not Path(path).is_dir():
        raise UsageError(f"{'--run' if args.run else '--checkpoint'} {path!r}: no such folder")
    return checkpoint.load_for_inference(path, overrides)


def trained_tokenizer(args: argparse.Namespace, config: Config):
    """The tokenizer ``config`` names (reused from the cache), refused unless it is the one the model can read.

    Checked before any token store is built: token ids beyond the model's
    vocabulary cannot raise under jit, they only turn the loss into NaN. A
    tokenizer of the right size but not the run's own (the checkpoint records
    its hash) would give meaningless numbers, so it is refused too.
    """
    # the tokenizers library and orbax take a second to import: only the CLIs that read a trained run need them
    from seqjax.data.build import prepare
    from seqjax.train import checkpoint  # (orbax, as in load_checkpoint)

    tokenizer = prepare(config, splits=()).tokenizer
    vocab = config.model.vocab_size
    where = args.run or args.checkpoint or getattr(args, "hf", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {tokenizer.path}: {tokenizer.vocab_size} tokens, more than the model.vocab_size={vocab} "
            f"of {where}; expected the tokenizer the run was trained with (drop the tokenizer.* overrides)"
        )
    # An HF folder records no training tokenizer hash; its own tokenizer.json is what --hf reads.
    trained = None if getattr(args, "hf", None) else checkpoint.trained_tokenizer_hash(where)
    if trained is not None and trained != tokenizer.hash:
        raise ConfigError(
            f"tokenizer {tokenizer.path} (sha256 {tokenizer.hash[:12]}) is not the one {where} was trained with "
            f"(sha256 {trained[:12]}); expected that tokenizer (drop the tokenizer.* overrides)"
        )
    return tokenizer
