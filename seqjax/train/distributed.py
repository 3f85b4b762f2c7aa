"""Multi-host start-up: join the other processes of a run through ``jax.distributed``.

Every process runs the same command; the coordinator address, the number of
processes and this process's index come from ``dist.*`` or, when those are
null, from the ``SEQJAX_*`` environment variables a launcher sets.
"""

from __future__ import annotations

import os

import jax

from seqjax.config.tree import DistributedConfig
from seqjax.core.errors import ConfigError

ENV_COORDINATOR = "SEQJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SEQJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SEQJAX_PROCESS_ID"


def distributed_settings(dist: DistributedConfig) -> tuple[str | None, int | None, int | None]:
    """(coordinator, num_processes, process_id) from config keys, falling back to SEQJAX_*
    environment variables."""

    def pick(value, env, cast):
        if value is not None:
            return value
        raw = os.environ.get(env)
        if raw is None or raw == "":
            return None
        try:
            return cast(raw)
        except ValueError:
            raise ConfigError(f"environment {env}={raw!r}: expected an integer") from None

    return (
        pick(dist.coordinator_address, ENV_COORDINATOR, str),
        pick(dist.num_processes, ENV_NUM_PROCESSES, int),
        pick(dist.process_id, ENV_PROCESS_ID, int),
    )


def initialize_distributed(dist: DistributedConfig) -> bool:
    """Join a multi-process run when a coordinator is configured; return whether one was joined.

    Must run before anything touches a JAX device. CPU processes exchange
    collectives through gloo (the default CPU client has none across
    processes); the setting is ignored by GPU/TPU backends.
    """
    coordinator, num_processes, process_id = distributed_settings(dist)
    if coordinator is None:
        if num_processes not in (None, 1):
            raise ConfigError(
                f"dist.num_processes={num_processes} but no coordinator: "
                f"set dist.coordinator_address or {ENV_COORDINATOR}"
            )
        return False
    if num_processes is None or process_id is None:
        raise ConfigError(
            f"dist.coordinator_address={coordinator!r} needs dist.num_processes and dist.process_id "
            f"(or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
        )
    if process_id >= num_processes:
        raise ConfigError(
            f"dist.process_id={process_id}: expected less than dist.num_processes={num_processes}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True
