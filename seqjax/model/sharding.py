"""The device mesh and how arrays lie on it: axis names, the mesh from ``mesh.*``, parameter and
batch shardings.

It sits below the model (it imports only the config): the model's attention
reads :data:`BATCH_AXES` and :data:`HEAD_AXIS` to run its kernels once per
device shard, and training and evaluation place parameters and batches with
the rules here.

The mesh has four named axes:

- ``data``: plain data parallelism (parameters replicated);
- ``fsdp``: data parallelism whose parameters and optimizer state are split
  across the axis (each parameter over its largest dimension divisible by the
  axis size);
- ``context``: context parallelism: each row's tokens split over the axis
  (seqjax.model.context; parameters replicated);
- ``tensor``: Megatron-style tensor parallelism over attention heads and the
  MLP's hidden width ``d_ff``.

Parameters follow :func:`param_spec`; activations follow one rule table,
:data:`ACTIVATION_RULES` (a logical dimension -> the mesh axes that split it),
and :func:`activation_spec`. Batches are split over ``data x fsdp`` on their
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

AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over these
CONTEXT_AXIS = "context"  # a row's tokens are split over this one
HEAD_AXIS = "tensor"  # attention heads (and d_ff) are split over this one

# Activations: each logical dimension -> the mesh axes that split it (param_spec's counterpart for
# the values between layers). A batch field is ("rows", None): its tokens whole (see above).
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "rows": BATCH_AXES, "tokens": (CONTEXT_AXIS,), "heads": (HEAD_AXIS,), "kv_heads": (HEAD_AXIS,),
    "embed": (), "head_dim": (), "vocab": (),
}

# Logical axis names (the ``axes`` metadata of the model's nnx.Params) split by the tensor axis.
TENSOR_AXES = ("heads", "kv_heads", "ff")
# ... and those fsdp never splits (param_spec says why).
WHOLE_AXES = ("layers", "head_dim", "lora_rank")


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, context, tensor) sizes, with a -1 axis filled by the devices the others
    leave."""
    sizes = [mesh.data, mesh.fsdp, mesh.context, mesh.tensor]
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
            f"{described}: data x fsdp x context x tensor = {math.prod(sizes)}, expected the {num_devices} "
            "available devices (set one axis to -1 to fill the rest)")
    return tuple(sizes)


def build_mesh(mesh: MeshConfig, devices: list | None = None) -> Mesh:
    """The (data, fsdp, context, tensor) mesh over all devices of all processes."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(mesh, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices)


def activation_spec(dims: tuple[str | None, ...], mesh: Mesh) -> P:
    """A PartitionSpec for an activation whose dimensions have these logical names
    (:data:`ACTIVATION_RULES`; None: whole), over the rule's axes that the mesh has."""
    def axes(name):
        kept = tuple(a for a in ACTIVATION_RULES[name] if a in mesh.shape) if name else ()
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return P(*map(axes, dims))


def param_spec(shape: tuple[int, ...], axes: tuple[str, ...] | None, mesh: Mesh) -> P:
    """One parameter's PartitionSpec from its shape and logical axis names.

    ``tensor`` takes the first dimension named heads, kv_heads or ff (when the
    axis size divides it: a GQA model with fewer kv heads than tensor devices
    keeps wk/wv whole on that axis); ``fsdp`` takes the largest remaining
    dimension it divides, never a scanned model's ``layers``, a ``head_dim`` or
    a LoRA adapter's ``lora_rank``. Anything left is replicated.

    Why not ``head_dim``: the activations never split a head's dimensions, and a
    parameter that does makes XLA's partitioner lay the queries and keys out to
    match. Qwen's q/k/v biases ``[heads, head_dim]`` and Qwen3's q/k norms
    ``[head_dim]`` did: Qwen3-8B's step under fsdp=8 planned 111.5 GB of
    temporaries a device, 30.8 GB with the norms whole (BENCHMARKS.md, "Memory
    plans: the families and LoRA"). A rank dimension is the contraction between
    an adapter's A and B, which the activations never split either.
    """
    spec: list[Any] = [None] * len(shape)
    tensor, fsdp = mesh.shape[HEAD_AXIS], mesh.shape["fsdp"]
    if tensor > 1:
        for dim, name in enumerate(axes or ()):
            if name in TENSOR_AXES and shape[dim] % tensor == 0:
                spec[dim] = HEAD_AXIS
                break
    if fsdp > 1:
        # (a scanned model's leading "layers" axis is never sharded: each layer's slice shards as a
        # block does)
        names = (*(axes or ()), *[None] * len(shape))
        free = [d for d in range(len(shape))
                if spec[d] is None and shape[d] % fsdp == 0 and names[d] not in WHOLE_AXES]
        if free:
            spec[max(free, key=lambda d: shape[d])] = "fsdp"
    return P(*spec)


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


def check_batch_fits(batch_size: int, mesh: Mesh, grad_accum: int) -> None:
    """Each micro-batch's rows must split evenly over data x fsdp."""
    ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
    micro = batch_size // grad_accum
    if micro % ways:
        raise ConfigError(
            f"data.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} rows per micro-batch, "
            f"expected a multiple of mesh data x fsdp = {ways}")
