"""Where a run's batches come from: the seam beside the objective's (docs/design.md).

==============  =============================================================================================
source          ``next(params, step)``
==============  =============================================================================================
offline         the store's batches (:func:`seqjax.data.pipeline.build_pipeline`), built ahead on a thread and
                put on the device (:class:`~seqjax.train.prefetch.DevicePrefetch`); blind to the
                parameters
rollouts        an RL run's (``data.format=prompt``): completions the policy samples, scored, laid out in rows
                (:class:`seqjax.train.rollouts.RolloutSource`)
==============  =============================================================================================

Each gives ``(batch on the device, position, host metrics)``: ``position`` is what a checkpoint
keeps of where the source is (``get_state()``), and :meth:`set_state` puts a resumed source there;
the host metrics (an RL generation's rewards and lengths) join the step's row in metrics.jsonl."""

from __future__ import annotations

from typing import Any, Callable

from seqjax.train.prefetch import DevicePrefetch


class OfflineSource:
    """Today's pipeline: ``iterator``'s batches, ``depth`` of them built ahead and placed on the device."""

    def __init__(self, iterator: Any, to_device: Callable[[dict], dict], depth: int = 2):
        self.iterator, self.to_device, self.depth = iterator, to_device, depth
        self.prefetch: DevicePrefetch | None = None

    def __enter__(self) -> OfflineSource:
        self.prefetch = DevicePrefetch(self.iterator, self.to_device, depth=self.depth)
        return self

    def __exit__(self, *exc) -> None:
        if self.prefetch is not None:
            self.prefetch.close()

    def next(self, params, step: int) -> tuple[dict, Any, dict[str, float]]:
        batch, position = next(self.prefetch)
        return batch, position, {}

    def set_state(self, state: dict[str, Any], step: int) -> None:
        self.iterator.set_state(state)
