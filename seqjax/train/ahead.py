"""Generation batches made ahead of training: an RL run's off-policy overlap (``rl.max_staleness``,
``mesh.sampler_devices``; docs/rl.md).

With ``rl.max_staleness = k``, generation batch g is sampled with the weights the run holds at the
start of generation max(0, g - k): at the start of generation n the run *launches* generation
n + k with the weights it has then, and trains on generation n, launched k generations before.
k = 0 is on-policy: each batch is made at its own start. For k = 1, steps_per_generation = 1::

    step       1        2        3        4
    trains on  g0(w1)   g1(w1)   g2(w2)   g3(w3)      (wN: the weights at the start of step N)
    launches   g0, g1   g2       g3       g4

Where a launched batch is made is all that ``mesh.sampler_devices`` changes:

================  ============================================================================
sampler_devices   a launched generation batch is made
================  ============================================================================
0                 at once, on the training mesh, before the step trains on its own batch
S > 0             on a thread, on the sampler's mesh of the last S devices (``mesh.*`` as the
                  trainer's, its -1 axis filling S), from a copy of the weights sent there device
                  to device at the launch, while the trainer trains
================  ============================================================================

Both make the same batches: a batch's prompts, sampling key and reward functions' trainer state
are functions of its generation's number and launch step alone, and the sampler's mesh lays the
policy out as the trainer's does (tests/test_ahead.py holds a run on a split mesh to the
sequential one)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from seqjax.config.tree import Config
from seqjax.core.errors import ConfigError
from seqjax.model import sharding
from seqjax.train.prefetch import IteratorPosition


class Side(NamedTuple):
    """Where a generation batch's model runs: the policy (its ``rest`` placed there), its frozen
    weights, how a batch's rows are placed, and the mesh's shardings of what trains (None: the
    training mesh's own)."""

    policy: Any
    frozen: Any
    to_device: Callable[[dict], dict]
    shardings: Any = None
    mesh: Any = None


def sampler_side(config: Config, policy, params, frozen) -> Side:
    """The sampler's side of a split mesh (``mesh.sampler_devices``): ``mesh.*`` over the last
    devices, the policy's fixed state and frozen weights copied there once."""
    mesh = sharding.build_mesh(config.mesh, sharding.split_devices(config.mesh)[1])
    shards = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    if config.data.batch_size % shards:
        raise ConfigError(
            f"mesh.sampler_devices: the sampler's mesh {dict(mesh.shape)} splits rows {shards} "
            f"ways, which do not divide data.batch_size={config.data.batch_size}; expected a "
            f"batch size that is a multiple of {shards}, or other mesh sizes"
        )
    placed = functools.partial(
        sharding.global_batch, sharding=sharding.batch_sharding(mesh), process_count=1
    )
    return Side(
        dataclasses.replace(policy, rest=moved(policy.rest, mesh)),
        moved(frozen, mesh),
        placed,
        jax.tree.map(lambda a: _like(a, mesh), params),
        mesh,
    )


def moved(tree, mesh):
    """``tree``'s arrays on ``mesh``, each split as it is on its own mesh (the same axis names)."""
    return jax.tree.map(lambda a: jax.device_put(a, _like(a, mesh)), tree)


def _like(array: jax.Array, mesh) -> NamedSharding:
    spec = array.sharding.spec if isinstance(array.sharding, NamedSharding) else P()
    return NamedSharding(mesh, spec)


class Ahead:
    """The queue of launched generation batches: ``make(params, generation, step, side)`` gives
    one (``side`` None: the training mesh's). A run launches k batches beyond its last step's:
    they are on disk for the same run continued with a larger ``train.steps``, which then trains
    on what the longer run would have."""

    def __init__(self, make: Callable, staleness: int, side: Side | None = None):
        self.make, self.staleness, self.side = make, staleness, side
        self.launched = -1
        self.queue: dict[int, Any] = {}  # generation -> its batch, or the Future that makes it
        self.pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seqjax-sampler")
            if side is not None
            else None
        )

    def take(self, generation: int, params, step: int) -> dict:
        """Generation ``generation``'s batch, once those through ``generation + k`` are launched
        with ``params`` (the weights at ``step``'s start); made now if it never was (a run's
        first, or one set aside as damaged)."""
        if generation not in self.queue:
            self._launch(generation, params, step)
        for later in range(self.launched + 1, generation + self.staleness + 1):
            self._launch(later, params, step)
        made = self.queue.pop(generation)
        return made.result() if isinstance(made, concurrent.futures.Future) else made

    def _launch(self, generation: int, params, step: int) -> None:
        if self.pool is None:
            self.queue[generation] = self.make(params, generation, step, None)
        else:  # (a copy of its own on the sampler's devices: the trainer's are donated)
            copy = jax.block_until_ready(jax.device_put(params, self.side.shardings))
            self.queue[generation] = self.pool.submit(self.make, copy, generation, step, self.side)
        self.launched = max(self.launched, generation)

    def wait(self) -> None:
        """Until every launched batch is made (and written): what a checkpoint's position needs."""
        for made in list(self.queue.values()):
            if isinstance(made, concurrent.futures.Future):
                made.result()

    def close(self, cancel: bool = False) -> None:
        """Once the batches launched are made (``cancel``: those not begun are dropped: the run
        failed)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=cancel)


class Tally:
    """Tokens sampled through each generation batch (a completion counts with its prompt: TRL's
    ``num_tokens``): ``add(g, own)`` gives generation g's running total. A checkpoint keeps each
    own count from the generation in training to the newest launched, so a batch found damaged
    on resume and made again counts from its predecessor's total, not from the newest's."""

    def __init__(self):
        self.counts: dict[int, tuple[int, int]] = {-1: (0, 0)}  # generation -> (through it, its own)

    def add(self, generation: int, own: int) -> int:
        through = self.before(generation) + own
        self.counts[generation] = (through, own)
        return through

    def before(self, generation: int) -> int:
        """Tokens sampled before ``generation``: through its predecessor, else (one restored) its
        own total less its own count."""
        if generation - 1 in self.counts:
            return self.counts[generation - 1][0]
        through, own = self.counts[generation]
        return through - own

    def state(self, launched: int, staleness: int) -> dict[str, Any]:
        owns = [self.counts[g][1] for g in range(max(0, launched - staleness), launched + 1)]
        return {"num_tokens": self.counts[launched][0], "launched_tokens": owns}

    def restore(self, state: dict[str, Any], launched: int) -> None:
        """The counts a checkpoint's ``state`` kept, ``launched`` the newest (a checkpoint older
        than ``launched_tokens`` kept that one's alone, as ``generation_tokens``)."""
        through = int(state.get("num_tokens", 0))
        owns = state.get("launched_tokens") or [state.get("generation_tokens", 0)]
        for generation, own in zip(range(launched, -1, -1), reversed(owns)):
            self.counts[generation] = (through, int(own))
            through -= int(own)


class AheadPosition(IteratorPosition):
    """A checkpoint's data position that is read only once the batches it names as launched are
    on disk (a resume reads them back)."""

    def __init__(self, state: dict[str, Any], settle: Callable[[], dict[str, Any]]):
        super().__init__(state)
        self.settle = settle

    def get_state(self) -> bytes:
        self.state = self.settle()
        return super().get_state()
