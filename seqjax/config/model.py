"""``model.*``: the Transformer's shape, the families' settings, RoPE, dropout, backends, and
``model.lora`` (one section of the config tree, :mod:`seqjax.config.tree`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from seqjax.config.deltanet import DeltaNetConfig
from seqjax.config.experts import ExpertsConfig
from seqjax.config.fields import MODEL, setting
from seqjax.config.vision import VisionConfig
from seqjax.core.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "cudnn_packed", "pallas", "pallas_mosaic", "splash")
# the backends that compute attention over a row split on mesh.context (seqjax.model.context)
SPLIT_ROW_BACKENDS = ("xla", "pallas", "auto")
DTYPES = ("float32", "bfloat16")
ROPE_SCALING_TYPES = ("none", "linear", "llama3", "yarn")
# The Hugging Face architectures seqjax reads and writes (seqjax.hf.families holds each one's
# tables).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss",
            "qwen3_5", "qwen3_5_moe")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding", "linear")
REMAT_POLICIES = ("none", "full", "dots", "names")
# The activations a block tags with jax.ad_checkpoint.checkpoint_name (model.remat=names keeps those
# listed).
REMAT_NAMES = ("q", "k", "v", "attn_out", "mlp_in", "mlp_out")


@dataclass(frozen=True)  # hashable: the model keeps it as static graph data
class RopeScalingConfig:
    """How RoPE's frequencies are stretched for contexts longer than pretraining's (Llama 3.1's
    ``rope_scaling``).

    ``llama3`` keeps the high frequencies (wavelengths below
    original_max_position_embeddings / high_freq_factor), divides the low ones
    (wavelengths above original_max_position_embeddings / low_freq_factor) by
    ``factor``, and interpolates smoothly in between.
    """

    # Each of these changes the function the model computes, so a resume under a change is a model
    # change.
    type: str = setting(
        "none",
        "none: plain RoPE; linear: every frequency divided by factor (positions interpolated, "
        "Gemma 3's global layers); llama3: Llama 3.1's frequency scaling; yarn: YaRN's (gpt-oss)",
        choices=ROPE_SCALING_TYPES, resume=MODEL)
    factor: float = setting(8.0, "linear, llama3: how much the (low) frequencies are slowed",
                            min=1.0, resume=MODEL)
    low_freq_factor: float = setting(
        1.0, "llama3: wavelengths above original / low_freq_factor are divided by factor", min=0.0,
        resume=MODEL)
    high_freq_factor: float = setting(
        4.0, "llama3: wavelengths below original / high_freq_factor are kept", min=0.0,
        resume=MODEL)
    original_max_position_embeddings: int = setting(8192,
                                                    "llama3, yarn: the context length of "
                                                    "pretraining",
                                                    min=1, resume=MODEL)
    beta_fast: float = setting(32.0, "yarn: rotations within the context above which a frequency "
                                     "is kept",
                               min=0.0, resume=MODEL)
    beta_slow: float = setting(1.0, "yarn: rotations below which a frequency is divided "
                                    "by factor", min=0.0,
                               resume=MODEL)
    truncate: bool = setting(True, "yarn: the ramp's ends rounded to whole frequencies "
                                   "(transformers' truncate)",
                             resume=MODEL)
    attention_factor: float | None = setting(
        None, "yarn: cos and sin scaled by this (null: 0.1 ln(factor) + "
              "1, YaRN's)", min=0.0, resume=MODEL)

    def check(self) -> None:
        # (linear: factor only)
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor: got {self.high_freq_factor}, expected more "
                f"than model.rope_scaling.low_freq_factor={self.low_freq_factor} (and both above "
                "0)")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts_gate_up", "experts_down", "in_proj_qkv",
                "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# the targets model.lora.targets holds unless named: the seven projections (a model with experts
# adapts them only where PEFT's target_parameters name them: experts_gate_up, experts_down; a Gated
# DeltaNet's five, transformers' and PEFT's names, only where named)
DEFAULT_TARGETS = LORA_TARGETS[:7]
# PEFT's names of the same projections (its target_modules, and target_parameters for the experts),
# accepted beside seqjax's.
PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
                "up_proj": "up", "down_proj": "down", "mlp.experts.gate_up_proj": "experts_gate_up",
                "mlp.experts.down_proj": "experts_down"}
# model.lora.modules_to_save: the whole modules that train beside the adapters (PEFT's names too).
SAVED_MODULES = ("embed", "head")
PEFT_SAVED = {"embed_tokens": "embed", "lm_head": "head"}
LORA_INITS = ("peft", "gaussian", "flax")


@dataclass
class LoraConfig:
    """Low-rank adapters (``model.lora``): the base frozen, each target projection W used as W +
    s A B with s = alpha / rank (alpha / sqrt(rank) under ``rslora``), or, under ``dora``, as DoRA's
    m (W + s A B) / ||W + s A B|| (a magnitude per output, the norm over inputs).

    Every adapter starts at B = 0, so a new adapter changes nothing; only the adapters (and
    ``modules_to_save``) get gradients, optimizer state and checkpoints. ``rank: 0`` is off (every
    weight trains). These are PEFT's settings by its own names in parentheses, and an adapter
    trained under them exports to a folder peft loads (seqjax.hf.peft).
    """

    rank: int = setting(0, "adapter rank r (0: no adapters, every weight trains)", min=0,
                        resume=MODEL)
    alpha: float = setting(16.0, "the adapters are scaled by alpha / rank (PEFT's lora_alpha)",
                           min=0.0, resume=MODEL)
    dropout: float = setting(
        0.0, "training only: dropout on each adapter's input (PEFT's lora_dropout)", min=0.0)
    targets: list[str] = setting(
        list(DEFAULT_TARGETS), "the projections that get adapters, of q, k, v, o, gate, up, down, a mixture "
        "of experts' experts_gate_up, experts_down, and a Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b, "
        "in_proj_a, out_proj (or PEFT's names q_proj, ..., down_proj, mlp.experts.gate_up_proj, "
        "mlp.experts.down_proj)", resume=MODEL)
    rslora: bool = setting(
        False, "rank-stabilized LoRA: scale by alpha / sqrt(rank) instead of alpha / rank (PEFT's "
        "use_rslora)", resume=MODEL)
    dora: bool = setting(
        False, "DoRA: each adapted weight is a trained magnitude per output times the direction of "
        "W + s A B (PEFT's use_dora); costs a weight-sized norm per projection per step", resume=MODEL)
    init: str = setting(
        "peft", "how A starts (B starts at 0 in all): peft: PEFT's default, uniform within "
        "1/sqrt(inputs); gaussian: normal with std 1/rank (PEFT's init_lora_weights=gaussian); "
        "flax: nnx.LoRA's he_uniform, sqrt(6) times PEFT's bound", choices=LORA_INITS)
    modules_to_save: list[str] = setting(
        [], "whole modules that train beside the adapters: embed, head (or PEFT's embed_tokens, "
        "lm_head); on tied embeddings, embed trains both", resume=MODEL)
    quantize: str = setting(
        "none", "QLoRA: the frozen base's projections stored as int8 (per-channel scales) or nf4 "
        "(4-bit NormalFloat, per-block scales), dequantized per layer in the forward pass",
        choices=("none", "int8", "nf4"), resume=MODEL)
    quant_block: int = setting(
        64,
        "nf4: inputs per scale block of each output channel (bitsandbytes' 64); it must divide "
        "each input width larger than it, and a narrower one is one block", min=2, resume=MODEL)

    def check(self) -> None:
        """The rules of model.lora; PEFT's names in targets and modules_to_save become seqjax's."""
        self.targets = [PEFT_TARGETS.get(name, name) for name in self.targets]
        self.modules_to_save = [PEFT_SAVED.get(name, name) for name in self.modules_to_save]
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        if unknown:
            raise ConfigError(
                f"model.lora.targets: got {unknown[0]!r}, expected names from {list(LORA_TARGETS)} "
                f"or {list(PEFT_TARGETS)}")
        unknown = [name for name in self.modules_to_save if name not in SAVED_MODULES]
        if unknown:
            raise ConfigError(
                f"model.lora.modules_to_save: got {unknown[0]!r}, expected names from "
                f"{list(SAVED_MODULES)} or {list(PEFT_SAVED)}")
        if self.rank and not self.targets:
            raise ConfigError(
                "model.lora.targets: got [], expected at least one projection with "
                "model.lora.rank > 0"
            )
        if not self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: got {self.dropout}, expected a rate in [0, 1)")
        experts = [t for t in self.targets if t.startswith("experts_")]
        for key, value in (("dropout", self.dropout), ("dora", self.dora)):
            if experts and value:
                raise ConfigError(f"model.lora.{key}: got {value} with the experts adapted "
                                  f"({experts}); expected {0.0 if key == 'dropout' else False} "
                                  "(PEFT's target_parameters refuse it too)")
        for key in ("quantize", "modules_to_save", "dora", "rslora"):
            if getattr(self, key) not in ("none", [], False) and not self.rank:
                raise ConfigError(
                    f"model.lora.{key}: got {getattr(self, key)!r} with model.lora.rank 0; it "
                    "belongs to adapters (set model.lora.rank)")

    @property
    def scale(self) -> float:
        """s of W + s A B: alpha / rank, or alpha / sqrt(rank) under rslora."""
        if not self.rank:
            return 0.0
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


@dataclass
class ModelConfig:
    # Keys that change parameter shapes are marked too, though a checkpoint's own array shapes are
    # what decides.
    vocab_size: int | None = setting(None,
                                     "embedding rows (default: the tokenizer's vocabulary size)",
                                     min=2, resume=MODEL)
    d_model: int = setting(256, "residual width", min=1, resume=MODEL)
    n_layers: int = setting(4, "Transformer blocks", min=1, resume=MODEL)
    n_heads: int = setting(4, "query heads", min=1, resume=MODEL)
    n_kv_heads: int | None = setting(
        None, "key/value heads for grouped-query attention (default: n_heads)", min=1, resume=MODEL)
    head_dim: int | None = setting(
        None,
        "width of each attention head (null: d_model // n_heads, filled in when the config is "
        "checked)",
        min=2,
        resume=MODEL,
    )
    d_ff: int = setting(768, "SwiGLU hidden width", min=1, resume=MODEL)
    max_seq_len: int | None = setting(
        None,
        "longest sequence the model accepts (null: follows data.seq_len, or eval.context when "
        "longer)",
        min=1,
    )
    rope_theta: float = setting(10000.0, "RoPE base frequency", min=1.0, resume=MODEL)
    rope_scaling: RopeScalingConfig = field(
        default_factory=RopeScalingConfig,
        metadata={
            "help": "RoPE frequency scaling for long contexts: model.rope_scaling.type and its "
                    "factors"
        },
    )
    norm_eps: float = setting(1e-6, "RMSNorm epsilon (Llama checkpoints use 1e-5)", min=0.0,
                              resume=MODEL)
    tie_embeddings: bool = setting(True, "share the token embedding with the LM head", resume=MODEL)
    param_dtype: str = setting("float32", "parameter storage dtype", choices=DTYPES, resume=MODEL)
    compute_dtype: str = setting("float32",
                                 "matmul/activation dtype (softmax and loss stay float32)",
                                 choices=DTYPES, resume=MODEL)
    matmul_precision: str = setting(
        "default", "float32 matmuls: default keeps JAX's choice (TF32 on an NVIDIA GPU, full float32 on a CPU), "
        "highest computes them in true float32 on every device (slower on a GPU; docs/gpu.md)",
        choices=("default", "high", "highest"))
    attention: str = setting("auto", "attention backend", choices=ATTENTION_BACKENDS)
    context_attention: str = setting(
        "all_gather", "mesh.context > 1: how keys and values reach every query shard: all_gather (each device "
        "gathers the row's K/V once a layer) or ring (passed device to device, overlapped with compute; "
        "docs/scale.md)", choices=("all_gather", "ring"))
    remat: str = setting(
        "none",
        "rematerialization of each block in the backward pass: none (keep every activation), full "
        "(keep only each block's input, recompute the rest), dots (keep the matmul outputs, "
        "recompute the rest), names (keep the activations model.remat_names lists)",
        choices=REMAT_POLICIES,
    )
    remat_names: list[str] = setting(
        ["attn_out", "mlp_out"],
        f"remat=names: the tagged activations to keep, of {list(REMAT_NAMES)}",
    )
    scan_layers: bool = setting(
        False,
        "stack the blocks' parameters [n_layers, ...] and run them under jax.lax.scan: compile "
        "time flat in depth (checkpoints keep their layout; eval, export and "
        "init_from convert)", resume=MODEL)
    loss_chunk_tokens: int = setting(
        0,
        "the LM head and the cross-entropy a chunk of this many tokens at a time, inside one "
        "custom VJP, so the [tokens, vocab] float32 logits never exist whole (0: off, the plain "
        "path)",
        min=0,
    )
    init_std: float = setting(
        0.02, "std of the normal init (residual projections scaled by 1/sqrt(2*n_layers))", min=0.0)
    dropout: float = setting(
        0.0,
        "training only: dropout rate on the token embeddings and on each residual branch (after "
        "attention, after the MLP); evaluation and generation never drop",
        min=0.0,
    )
    token_dropout: float = setting(
        0.0,
        "training only: the chance that a token's whole input embedding is zeroed (the rest "
        "scaled up), a data augmentation that small corpora such as WikiText-2 need",
        min=0.0,
    )
    attention_dropout: float = setting(
        0.0,
        "training only: dropout rate on the attention probabilities; only the xla backend has it "
        "(auto then picks xla), so pallas, cudnn and splash refuse it",
        min=0.0,
    )

    # What differs between the families (each false/null/empty is Llama's choice):
    # seqjax.hf.families sets them from a config.json; a family is these settings, not a second
    # model.
    family: str = setting(
        "llama",
        "the Hugging Face architecture export writes (llama, mistral, qwen2, qwen3, gemma3); "
        "the keys below say what the model computes", choices=FAMILIES, resume=MODEL)
    qkv_bias: bool = setting(False, "biases on the q, k and v projections (Qwen2)", resume=MODEL)
    qk_norm: bool = setting(False, "RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)",
                            resume=MODEL)
    norm_plus_one: bool = setting(
        False, "every RMSNorm multiplies by (1 + scale), its scales starting at 0 (Gemma)",
        resume=MODEL)
    post_norms: bool = setting(
        False, "each branch's output normed before the residual add: four norms a block (Gemma 3)",
        resume=MODEL)
    mlp_activation: str = setting(
        "silu", "the gated MLP's activation: silu (SwiGLU), gelu_tanh (GeGLU, Gemma)",
        choices=MLP_ACTIVATIONS, resume=MODEL)
    embed_scale: bool = setting(False, "token embeddings multiplied by sqrt(d_model) (Gemma)",
                                resume=MODEL)
    query_pre_attn_scalar: float | None = setting(
        None, "attention scores scaled by this ** -0.5 (null: head_dim ** -0.5; Gemma 3 sets it)",
        min=1.0, resume=MODEL)
    sliding_window: int | None = setting(
        None,
        "sliding layers: a query attends to the keys of its own segment at most this many "
        "positions back, itself included (Mistral; Gemma 3's local layers)", min=1, resume=MODEL)
    layer_types: list[str] = setting(
        [],
        "each layer's attention, full or sliding (Gemma 3 interleaves them), or linear (a Gated "
        "DeltaNet: model.deltanet); empty: every layer sliding when model.sliding_window is set, else "
        "full", resume=MODEL)
    lora: LoraConfig = field(
        default_factory=LoraConfig, metadata={
            "help": "low-rank adapters on the projections (model.lora.rank > 0): the base frozen, "
                    "only adapters train"
        })
    rope_local_theta: float | None = setting(
        None,
        "RoPE base of the sliding layers, which take no rope_scaling (Gemma 3's "
        "rope_local_base_freq; null: rope_theta and rope_scaling for "
        "every layer)", min=1.0, resume=MODEL)

    vision: VisionConfig = field(
        default_factory=VisionConfig, metadata={
            "help": "a vision tower (Qwen3-VL's) whose image tokens replace the text's image-pad "
                    "tokens (model.vision.depth > 0; docs/vision.md)"
        })
    mrope_section: list[int] = setting(
        [], "multimodal RoPE (Qwen3-VL): how many of each head's rotary frequencies turn with the time, row "
        "and column positions (three sizes summing to head_dim / 2); empty: one position per token",
        resume=MODEL)
    experts: ExpertsConfig = field(
        default_factory=ExpertsConfig, metadata={
            "help": "a mixture of experts in place of the gated MLP (model.experts.count > 0; "
                    "docs/model.md)"
        })
    deltanet: DeltaNetConfig = field(
        default_factory=DeltaNetConfig, metadata={
            "help": "the Gated DeltaNet layers model.layer_types places with linear (Qwen3.5's linear "
                    "attention; docs/model.md)"})
    attention_sinks: bool = setting(
        False, "a learned logit per head taken into every query's softmax, attending to nothing "
               "(gpt-oss)",
        resume=MODEL)
    attn_out_bias: bool = setting(False, "a bias on the attention's output "
                                         "projection (gpt-oss)", resume=MODEL)
    attention_gate: bool = setting(
        False, "each head's query projection doubled to [query | gate], the attention's output "
        "times sigmoid(gate) (Qwen3.5)", resume=MODEL)
    rope_fraction: float = setting(
        1.0, "the share of each head's dims RoPE turns, the first ones (partial_rotary_factor; "
        "Qwen3.5: 0.25)", min=0.0, resume=MODEL)
    mrope_interleaved: bool = setting(
        True, "with mrope_section: the three axes' frequencies interleaved (Qwen3-VL), else in three runs "
        "(Qwen2-VL)", resume=MODEL)

    def mlp_of(self, layer: int) -> str:
        """Layer ``layer``'s MLP: a row of :data:`seqjax.model.mlp.MLPS` (experts, or the gated
        MLP)."""
        return "experts" if self.experts.enabled and layer not in self.experts.dense_layers else "gated"

    def mixer_of(self, layer: int) -> str:
        """Layer ``layer``'s token mixer: a row of :data:`seqjax.model.block.MIXERS`."""
        return "deltanet" if self.layer_types and self.layer_types[layer] == "linear" else "attention"

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to its whole segment."""
        kind = self.layer_types[layer] if self.layer_types else (
            "sliding" if self.sliding_window else "full")
        return self.sliding_window if kind == "sliding" else None

    @property
    def has_windows(self) -> bool:
        return any(self.window_of(i) is not None for i in range(self.n_layers))

    def rope_of(self, layer: int) -> tuple[float, "RopeScalingConfig | None"]:
        """(RoPE base, scaling) of layer ``layer``: a sliding layer's own base when rope_local_theta
        is set."""
        if self.rope_local_theta is not None and self.window_of(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def check(self) -> None:
        """The model's own rules; a null ``head_dim`` becomes d_model // n_heads here, so every
        reader sees an int."""
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ConfigError(
                f"model.layer_types: got {len(self.layer_types)} entries, expected one per layer "
                f"(model.n_layers={self.n_layers}) or none")
        bad = [kind for kind in self.layer_types if kind not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"model.layer_types: got {bad[0]!r}, expected full, sliding or linear")
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.layer_types: got sliding layers but model.sliding_window is "
                              "null; expected a window size")
        for name in ("dropout", "token_dropout", "attention_dropout"):
            rate = getattr(self, name)
            if not rate < 1.0:
                raise ConfigError(f"model.{name}: got {rate}, expected a rate in [0, 1) (1 would "
                                  "drop everything)")
        if self.attention_dropout and self.attention not in ("xla", "auto"):
            raise ConfigError(
                f"model.attention_dropout: got {self.attention_dropout}, expected 0 with "
                f"model.attention={self.attention!r}: only the xla backend drops attention "
                "probabilities (set model.attention=xla, or model.attention_dropout=0 and use "
                "model.dropout)")
        kv = self.kv_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"model.n_heads: got {self.n_heads}, expected a divisor of "
                    f"model.d_model={self.d_model} (or set model.head_dim)")
            self.head_dim = self.d_model // self.n_heads
        turned = self.rotary_dim
        if self.head_dim % 2 or turned % 2 or turned < 2 or self.rope_fraction > 1:
            raise ConfigError(
                f"model.head_dim: got {self.head_dim} (model.rope_fraction {self.rope_fraction}: "
                f"RoPE turns {turned}), expected an even number of turned dims, at least 2")
        if self.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads: got {kv}, expected a divisor of "
                              f"model.n_heads={self.n_heads}")
        self.rope_scaling.check()
        self.lora.check()
        if self.tie_embeddings and "head" in self.lora.modules_to_save:
            raise ConfigError(
                "model.lora.modules_to_save: got 'head' with model.tie_embeddings true, where the "
                "head is the embedding table; expected 'embed' (it trains both, as PEFT's "
                "ensure_weight_tying)")
        self.check_quant_block()
        self.check_vision()
        self.experts.check(self.n_layers)
        self.deltanet.check(self.layer_types)
        kinds = {(self.mlp_of(i), self.mixer_of(i)) for i in range(self.n_layers)}
        if self.scan_layers and len(kinds) > 1:
            raise ConfigError(
                f"model.scan_layers: got true with layers of {len(kinds)} kinds (model.experts.dense_layers "
                f"{self.experts.dense_layers}, model.layer_types {self.layer_types}): a scanned stack holds "
                "one kind of block; expected scan_layers false (layers unrolled)")
        unknown = [name for name in self.remat_names if name not in REMAT_NAMES]
        if unknown:
            raise ConfigError(f"model.remat_names: got {unknown[0]!r}, expected names from "
                              f"{list(REMAT_NAMES)}")

    def check_quant_block(self) -> None:
        """nf4 scales every quant_block inputs along each projection's last input axis: d_model
        (q, k, v, gate, up), head_dim (o), d_ff (down); a block that does not divide one larger
        than it would be no block at all (a width no larger than the block is one block: the
        whole axis shares its scale)."""
        if self.lora.quantize != "nf4":
            return
        block = self.lora.quant_block
        widths = {"d_model": self.d_model, "head_dim": self.head_dim, "d_ff": self.d_ff}
        if self.experts.enabled:  # (each expert's down projection: along its own width)
            widths["experts.d_ff"] = self.experts.d_ff or self.d_ff
        bad = [name for name, width in widths.items() if width % block and width > block]
        if bad:
            raise ConfigError(
                f"model.lora.quant_block: got {block}, expected a divisor of every quantized "
                "projection's input width larger than it "
                f"({', '.join(f'{k}={v}' for k, v in widths.items())}); {', '.join(bad)} is not a "
                "multiple of it")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns: head_dim * rope_fraction (transformers' int())."""
        return int(self.head_dim * self.rope_fraction)

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def check_vision(self) -> None:
        """model.vision's and model.mrope_section's rules: the tower's width is the residual's, and
        its image tokens are placed by 3-D positions."""
        self.vision.check()
        half = self.rotary_dim // 2
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != half):
            raise ConfigError(
                f"model.mrope_section: got {self.mrope_section}, expected three sizes (time, row, "
                f"column) summing to the rotary dims / 2 = {half}")
        if not self.vision.depth:
            return
        if self.vision.out_hidden_size != self.d_model:
            raise ConfigError(
                f"model.vision.out_hidden_size: got {self.vision.out_hidden_size}, expected "
                f"model.d_model={self.d_model} (the tower's tokens enter the residual stream)")
        if not self.mrope_section:
            raise ConfigError("model.mrope_section: got [] with a vision tower (model.vision.depth="
                              f"{self.vision.depth}); expected three sizes (time, row, column)")
        for name in ("dropout", "token_dropout"):
            if getattr(self, name):
                raise ConfigError(f"model.{name}: got {getattr(self, name)} with a vision tower; "
                                  "expected 0 (a vision-language model trains without dropout "
                                  "here)")
        if len(self.vision.deepstack_visual_indexes) > self.n_layers:
            raise ConfigError(
                "model.vision.deepstack_visual_indexes: got "
                f"{len(self.vision.deepstack_visual_indexes)}, expected at most "
                f"model.n_layers={self.n_layers} (one decoder layer each)")
