"""``model.deltanet``: the sizes of the Gated DeltaNet layers (Qwen3.5's linear attention) that
``model.layer_types`` places with ``linear`` (seqjax.model.deltanet computes them;
docs/model.md, "Gated DeltaNet")."""

from __future__ import annotations

from dataclasses import dataclass

from seqjax.config.fields import MODEL, setting
from seqjax.core.errors import ConfigError


@dataclass(frozen=True)  # hashable: the model keeps it as static graph data
class DeltaNetConfig:
    """``model.deltanet``: each ``linear`` layer's heads and widths (transformers' ``linear_*``
    fields), its convolution's width and the chunk of the training form."""

    key_heads: int = setting(0, "query and key heads (linear_num_key_heads; 0: no linear layers)", min=0,
                             resume=MODEL)
    value_heads: int = setting(0, "value heads, a multiple of key_heads (linear_num_value_heads)", min=0,
                               resume=MODEL)
    key_dim: int = setting(128, "each query and key head's width (linear_key_head_dim)", min=1, resume=MODEL)
    value_dim: int = setting(128, "each value head's width (linear_value_head_dim)", min=1, resume=MODEL)
    conv_width: int = setting(4, "the causal convolution's taps (linear_conv_kernel_dim)", min=1, resume=MODEL)
    chunk: int = setting(64, "tokens a chunk of the training form holds (any size computes the same, to "
                             "float32 rounding)", min=1)
    kernel: str = setting(
        "auto", "the chunked form's scan over chunks: xla (one lax.scan), pallas (one Pallas "
        "kernel, the state in registers: Triton on a GPU, interpreted elsewhere), auto (xla "
        "until a GPU measures the kernel faster)",
        choices=("auto", "xla", "pallas"))

    @property
    def scan(self) -> str:
        """``kernel`` resolved: auto is xla (the kernel is built and checked, not yet timed on a
        GPU)."""
        return "xla" if self.kernel == "auto" else self.kernel

    @property
    def enabled(self) -> bool:
        return self.key_heads > 0

    @property
    def value_width(self) -> int:
        """The value heads' width together (in_proj_z's and out_proj's)."""
        return self.value_heads * self.value_dim

    @property
    def qkv_width(self) -> int:
        """The query, key and value heads' width together (in_proj_qkv's, the convolution's channels)."""
        return 2 * self.key_heads * self.key_dim + self.value_width

    def check(self, layer_types: list[str]) -> None:
        if "linear" in layer_types and not self.enabled:
            raise ConfigError("model.layer_types: got linear layers with model.deltanet.key_heads=0; "
                              "expected the Gated DeltaNet's heads (model.deltanet.key_heads and value_heads)")
        if self.enabled and (self.value_heads < self.key_heads or self.value_heads % self.key_heads):
            raise ConfigError(f"model.deltanet.value_heads: got {self.value_heads}, expected a multiple of "
                              f"model.deltanet.key_heads={self.key_heads}")
