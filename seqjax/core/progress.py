"""Progress bars on a terminal, plain lines everywhere else; and notices said once.

A tqdm bar redraws itself with carriage returns. On a terminal that is one
line that moves; under a scheduler (SLURM, Kubernetes: stderr is a file or a
pipe) every redraw is kept, and a 700-step run wrote 34 KB of them. So a bar
is shown only when stderr is a terminal, and never with ``TQDM_DISABLE=1``;
the callers log plain lines (``step 100/700: loss ...``) where it is off.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from tqdm import tqdm


def on_terminal() -> bool:
    """True where a bar belongs: stderr is a terminal and ``TQDM_DISABLE`` is not set."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return sys.stderr.isatty() and not disabled


def progress_bar(*, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, drawn only when ``enabled`` and :func:`on_terminal` (else a silent
    counter)."""
    return tqdm(file=sys.stderr, disable=not (enabled and on_terminal()), **kwargs)


_SAID: set[tuple[str, int, str]] = set()


def log_once(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` the first time this process says it, and never again: a notice that a
    step, each evaluation and each re-trace reach (which attention backend ``auto`` chose, which
    template scores the chats) is said once per run."""
    text = message % args if args else message
    key = (logger.name, level, text)
    if key not in _SAID:
        _SAID.add(key)
        logger.log(level, "%s", text)
