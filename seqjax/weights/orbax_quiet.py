"""Keeping orbax's own noise off stderr while a damaged or unwritable checkpoint is handled.

A failed background write or a damaged step makes orbax log tracebacks and
leave coroutines that Python reports at garbage collection ("Exception
ignored in coroutine ..."): seqjax has already said what happened in one line,
so those are filtered while the :class:`~seqjax.train.checkpoint.Checkpointer`
recovers.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _from_a_closed_event_loop(unraisable: Any) -> bool:
    """An exception raised in asyncio by a callback that outlived its event loop (orbax's, after a
    write failed)."""
    tb = unraisable.exc_traceback
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return (isinstance(unraisable.exc_value, RuntimeError) and tb is not None
            and Path(tb.tb_frame.f_code.co_filename).parent.name == "asyncio")


class _Raised:
    """An exception and its traceback, shaped as sys.unraisablehook's argument (what the checks
    above read)."""

    def __init__(self, value: BaseException, tb: Any):
        self.exc_value, self.exc_traceback = value, tb


def _raised_in_orbax(tb: Any) -> bool:
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _tensorstore_read(exc: BaseException | None) -> bool:
    """An error TensorStore raised reading a checkpoint's array (its message carries the read's
    ``tensorstore_spec``): the awaited future is TensorStore's own, so no orbax frame is in its
    traceback."""
    return exc is not None and "tensorstore_spec=" in str(exc)


class _OrphanedReads(logging.Filter):
    """asyncio's "Task exception was never retrieved" for orbax reads of a step already reported
    damaged (raised in orbax, or by the TensorStore future one of its reads awaited)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (_raised_in_orbax(record.exc_info[2]) or _tensorstore_read(record.exc_info[1])):
            log.debug("an orphaned read of a damaged checkpoint: %s",
                      (record.getMessage().splitlines() or [""])[0])
            return False
        return True


_ORPHANED = _OrphanedReads()


def quiet_orphaned_reads() -> None:
    """Before reading a checkpoint that may be damaged, and from then on (the whole process: orbax's
    event loop reports its orphaned tasks whenever they are collected, even at exit), drop asyncio's
    reports of orbax reads that failed; seqjax says it in one line. Installed before the read, not
    after its failure: TensorStore's callbacks for a failed step's other arrays can fire while the
    failure is still being handled."""
    logging.getLogger("asyncio").addFilter(_ORPHANED)  # (adding it twice keeps one)
    previous = sys.unraisablehook
    if getattr(previous, "seqjax_orphaned_reads", False):
        return

    def hook(unraisable: Any) -> None:
        if _raised_in_orbax(unraisable.exc_traceback) or _from_a_closed_event_loop(unraisable):
            log.debug("an orphaned read of a damaged checkpoint: %r", unraisable.exc_value)
        else:
            previous(unraisable)

    hook.seqjax_orphaned_reads = True
    sys.unraisablehook = hook
    # TensorStore's callbacks for those reads can still fire once orbax closed its event loop; the
    # error they hit is printed through sys.excepthook (PyErr_Print), a traceback per read thread,
    # after seqjax's one line.
    previous_excepthook = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        if _from_a_closed_event_loop(_Raised(value, tb)):
            log.debug("a read callback after orbax's event loop closed: %r", value)
        else:
            previous_excepthook(kind, value, tb)

    sys.excepthook = excepthook


class QuietOrbax(logging.Filter):
    """While a run checkpoints, orbax's noise about a failed write stays off stderr (kept at DEBUG).

    A failed background write makes orbax log one traceback per thread, and
    TensorStore callbacks that finish after orbax closed its event loop raise
    unraisable errors; :class:`Checkpointer` reports the failure once, as one
    line, from what the records say. A filter on the two loggers, and the
    unraisable hook, for as long as the checkpointer is open.
    """

    # orbax logs through absl; its event loops' orphaned tasks through asyncio
    LOGGERS = ("absl", "asyncio")

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []  # orbax's error messages, for that one line
        self._previous_hook = sys.unraisablehook

    def __enter__(self) -> QuietOrbax:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_hook

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "absl" and "orbax" in record.pathname:
            self.messages.append(record.getMessage().splitlines()[0])
        elif not (record.name == "asyncio" and record.exc_info
                  and _raised_in_orbax(record.exc_info[2])):
            return True
        log.debug("%s: %s", record.name, record.getMessage(), exc_info=record.exc_info)
        return False

    def _unraisable(self, unraisable: Any) -> None:
        if _from_a_closed_event_loop(unraisable):
            log.debug("after a failed write: %r", unraisable.exc_value)
        elif _raised_in_orbax(unraisable.exc_traceback):
            # a damaged step's other array reads: orbax stops at the first failure and leaves the
            # rest's coroutines with their exceptions unretrieved, one "Exception ignored" traceback
            # each
            first = (str(unraisable.exc_value).splitlines() or [""])[0]
            log.debug("reading a damaged checkpoint: %s", first)
        else:
            self._previous_hook(unraisable)
