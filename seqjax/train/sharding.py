"""Device mesh, sharding rules and multi-host start-up.

The mesh has three named axes:

- ``data``: plain data parallelism (parameters replicated);
- ``fsdp``: data parallelism whose parameters and optimizer state are split
  across the axis (each parameter over its largest dimension divisible by the
  axis size);
- ``tensor``: Megatron-style tensor parallelism over attention heads and the
  MLP's hidden width ``d_ff``.

Batches are split over ``data x fsdp`` on their row dimension. Everything is
expressed as ``NamedSharding``s handed to ``jax.jit``; XLA's partitioner
inserts the collectives, so every mesh computes the same function (the
sharding tests check the losses agree to 1e-5 across meshes).

Multi-host: every process runs the same program. :func:`initialize_distributed`
joins them through ``jax.distributed``; each process reads only its own rows
(``build_pipeline(process_index=..., process_count=...)``) and
:func:`global_batch` stitches the per-process rows into one global array.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from seqjax.config import ConfigError, DistributedConfig, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis names (the ``axes`` metadata of the model's nnx.Params) split by the tensor axis.
TENSOR_AXES = ("heads", "kv_heads", "ff")

ENV_COORDINATOR = "SEQJAX_COORDINATOR"
ENV_NUM_PROCESSES = "SEQJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "SEQJAX_PROCESS_ID"


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes, with a -1 axis filled by the devices the others leave."""
    sizes = [mesh.data, mesh.fsdp, mesh.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    described = ", ".join(f"mesh.{n}={s}" for n, s in zip(AXES, sizes))
    if -1 in sizes:
        if num_devices % fixed:
            raise ConfigError(f"{described}: the fixed axes ({fixed} devices) do not divide the {num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"{described}: data x fsdp x tensor = {math.prod(sizes)}, expected the {num_devices} available devices "
            "(set one axis to -1 to fill the rest)"
        )
    return tuple(sizes)


def build_mesh(mesh: MeshConfig, devices: list | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over all devices of all processes."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def param_spec(shape: tuple[int, ...], axes: tuple[str, ...] | None, mesh: Mesh) -> P:
    """One parameter's PartitionSpec from its shape and logical axis names.

    ``tensor`` takes the first dimension named heads, kv_heads or ff (when the
    axis size divides it: a GQA model with fewer kv heads than tensor devices
    keeps wk/wv whole on that axis); ``fsdp`` takes the largest remaining
    dimension it divides. Anything left is replicated.
    """
    spec: list[Any] = [None] * len(shape)
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    if tensor > 1:
        for dim, name in enumerate(axes or ()):
            if name in TENSOR_AXES and shape[dim] % tensor == 0:
                spec[dim] = "tensor"
                break
    if fsdp > 1:
        free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % fsdp == 0]
        if free:
            spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return P(*spec)


def param_shardings(param_state: nnx.State, mesh: Mesh) -> dict:
    """NamedShardings (a pure dict, like the params the step sees) for the model's ``nnx.Param`` state."""
    specs = jax.tree.map(
        lambda v: NamedSharding(mesh, param_spec(tuple(v.shape), getattr(v, "axes", None), mesh)),
        param_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(specs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over data x fsdp, the sequence dimension whole."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def place(tree: Any, shardings: Any) -> Any:
    """Put host values (identical on every process) onto their global shardings.

    ``make_array_from_callback`` works for shardings that span processes, where
    a plain ``device_put`` of a host array would not.
    """

    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def global_batch(local: dict[str, np.ndarray], sharding: NamedSharding, process_count: int) -> dict[str, jax.Array]:
    """One global array per field from this process's rows ([B / process_count, L] each)."""
    out = {}
    for name, rows in local.items():
        shape = (rows.shape[0] * process_count, *rows.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, rows, shape)
    return out


def check_batch_fits(batch_size: int, mesh: Mesh, grad_accum: int) -> None:
    """Each micro-batch's rows must split evenly over data x fsdp."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = batch_size // grad_accum
    if micro % ways:
        raise ConfigError(
            f"data.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} rows per micro-batch, "
            f"expected a multiple of mesh data x fsdp = {ways}"
        )


def distributed_settings(dist: DistributedConfig) -> tuple[str | None, int | None, int | None]:
    """(coordinator, num_processes, process_id) from config keys, falling back to SEQJAX_* environment variables."""

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
                f"dist.num_processes={num_processes} but no coordinator: set dist.coordinator_address or {ENV_COORDINATOR}"
            )
        return False
    if num_processes is None or process_id is None:
        raise ConfigError(
            f"dist.coordinator_address={coordinator!r} needs dist.num_processes and dist.process_id "
            f"(or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})"
        )
    if process_id >= num_processes:
        raise ConfigError(f"dist.process_id={process_id}: expected less than dist.num_processes={num_processes}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True
