"""What every seqjax CLI shares, and the one place where bad input becomes a message and exit code
2.

Each CLI builds its parser with :func:`parser` (``--config FILE``, dotted
``key=value`` overrides, ``--help-config``, ``--log-level``), adds its own
flags, and hands its work to :func:`run`::

    def main(argv=None) -> int:
        p = cli.parser("seqjax-prepare", "Build the tokenizer and token stores.")
        return cli.run(p, argv, lambda args: prepare_and_report(cli.load(args)))

:func:`run` parses the flags, sets up logging, and runs the work. Every
:class:`~seqjax.core.errors.SeqjaxError` (config, corpus, tokenizer, store, data,
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
import os
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence, TypeVar

from tqdm import tqdm

from seqjax.config.load import describe_keys, load_config
from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import SeqjaxError
from seqjax.data.strategies import check_config

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

log = logging.getLogger("seqjax")
T = TypeVar("T")


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The shared flags; ``prog`` names the tool in messages (its console script's name when run as
    one)."""
    invoked = Path(sys.argv[0]).name
    if invoked.startswith("seqjax-"):  # seqjax-train, ...: name the tool as the user typed it
        prog = invoked
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", metavar="FILE",
                   help="YAML config, for example configs/wikitext2_cpu.yaml")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key with its type and default")
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, type=str.upper,
                   help="how much goes to stderr (default: %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. data.seq_len=512 train.steps=100")
    return p


def objective_table() -> str:
    """``train.objective``'s values, one line each, from the objectives' table (--help-config's end)."""
    # (only here: the table imports JAX, which --help and every refusal before any work do without)
    from seqjax.objectives import OBJECTIVES

    rows = [f"  {name:16s} {row.doc}" for name, row in OBJECTIVES.items()]
    return "\ntrain.objective takes one of these, or a list of them weighted by train.objective_weights:\n" + \
        "\n".join(rows)


def run(p: argparse.ArgumentParser, argv: Sequence[str] | None, work: Callable[[argparse.Namespace],
                                                                               T]) -> T:
    """Parse the flags, set up logging and run ``work(args)``; a SeqjaxError becomes one line and
    exit code 2, a Ctrl-C one line and exit code 130 (the shell's for SIGINT)."""
    args = _parse_flags(p, argv)
    try:
        return work(args)
    except SeqjaxError as err:
        refuse(p, err)
    except KeyboardInterrupt:
        # What seqjax writes is staged and renamed into place: a stop leaves finished work and
        # nothing half-written. A second Ctrl-C while the interpreter shuts down (its atexit
        # callbacks: thread pools, orbax) would only print "Exception ignored in atexit callback":
        # ignored from here.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        log.error(
            "%s: interrupted (Ctrl-C): stopped; what was finished is kept, nothing half-written is",
            p.prog)
        sys.exit(EXIT_INTERRUPTED)


def load(args: argparse.Namespace) -> Config:
    """The validated config from ``--config`` and the overrides, with the strategy tables' rules
    checked too (:func:`seqjax.data.strategies.check_config`); a ConfigError inside :func:`run`
    exits 2."""
    config = load_config(args.config, args.overrides, record=True)
    check_config(config)
    compilation_cache(config)
    return config


# The persistent XLA cache every command keeps beside the token stores (data.cache_dir/xla), unless
# the environment names one; programs that compiled faster than this are not worth a file.
CACHE_MIN_COMPILE_S = 0.1


def compilation_cache(config: Config) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``data.cache_dir/xla`` (one already set, as
    ``JAX_COMPILATION_CACHE_DIR`` sets it, wins; ``SEQJAX_XLA_CACHE=0`` turns it off): a command run
    again reads its programs back instead of compiling them (BENCHMARKS.md, "Start-up")."""
    if os.environ.get("SEQJAX_XLA_CACHE") == "0":
        return None
    import jax  # (only once a config is loaded: --help and the refusals before any work do without JAX)

    if jax.config.jax_compilation_cache_dir:
        return None
    path = Path(config.data.cache_dir).expanduser() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    return path


def parse(p: argparse.ArgumentParser,
          argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Flags and the validated config, or exit 2 with the message: for tools that need nothing else
    from :func:`run`."""
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
    args = p.parse_intermixed_args(argv)  # overrides may come before and after the flags
    configure_logging(args.log_level)
    if args.help_config:
        print(describe_keys())
        print(objective_table())
        sys.exit(0)
    return args


class _ProgressAwareHandler(logging.Handler):
    """Writes each record to the current ``sys.stderr`` through tqdm, so a line never lands inside a
    progress bar.

    Looking ``sys.stderr`` up per record (not once at setup) keeps messages
    visible to whatever replaced it since: a test's capture, a redirect.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own policy: report and carry on
            self.handleError(record)


def configure_logging(level: str = "INFO") -> None:
    """Send seqjax's messages to stderr in :data:`LOG_FORMAT` at ``level``; calling it again only
    changes the level."""
    if not any(isinstance(h, _ProgressAwareHandler) for h in log.handlers):
        handler = _ProgressAwareHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
        log.addHandler(handler)
        # one line per message, even where the root logger has handlers of its own
        log.propagate = False
    log.setLevel(level)


# ---------------------------------------------------------------------------
# The CLIs that read a trained run: python -m seqjax.eval, seqjax.generate, scripts/eval_table.py
