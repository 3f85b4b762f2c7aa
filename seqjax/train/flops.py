"""Training FLOPs per token and model FLOPs utilization (MFU).

The count (PaLM, appendix B; Chinchilla's approximation)::

    flops_per_token = 6 * N + 12 * L * H * D * T

- ``N``: parameters that multiply an activation: every parameter except the
  input-embedding table (a lookup), plus the LM head (which *is* the table
  when embeddings are tied). ``6 = 2`` (multiply-add) ``x 3`` (forward, and a
  backward twice as costly).
- ``12 * L * H * D * T``: attention scores ``Q K^T`` and the weighted sum
  ``A V``, ``2 * T * D`` FLOPs each per head and token in the forward pass, times
  3 for training; ``L`` layers, ``H`` query heads of width ``D``, rows of ``T``
  tokens. The full ``T x T`` square is counted (no causal discount), as PaLM
  does, because dense attention computes it; packing does not change it.

A frozen weight (the base under ``model.lora``) costs 4 FLOPs a token, not 6:
its backward pass computes the gradient of the activation and none of its
own. With ``N_t`` of the ``N`` trained, ``6 * N`` becomes ``4 * N + 2 * N_t``.

MFU = achieved model FLOP/s / (devices x peak FLOP/s per device). The peak is
``train.peak_flops`` when set, else the dense bf16 tensor-core peak of a known
accelerator. On a CPU there is no trustworthy peak, so MFU is reported as
null unless ``train.peak_flops`` states one (then it is relative to that
assumed number, not a hardware fact).
"""

from __future__ import annotations

import jax

from seqjax.config.tree import ModelConfig

# Dense bf16 peak FLOP/s per device from vendor datasheets (no sparsity).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}


def matmul_params(num_params: int, model: ModelConfig, vocab_size: int) -> int:
    """``N`` above: all parameters minus the embedding lookup table, plus the LM head matmul."""
    table = vocab_size * model.d_model
    return num_params if model.tie_embeddings else num_params - table


def flops_per_token(model: ModelConfig, seq_len: int, num_params: int, vocab_size: int,
                    trained: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), by the formula in the module docstring:
    ``num_params`` every parameter of the model, ``trained`` those that train (None: all)."""
    n = matmul_params(num_params, model, vocab_size)
    n_trained = n if trained is None else min(trained, n)
    return 4.0 * n + 2.0 * n_trained + 12.0 * model.n_layers * model.n_heads * model.head_dim * seq_len


def peak_flops_per_device(device: jax.Device | None = None,
                          override: float | None = None) -> float | None:
    """The configured peak, else the table's entry for this device kind, else None (e.g. CPU)."""
    if override is not None:
        return override
    device = device or jax.devices()[0]
    kind = device.device_kind
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_tok: float, num_devices: int,
        peak: float | None) -> float | None:
    """Fraction of the devices' peak the model FLOPs reach; None when no peak is known."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s * flops_per_tok / (num_devices * peak)
