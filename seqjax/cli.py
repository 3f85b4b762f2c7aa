"""What every seqjax CLI shares: ``--config FILE``, dotted ``key=value`` overrides, and a printed, saved config.

Each CLI builds its parser with :func:`parser`, adds its own flags, and calls
:func:`parse`. Config errors end the program with the message (key, value, what
is allowed) and exit code 2 before any work starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from seqjax.config import Config, ConfigError, describe_keys, load_config


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", metavar="FILE", help="YAML config, for example configs/wikitext2_cpu.yaml")
    p.add_argument("--help-config", action="store_true", help="list every config key with its type and default")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.seq_len=512 train.steps=100")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parse flags and build the validated config, or exit with a clear message."""
    args = p.parse_args(argv)
    if args.help_config:
        print(describe_keys())
        sys.exit(0)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        p.exit(2, f"{p.prog}: config error: {err}\n")
    return args, config


def announce(config: Config, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Print the resolved config and save it beside the outputs it produced."""
    print("# resolved config", flush=True)
    print(config.to_yaml(), flush=True)
    return config.save(Path(out_dir) / name)
