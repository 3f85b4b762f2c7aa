"""QLoRA's frozen base (``model.lora.quantize``): the seven projections (and a mixture of experts'
experts) stored in int8 or nf4, dequantized per layer in the forward pass.

The arrays are qwix's quantized arrays (``qwix.quantize`` / ``qwix.dequantize``, Tunix's
quantization library): flax, whose ``nnx.LoRA`` holds the adapters, has no 4-bit storage. Only the
storage is qwix's; the adapters, the frozen/trained split and the train step are the ones plain LoRA
uses, so QLoRA is one setting of it.

- ``int8``: one float32 scale per output channel (absmax over the projection's input), 1 byte a
  weight.
- ``nf4``: QLoRA's 4-bit NormalFloat (Dettmers et al. 2023), one float32 scale per
  ``model.lora.quant_block`` inputs of each output channel (64, as bitsandbytes), half a byte a
  weight plus 4 / block bytes of scale. Unlike bitsandbytes the scales are not quantized again
  ("double quantization"): 0.06 bytes a weight more at block 64.

The embeddings, norms and head stay in ``model.param_dtype`` (as in QLoRA). A quantized weight lives
in its ``nnx.Param`` as a ``QArray`` (qvalue and scale; under ``model.scan_layers`` both with the
layer axis first, each layer quantized on its own), so the model's state, ``scan`` and the step's
frozen argument carry it unchanged; :func:`weight` is the one place a projection reads it back,
inside the block that uses it, so no more than the layer at hand is ever held at full precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from jax.sharding import NamedSharding

# Each frozen projection: (its module in the block, its parameter, the input axes it contracts) in
# the unstacked layout; the other axes are output channels, each with its own scales.
PROJECTIONS = (("attn", "wq", (0,)), ("attn", "wk", (0,)), ("attn", "wv", (0,)), ("attn", "wo", (0, 1)),
               ("mlp", "w_gate", (0,)), ("mlp", "w_up", (0,)), ("mlp", "w_down", (0,)),
               # a layer's experts ([E, in, out]): scales per expert and output channel
               ("mlp/experts", "w_gate", (1,)), ("mlp/experts", "w_up", (1,)), ("mlp/experts", "w_down", (1,)))


def weight(param, dtype) -> jax.Array:
    """A projection's weight in ``dtype``: the parameter as stored, or its dequantization under
    QLoRA."""
    value = param.get_value()
    if isinstance(value, qwix.QArray):
        value = qwix.dequantize(value)
    return value.astype(dtype)


def quantize(array: jax.Array, qtype: str, inputs: tuple[int, ...], block: int,
             stacked: bool) -> qwix.QArray:
    """One projection's weight as ``qtype``: scales per output channel (and per layer when
    ``stacked``), nf4's also per ``block`` of the last input axis (the whole axis when ``block``
    does not divide it)."""
    shift = 1 if stacked else 0
    inputs = tuple(a + shift for a in inputs)
    channels = tuple(a for a in range(array.ndim) if a not in inputs)
    tiles = {}
    if qtype == "nf4" and array.shape[inputs[-1]] % block == 0 and array.shape[inputs[-1]] > block:
        tiles = {inputs[-1]: block}
    # float32 scales whatever the weight's dtype (bfloat16 scales would add their own rounding to
    # every weight)
    return qwix.quantize(jnp.asarray(array, jnp.float32), qtype, channelwise_axes=channels,
                         tiled_axes=tiles or None)


def quantize_base(params: dict, qtype: str, block: int, stacked: bool) -> dict:
    """The frozen base (a pure dict, as ``split_params`` gives it) with its projections quantized;
    the rest as is."""
    if qtype == "none":
        return params
    out = jax.tree.map(lambda a: a, params)  # a new dict tree: the caller's stays as it was

    def convert(block_params: dict) -> None:
        for module, name, inputs in PROJECTIONS:
            holder = block_params
            for key in module.split("/"):
                holder = holder.get(key, {}) if isinstance(holder, dict) else {}
            if name in holder:
                holder[name] = quantize(holder[name], qtype, inputs, block, stacked)

    blocks = out["blocks"]
    if stacked:
        convert(blocks)
    else:
        for layer in blocks.values():
            convert(layer)
    return out


def shardings(plain: Any, quantized: Any, replicated: NamedSharding) -> Any:
    """Shardings for a quantized base from those of its plain arrays: a qvalue as its weight was,
    its scales replicated (they are 1/block of the weight's entries, and a tiled axis need not
    divide the mesh)."""

    def one(sharding, value):
        if isinstance(value, qwix.QArray):
            return dataclasses.replace(value, qvalue=sharding, scale=replicated,
                                       zero_point=None if value.zero_point is None else replicated)
        return sharding

    return jax.tree.map(one, plain, quantized,
                        is_leaf=lambda x: isinstance(x, (NamedSharding, qwix.QArray)))


def dequantize_base(params: dict, dtype) -> dict:
    """The base with every quantized weight read back as ``dtype`` (what a merged export folds
    adapters into)."""
    return jax.tree.map(
        lambda v: qwix.dequantize(v).astype(dtype)
        if isinstance(v, qwix.QArray) else v, params, is_leaf=lambda x: isinstance(x, qwix.QArray))


def bits(dtype) -> int:
    """Bits a value of ``dtype`` takes as stored (4 for int4/uint4, which XLA packs two a byte on a
    GPU)."""
    dtype = jnp.dtype(dtype)
    return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else dtype.itemsize * 8


def stored_bytes(params: Any) -> int:
    """Bytes a tree of arrays takes as stored (4-bit values half a byte)."""
    return sum(leaf.size * bits(leaf.dtype) // 8 for leaf in jax.tree.leaves(params))
