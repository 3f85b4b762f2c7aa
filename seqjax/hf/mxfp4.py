"""gpt-oss's MXFP4 experts, dequantized on import (transformers' ``convert_moe_packed_tensors`` is
the reference).

A checkpoint whose config.json says ``quantization_config: {quant_method: mxfp4}`` stores each
expert tensor X ([E, rows, columns] in the unquantized layout's transpose) as ``X_blocks`` [E,
rows, G, 16] uint8, two 4-bit E2M1 values a byte (the low nibble first), and ``X_scales`` [E,
rows, G] uint8, one power-of-two exponent (biased by 127) per block of 32 values. Dequantized:
each value looked up in :data:`FP4_VALUES`, times 2^(scale - 127), the 32-value blocks of a row
joined, and the last two axes swapped ([E, columns, rows]: the layout gate_up_proj and down_proj
have unquantized)."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from seqjax.core.errors import CheckpointError

# E2M1: the sixteen values a nibble codes (transformers' FP4_VALUES)
FP4_VALUES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[E, rows, G, 16] uint8 blocks and [E, rows, G] uint8 scales -> float32 [E, G * 32, rows]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.int32) - 127
    if blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"mxfp4: blocks of shape {blocks.shape} and scales of shape "
                              f"{scales.shape}; expected blocks [..., G, 16] beside scales [..., "
                              "G]")
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales[..., None])
    values = values.reshape(*values.shape[:-2], -1)  # [E, rows, G * 32]
    return np.swapaxes(values, -1, -2)


def dequantizing(read: Callable[[str], np.ndarray], names: Iterable[str]) -> tuple[Callable, list[str]]:
    """(read, names) of a folder whose quantized tensors appear under their unquantized names:
    ``read("X")`` dequantizes ``X_blocks`` and ``X_scales``; every other name reads as it is."""
    names = list(names)
    packed = {n[:-len("_blocks")] for n in names if n.endswith("_blocks") and n[:-len("_blocks")] + "_scales"
              in names}

    def read_one(name: str) -> np.ndarray:
        if name in packed:
            return dequantize(read(name + "_blocks"), read(name + "_scales"))
        return read(name)

    kept = [n for n in names if not (n.endswith(SUFFIXES) and n[:-len("_blocks")] in packed)]
    return read_one, sorted({*kept, *packed})
