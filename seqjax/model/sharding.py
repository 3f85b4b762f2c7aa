"""The device mesh and how arrays lie on it: axis names, the mesh from ``mesh.*``, parameter and
batch shardings.

It sits below the model (it imports only the config): the model's attention
reads :data:`BATCH_AXES` and :data:`HEAD_AXIS` to run its kernels once per
device shard, and training and evaluation place parameters and batches with
the rules here.

The mesh has five named axes:

- ``data``: plain data parallelism (parameters replicated);
- ``fsdp``: data parallelism whose parameters and optimizer state are split
  across the axis (each parameter over its largest dimension divisible by the
  axis size);
- ``expert``: expert parallelism: a mixture of experts' experts split over the
  axis, and, between its layers, the batch's rows as ``data`` splits them
  (seqjax.model.experts gathers each expert group's tokens and gives each its
  outputs back);
- ``context``: context parallelism: each row's tokens split over the axis
  (seqjax.model.context; parameters replicated);
- ``tensor``: Megatron-style tensor parallelism over attention heads and the
  MLP's hidden width ``d_ff``.

Parameters follow one rule table, :data:`PARAM_RULES` (a logical dimension -> the
mesh axis that splits it), and :func:`param_spec`; activations follow another,
:data:`ACTIVATION_RULES` (a logical dimension -> the mesh axes that split it),
and :func:`activation_spec`; a kernel run per device shard asks
:func:`shard_axes` which axes split its rows and heads. Batches are split over ``data x fsdp`` on their
row dimension; their tokens stay whole on every context device (int32 ids are
4 bytes a token against the activations' 2 x d_model), and the first block
takes each device's share (seqjax.model.context). Everything is
expressed as ``NamedSharding``s handed to ``jax.jit``; XLA's partitioner
inserts the collectives, so every mesh computes the same function (the
sharding tests check the losses agree to 1e-5 across meshes).

Multi-host: every process runs the same program (seqjax.train.distributed
joins them); each process reads only its own rows
(``build_pipeline(process_index=..., process_count=...)``) and
:func:`global_batch` stitches the per-process rows into one global array.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from seqjax.config.tree import MeshConfig
from seqjax.core.errors import ConfigError
from seqjax.data.contract import Batch

AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # batch rows are split over these
EXPERT_AXIS = "expert"  # a mixture of experts' experts are split over this one
CONTEXT_AXIS = "context"  # a row's tokens are split over this one
HEAD_AXIS = "tensor"  # attention heads (and d_ff) are split over this one

# Parameters: each logical dimension (the ``axes`` metadata of the model's nnx.Params) -> the mesh axis that
# splits it, when the axis has more than one device and divides the dimension; the first such dimension of a
# parameter takes an axis (fsdp then takes the largest free one: param_spec).
PARAM_RULES: dict[str, str] = {"experts": EXPERT_AXIS, "heads": HEAD_AXIS, "kv_heads": HEAD_AXIS, "ff": HEAD_AXIS}

# Activations: each logical dimension -> the mesh axes that split it (param_spec's counterpart for
# the values between layers). A batch field is ("rows", None): its tokens whole (see above).
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "rows": BATCH_AXES, "tokens": (CONTEXT_AXIS,), "heads": (HEAD_AXIS,), "kv_heads": (HEAD_AXIS,),
    "embed": (), "head_dim": (), "vocab": (),
}

# The logical axes fsdp never splits (param_spec says why).
WHOLE_AXES = ("layers", "head_dim", "lora_rank")


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int, int, int]:
    """(data, fsdp, expert, context, tensor) sizes, with a -1 axis filled by the devices the others
    leave."""
    sizes = [mesh.data, mesh.fsdp, mesh.expert, mesh.context, mesh.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    described = ", ".join(f"mesh.{n}={s}" for n, s in zip(AXES, sizes))
    if -1 in sizes:
        if num_devices % fixed:
            raise ConfigError(
                f"{described}: the fixed axes ({fixed} devices) do not divide the {num_devices} devices"
            )
        sizes[sizes.index(-1)] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"{described}: data x fsdp x expert x context x tensor = {math.prod(sizes)}, expected the "
            f"{num_devices} "
            "available devices (set one axis to -1 to fill the rest)")
    return tuple(sizes)


def build_mesh(mesh: MeshConfig, devices: list | None = None) -> Mesh:
    """The (data, fsdp, expert, context, tensor) mesh over all devices of all processes."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices)


def split_devices(mesh: MeshConfig, devices: list | None = None) -> tuple[list, list]:
    """(the trainer's devices, the sampler's): the last ``mesh.sampler_devices`` of all devices
    sample
    (an RL run's overlap; docs/rl.md), the others train."""
    devices = jax.devices() if devices is None else devices
    n = mesh.sampler_devices
    if n and n >= len(devices):
        raise ConfigError(f"mesh.sampler_devices: got {n}, expected fewer than the "
                          f"{len(devices)} devices, "
                          "so that some are left to train")
    if n and jax.process_count() > 1:
        raise ConfigError(f"mesh.sampler_devices: got {n} over {jax.process_count()} processes, "
                          "expected 0: "
                          "a sampler of its own devices runs within one process")
    return list(devices[:len(devices) - n]), list(devices[len(devices) - n:])


def activation_spec(dims: tuple[str | None, ...], mesh: Mesh) -> P:
    """A PartitionSpec for an activation whose dimensions have these logical names
    (:data:`ACTIVATION_RULES`; None: whole), over the rule's axes that the mesh has."""
    def axes(name):
        kept = tuple(a for a in ACTIVATION_RULES[name] if a in mesh.shape) if name else ()
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*map(axes, dims))


def param_spec(shape: tuple[int, ...], axes: tuple[str, ...] | None, mesh: Mesh) -> P:
    """One parameter's PartitionSpec from its shape and logical axis names.

    Each dimension, first to last, takes the mesh axis :data:`PARAM_RULES` gives its name, when that
    axis has more than one device, divides it and no earlier dimension took it: ``expert`` an
    expert layer's ``experts``, ``tensor`` the first of ``heads``, ``kv_heads`` or ``ff`` (a GQA model
    with fewer kv heads than tensor devices keeps wk/wv whole on that axis). ``fsdp`` then takes the
    largest remaining dimension it divides, never a scanned model's ``layers``, a ``head_dim`` or a
    LoRA adapter's ``lora_rank``. Anything left is replicated.

    Why not ``head_dim``: the activations never split a head's dimensions, and a
    parameter that does makes XLA's partitioner lay the queries and keys out to
    match. Qwen's q/k/v biases ``[heads, head_dim]`` and Qwen3's q/k norms
    ``[head_dim]`` did: Qwen3-8B's step under fsdp=8 planned 111.5 GB of
    temporaries a device, 30.8 GB with the norms whole (BENCHMARKS.md, "Memory
    plans: the families and LoRA"). A rank dimension is the contraction between
    an adapter's A and B, which the activations never split either.
    """
    spec: list[Any] = [None] * len(shape)
    names = (*(axes or ()), *[None] * len(shape))[:len(shape)]
    for dim, name in enumerate(names):
        axis = PARAM_RULES.get(name)
        size = mesh.shape.get(axis, 1) if axis else 1
        if size > 1 and axis not in spec and shape[dim] % size == 0:
            spec[dim] = axis
    fsdp = mesh.shape.get("fsdp", 1)
    if fsdp > 1:
        # (a scanned model's leading "layers" axis is never sharded: each layer's slice shards as a
        # block does)
        free = [d for d in range(len(shape))
                if spec[d] is None and shape[d] % fsdp == 0 and names[d] not in WHOLE_AXES]
        if free:
            spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return P(*spec)


def shard_axes(mesh, rows: int, heads: tuple[int, ...] = ()) -> tuple[tuple[str, ...], str | None]:
    """(the batch axes that split ``rows`` rows, the head axis when it splits every one of ``heads``) of
    ``mesh``: the axes with more than one device that are not already manual (inside an outer shard_map).
    Rows split over the batch axes only when their product divides ``rows``; none then."""
    sizes = dict(mesh.shape)
    usable = [a for a in sizes if a not in mesh.manual_axes and sizes[a] > 1]
    row_axes = tuple(a for a in BATCH_AXES if a in usable)
    if rows % math.prod(sizes[a] for a in row_axes):
        row_axes = ()
    head = HEAD_AXIS if HEAD_AXIS in usable and all(h % sizes[HEAD_AXIS] == 0 for h in heads) else None
    return row_axes, head


def check_experts(count: int, mesh: Mesh) -> None:
    """mesh.expert splits a mixture of experts' experts: it must divide their number (and needs experts)."""
    ways = mesh.shape.get(EXPERT_AXIS, 1)
    if ways > 1 and (not count or count % ways):
        raise ConfigError(f"mesh.expert: got {ways}, expected a divisor of model.experts.count={count}"
                          + (" (a model with experts)" if not count else ""))


def param_shardings(param_state: nnx.State, mesh: Mesh) -> dict:
    """NamedShardings (a pure dict, like the params the step sees) for the model's ``nnx.Param``
    state."""
    specs = jax.tree.map(
        lambda v: NamedSharding(mesh, param_spec(tuple(v.shape), getattr(v, "axes", None), mesh)),
        param_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.to_pure_dict(specs)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over data x fsdp, the sequence dimension whole (the module's docstring says why)."""
    return NamedSharding(mesh, activation_spec(("rows", None), mesh))


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


def global_batch(local: Batch, sharding: NamedSharding, process_count: int) -> Batch:
    """One global array per field from this process's rows ([B / process_count, L] each)."""
    out = {}
    for name, rows in local.items():
        shape = (rows.shape[0] * process_count, *rows.shape[1:])
        out[name] = jax.make_array_from_process_local_data(sharding, rows, shape)
    return out


def local_rows(batch: Batch, process_index: int, process_count: int) -> Batch:
    """This process's rows of a batch every process holds whole (an RL generation batch, made
    alike in each): the block :func:`global_batch` expects from it."""
    rows = len(next(iter(batch.values())))
    per = rows // process_count
    mine = slice(process_index * per, (process_index + 1) * per)
    return {name: value[mine] for name, value in batch.items()}


def check_batch_fits(batch_size: int, mesh: Mesh, grad_accum: int) -> None:
    """Each micro-batch's rows must split evenly over data x fsdp."""
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    micro = batch_size // grad_accum
    if micro % ways:
        raise ConfigError(
            f"data.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} rows per micro-batch, "
            f"expected a multiple of mesh data x fsdp = {ways}")
