"""Rotary position embeddings (RoPE): each layer's frequencies, stretched as ``model.rope_scaling``
says, and the rotation of q and k at the batch's ``positions`` ("rotate half" layout, as Hugging
Face's checkpoints are)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from seqjax.config.model import RopeScalingConfig


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScalingConfig | None = None) -> jax.Array:
    """The ``head_dim // 2`` rotation frequencies theta^(-i / half), float32, stretched as
    ``scaling`` asks.

    ``linear`` (Gemma 3's global layers): every frequency divided by ``factor``.
    ``llama3`` (Llama 3.1): with wavelength w = 2 pi / f and L the pretraining
    context, a frequency with w < L / high_freq_factor is kept, one with
    w > L / low_freq_factor is divided by ``factor``, and one in between is
    mixed from both by s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
    (1 - s) f / factor + s f.
    """
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None or scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":  # positions interpolated: every frequency slowed alike
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    slowed = inv_freq / scaling.factor
    mix = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor -
                                                              scaling.low_freq_factor)
    scaled = jnp.where(wavelength > context / scaling.low_freq_factor, slowed,
                       (1 - mix) * slowed + mix * inv_freq)
    return jnp.where(wavelength < context / scaling.high_freq_factor, inv_freq, scaled)


def _yarn(inv_freq: jax.Array, head_dim: int, theta: float, scaling: RopeScalingConfig) -> jax.Array:
    """YaRN's frequencies, as transformers computes them: the fast ones kept, the slow ones divided by
    ``factor``, and a linear ramp between the frequency indices where a wave turns ``beta_fast`` and
    ``beta_slow`` times within the pretraining context (rounded out to whole indices under ``truncate``)."""
    context = scaling.original_max_position_embeddings

    def index(rotations):  # the frequency index at which a wave turns this many times in the context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp
    return (inv_freq / scaling.factor) * (1.0 - kept) + inv_freq * kept


def rope_attention_factor(scaling: RopeScalingConfig | None) -> float:
    """The factor YaRN scales cos and sin by (its ``attention_factor``, else 0.1 ln(factor) + 1); 1 for the
    other scalings."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary embedding of x [B, T, H, Dh] at ``positions`` [B, T] ("rotate half" layout), in
    float32.

    Driven by the batch's positions rather than the row index, so each packed
    segment is rotated as if it started the row. ``inv_freq`` [Dh / 2]: the layer's
    frequencies (:func:`rope_frequencies`; fewer than Dh / 2: only the first 2 x that many dims
    turn, Qwen3.5's partial RoPE). ``positions`` may also be [B, T, Dh / 2], a position
    per frequency: multimodal RoPE (:func:`mrope_positions`), where each frequency follows one of
    an image token's time, row and column.
    """
    per_frequency = positions if positions.ndim == 3 else positions[:, :, None]
    angles = per_frequency.astype(jnp.float32)[:, :, None, :] * inv_freq  # [B, T, 1, half]
    cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale  # (scale: YaRN's attention factor)
    # (partial RoPE, model.rope_fraction: the first dims turn, the rest pass)
    turned = 2 * inv_freq.shape[-1]
    x1, x2 = jnp.split(x[..., :turned].astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if turned == x.shape[-1] else jnp.concatenate([out, x[..., turned:]], axis=-1)


def mrope_axes(half: int, section: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """Which of (time, row, column) each of ``half`` frequencies follows: Qwen3-VL's interleaved
    layout (frequency j follows the row when j % 3 == 1 and j < 3 * section[1], the column when
    j % 3 == 2 and j < 3 * section[2], else time); Qwen2.5-VL's contiguous one (the first
    section[0] frequencies time, the next section[1] rows, the rest columns).

    >>> mrope_axes(8, (2, 3, 3), True).tolist()
    [0, 1, 2, 0, 1, 2, 0, 1]
    """
    if sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} sums to {sum(section)}, expected head_dim / 2 = {half}")
    if not interleaved:
        return np.repeat(np.arange(3), section)
    axes = np.zeros(half, np.int32)
    for axis, offset in ((1, 1), (2, 2)):
        axes[offset:3 * section[axis]:3] = axis
    return axes


def mrope_positions(positions_3d: jax.Array, axes) -> jax.Array:
    """[B, T, 3] (time, row, column) positions -> [B, T, half], each frequency's (for :func:`rope`)."""
    return jnp.take(positions_3d, jnp.asarray(axes), axis=-1)
