"""Progress bars on a terminal, plain lines everywhere else; and notices said once.

A tqdm bar redraws itself with carriage returns. On a terminal that is one
line that moves; under a scheduler (SLURM, Kubernetes: stderr is a file or a
pipe) every redraw is kept, and a 700-step run wrote 34 KB of them. So a bar
is shown only when stderr is a terminal, and never with ``TQDM_DISABLE=1``;
the callers log plain lines (``step 100/700: loss ...``) where it is off, and a bar that
is off says where it is every half minute (:func:`progress_bar`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from tqdm import tqdm


def on_terminal() -> bool:
    """True where a bar belongs: stderr is a terminal and ``TQDM_DISABLE`` is not set."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return sys.stderr.isatty() and not disabled


# Off a terminal, a long phase says how far it is every this many seconds (a plain log line).
PLAIN_EVERY_S = 30.0


def progress_bar(*, enabled: bool = True, plain: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, drawn only when ``enabled`` and :func:`on_terminal`; elsewhere (``enabled``) a
    plain log line every :data:`PLAIN_EVERY_S` seconds (``eval sliding: 120/400 batch, 61 s``), so
    no phase over half a minute is silent in a log file (``plain=False``: the caller logs its own
    lines)."""
    if enabled and plain and not on_terminal():
        return _PlainLines(**kwargs)
    return tqdm(file=sys.stderr, disable=not (enabled and on_terminal()), **kwargs)


class _PlainLines(tqdm):
    """A counter that logs a line now and then instead of drawing itself."""

    def __init__(self, **kwargs: Any):
        super().__init__(file=sys.stderr, disable=True, **kwargs)
        self.count, self.started = kwargs.get("initial", 0) or 0, time.monotonic()
        self.said = self.started
        self.what, self.of, self.units = kwargs.get("desc"), kwargs.get("total"), kwargs.get("unit", "it")

    def update(self, n: float | None = 1) -> bool | None:
        self.count += 1 if n is None else n
        now = time.monotonic()
        if now - self.said >= PLAIN_EVERY_S:
            self.said = now
            total = f"/{self.of}" if self.of else ""
            logging.getLogger("seqjax").info("%s: %d%s %s, %.0f s", self.what or "working", self.count, total,
                                             self.units, now - self.started)
        return None


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
