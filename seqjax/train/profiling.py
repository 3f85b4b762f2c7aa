"""``train.profile: [start, n]``: a jax.profiler trace of steps start .. start+n-1, for TensorBoard or Perfetto.

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

    def before(self, step: int) -> None:
        if step == self.start:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir))
            self.active = True

    def after(self, step: int, outputs: Any) -> None:
        if self.active and step == self.start + self.steps - 1:
            jax.block_until_ready(outputs)
            self.close()
            log.warning("profile of steps %d-%d written under %s", self.start, step, self.log_dir)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
