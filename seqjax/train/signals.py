"""Stopping between steps: SIGINT/SIGTERM on one process, JAX's preemption sync point on many.

A step is never cut in half: a signal sets a flag the loop checks after each
step, the loop saves a checkpoint of that step and raises :class:`Interrupted`
(the CLI exits 128 + the signal's number). A second SIGINT interrupts at once,
except while a checkpoint is being written (:meth:`StopRequest.critical`): a
save a stop asked for always finishes, so the run keeps its last good step.
"""

from __future__ import annotations

import contextlib
import logging
import signal

from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; a checkpoint of the last finished step was written."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum = signum


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (a step is never cut in half).

    A second SIGINT interrupts at once, for a user who does not want to wait, unless a checkpoint is
    being written (inside :meth:`critical`): then it is noted and the write finishes first (a write
    cut in half would leave only a temporary folder, and the next start would lose the steps since
    the last checkpoint). Multi-host runs leave SIGTERM to JAX's preemption notifier (see
    :func:`should_stop`), so the handlers are only installed for one process.
    """

    def __init__(self, enabled: bool = True):
        self.signum: int | None = None
        self.enabled = enabled
        self._previous = {}
        self._critical = 0

    @contextlib.contextmanager
    def critical(self):
        """A section no signal cuts short (a checkpoint being written): signals that arrive are noted."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1

    def _handle(self, signum, frame):
        if self._critical:
            logger.warning("%s: a checkpoint is being written; it finishes first, then the run stops",
                           signal.Signals(signum).name)
            self.signum = self.signum or signum
            return
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("%s: saving a checkpoint after this step, then exiting",
                       signal.Signals(signum).name)

    def __enter__(self):
        if not self.enabled:
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def should_stop(stop: StopRequest, step: int, process_count: int) -> bool:
    """Single process: a signal arrived. Multi-host: JAX's preemption sync point, so all processes
    stop at one step."""
    if process_count > 1:
        return multihost_utils.reached_preemption_sync_point(step)
    return stop.signum is not None
