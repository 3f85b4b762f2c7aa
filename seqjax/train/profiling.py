"""``train.profile: [start, n]``: a jax.profiler trace of steps start .. start+n-1, for TensorBoard
or Perfetto.

The trace lands in ``run.dir/profile/plugins/profile/<time>/<host>.xplane.pb``
(``tensorboard --logdir run.dir/profile``, or open the ``.trace.json.gz`` in
https://ui.perfetto.dev). The last traced step is waited for before the trace
stops, so its device work is in the trace.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)


class ProfileWindow:
    def __init__(self, window: list[int], log_dir: Path):
        self.start, self.steps = (window[0], window[1]) if window else (None, 0)
        self.log_dir = Path(log_dir)
        self.active = False

    @property
    def last(self) -> int | None:
        return None if self.start is None else self.start + self.steps - 1

    def begin(self, first_step: int) -> None:
        """Before the loop's first step: start the trace now if the window starts with it."""
        if self.start == first_step:
            self._start_trace()

    def due(self, state: Any) -> bool:
        """After step start-1 the trace starts; after the window's last step it stops (a training
        hook)."""
        return self.start is not None and state.step in (self.start - 1, self.last)

    def after(self, state: Any) -> None:
        if state.step == self.start - 1 and not self.active:
            self._start_trace()
        elif self.active and state.step == self.last:
            # the last traced step's device work belongs in the trace
            jax.block_until_ready(state.params)
            self.close()
            log.warning("profile of steps %d-%d written under %s", self.start, state.step, self.log_dir)

    def _start_trace(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.log_dir))
        self.active = True

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
