"""Batches built and put on the device ahead of the step that needs them, with the data position of
each.

The train loop dispatches a step and moves on; the device runs it while the
host builds the next batch. Without prefetch the host's work (cutting rows from
the token store, the host-to-device copy) sits between two steps whenever the
loop waits for anything. :class:`DevicePrefetch` runs that work in one
background thread, ``depth`` batches ahead.

Prefetching reads the data iterator ahead of the loop, so the iterator's own
state is ahead of the last batch trained on. Each item therefore carries the
iterator state *after its own batch*; a checkpoint saves the state of the last
batch the loop consumed (:class:`IteratorPosition`), and a resumed run replays
nothing and skips nothing (docs/design.md, contract 4).
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Any, Callable, Iterator

_DONE = object()


class IteratorPosition:
    """A saved data position that Grain's checkpoint handler writes like an iterator's own state.

    Grain's ``CheckpointSave`` calls ``get_state()`` on objects that are not
    ``DatasetIterator``\\ s and expects JSON bytes; the file it writes is the
    same JSON the iterator would give, so restore reads it into the real
    iterator unchanged.
    """

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


class DevicePrefetch:
    """Iterate ``(device_batch, position)`` pairs; a background thread keeps ``depth`` of them
    ready.

    ``iterator``: a Grain ``DatasetIterator`` of host batches (dicts of numpy
    arrays); ``to_device``: host batch -> global device batch. ``depth=0``
    builds each batch in the calling thread (no thread), which is what the
    CPU tests of exact resume compare against. Errors raised while building a
    batch (a bad store, say) are re-raised in the loop at the batch they hit.
    """

    def __init__(self, iterator: Any, to_device: Callable[[dict], dict], depth: int = 2):
        self._iterator = iterator
        self._to_device = to_device
        self._depth = depth
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._produce, name="seqjax-prefetch", daemon=True)
            self._thread.start()

    def _one(self) -> tuple[dict, IteratorPosition]:
        host = next(self._iterator)
        # A copy of the state right after this batch: the iterator moves on while the batch waits in
        # the queue.
        position = IteratorPosition(json.loads(json.dumps(self._iterator.get_state())))
        return self._to_device(host), position

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                item = self._one()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # noqa: BLE001  (handed to the consumer, which raises it)
            self._queue.put((_DONE, err))

    def __iter__(self) -> Iterator[tuple[dict, IteratorPosition]]:
        return self

    def __next__(self) -> tuple[dict, IteratorPosition]:
        if self._thread is None:
            return self._one()
        item = self._queue.get()
        if item[0] is _DONE:
            raise item[1]
        return item

    def close(self) -> None:
        """Stop the thread (a batch it is building is dropped: the saved positions never include
        it)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread.join()

    def __enter__(self) -> DevicePrefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
