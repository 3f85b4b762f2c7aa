"""The typed config tree: YAML files in ``configs/`` plus dotted ``key=value`` overrides.

Why dataclasses and not a config library: the tree is small, every key needs a
type, a range and a help line, and errors must name the key, the value and what
is allowed (with a "did you mean" on typos) *before* any work starts. Plain
dataclasses with per-field metadata do that in one readable file and add no
dependency.

Every field may carry metadata:

- ``choices``: the allowed values;
- ``min`` / ``max``: an inclusive numeric range;
- ``help``: one line for the README and for error messages;
- ``resume``: what changing the key does to a run resumed from a checkpoint
  (:data:`RESUME_KINDS`); keys without it keep exact resume.

Cross-field rules (``n_heads`` divisible by ``n_kv_heads``, ...) live in each
section's ``check`` method. :func:`seqjax.config.load.load_config` reads a file
and overrides into this tree and runs every check, so a config that loads is a
config that can run; :mod:`seqjax.config.diff` compares two of them on resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from seqjax.core.errors import ConfigError
from seqjax.core.files import write_text_atomic

DATA_DIR_ENV = "SEQJAX_DATA_DIR"


def _f(default, help: str, **meta):
    """A dataclass field with its help line and validation metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


TRACKERS = ("jsonl", "tensorboard", "wandb")

# What a key changed between a checkpoint and its resume does (field metadata ``resume``; see resume_changes):
# "exact": the steps after the checkpoint are still the ones the old config would have taken (bookkeeping,
#   evaluation, mesh, backends), or the change only takes effect from the next update on (optimizer settings);
# "data": the batches change (order, rows, tokens): refused unless train.allow_config_change, and then the
#   data restarts at the next epoch boundary;
# "model": the function the parameters compute changes (shapes are checked against the checkpoint itself):
#   refused unless train.allow_config_change.
RESUME_KINDS = ("exact", "data", "model")
DATA, MODEL = "data", "model"


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "where a run writes its config, metrics, checkpoints and plots")
    seed: int = _f(0, "the one seed: data order, initialization and sampling derive from it", min=0, resume=DATA)
    trackers: list[str] = _f(
        ["jsonl"], f"where training metrics go, some of {', '.join(TRACKERS)} (metrics.jsonl is always written)"
    )
    wandb_project: str = _f("seqjax", "the Weights & Biases project, when run.trackers has wandb")

    def check(self) -> None:
        for i, name in enumerate(self.trackers):
            if name not in TRACKERS:
                raise ConfigError(f"run.trackers[{i}]: got {name!r}, expected one of {', '.join(TRACKERS)}")


@dataclass
class TokenizerConfig:
    # The tokenizer's effect on a resumed run is judged by its hash (the checkpoint records it), not by these keys:
    # a tokenizer.path that moved but holds the same file changes nothing.
    path: str | None = _f(None, "an existing tokenizer.json to load instead of training one")
    vocab_size: int = _f(8192, "BPE vocabulary size, special tokens included", min=1)
    min_frequency: int = _f(2, "a pair must occur this often to be merged", min=1)
    special_tokens: list[str] = _f(["<|endoftext|>"], "special tokens; the first is end-of-text")
    bos_token: str | None = _f(
        None,
        "the token that opens every prompt and lm_eval window (Llama's <s> or <|begin_of_text|>); "
        "null: the end-of-text token, which opens every sequence seqjax trains on",
    )
    pad_token: str | None = _f(
        None,
        "the padding token a Hugging Face tokenizer names (its pad_token), carried from import to export; seqjax "
        "itself pads with segment id 0 and never reads it",
    )
    train_bytes: int = _f(
        1 << 27,
        "bytes of train-split text the tokenizer trains on, streamed from the start of each train file in turn "
        "(the whole split when smaller)",
        min=1,
    )

    def check(self) -> None:
        if not self.special_tokens:
            raise ConfigError("tokenizer.special_tokens: got [], expected at least the end-of-text token")
        if self.vocab_size <= len(self.special_tokens):
            raise ConfigError(
                f"tokenizer.vocab_size: got {self.vocab_size}, expected more than the "
                f"{len(self.special_tokens)} special tokens {self.special_tokens}"
            )


STRATEGIES = (
    "window",
    "random_offset",
    "sequential",
    "random_window",
    "concat_chunk",
    "block",
    "pack",
    "length_grouped",
)
PACKERS = (
    "greedy",
    "first_fit",
    "best_fit",
    "best_fit_decreasing",
    "fill",
    "grain_first_fit",
    "grain_best_fit",
    "grain_concat_split",
)
# Packers that cut documents at the row's end to fill every row: they cannot cap the segments in a row
# (data.max_segments_per_row) and cannot keep an instruction example whole.
SPLITTING_PACKERS = ("fill", "grain_concat_split")
GRAIN_PACKERS = ("grain_first_fit", "grain_best_fit", "grain_concat_split")


CORPORA = ("wikitext2", "text", "jsonl", "parquet", "hf")
# What one record of a corpus is (seqjax.store.examples): a document, or an instruction example.
FORMATS = ("text", "prompt_completion", "chat", "tokenized")
LOSS_ON = ("auto", "completion", "assistant", "last_assistant", "all")
WEIGHT_DTYPES = ("uint8", "float32")
# Which loss_on each format takes; "auto" is completion / assistant / the records' own labels.
LOSS_ON_FOR = {"text": ("auto", "all"), "prompt_completion": ("auto", "completion", "all"),
               "chat": ("auto", "assistant", "last_assistant", "all"), "tokenized": ("auto", "all")}

# Strategies that arrange whole documents into rows and apply data.overlong to one longer than a row.
OVERLONG_STRATEGIES = ("pack", "length_grouped")


def keeps_documents_whole(strategy: str, packer: str, break_mode: str) -> bool:
    """Whether every document (an instruction example) lands in one segment of one row, never cut at a row's end.

    Only such strategies take instruction data. (``data.overlong=split`` still cuts an example longer than a row,
    on purpose, into pieces that are each their own segment.)
    """
    if strategy == "pack":
        return packer not in SPLITTING_PACKERS
    return strategy == "length_grouped" or (strategy == "block" and break_mode == "complete_doc")



@dataclass
class SourceConfig:
    """One corpus of a mixture (``data.sources``); a null key takes the value of the same ``data.*`` key."""

    name: str = _f("", "the source's name in reports and cache folders (default: source<i>)")
    weight: float = _f(1.0, "share of the training rows drawn from this source (weights are normalized)", min=0.0)
    corpus: str | None = _f(None, "text source (null: data.corpus)", choices=CORPORA)
    variant: str | None = _f(None, "WikiText-2 variant (null: data.variant)", choices=("tokens", "raw"))
    dir: str | None = _f(None, "folder the file entries are relative to (null: data.dir)")
    text_field: str | None = _f(None, "jsonl/parquet/hf: the column or key holding the text (null: data.text_field)")
    format: str | None = _f(None, "what a record is (null: data.format)", choices=FORMATS)
    train_files: list[str] = _f([], "the training files, folders or globs")
    valid_files: list[str] = _f([], "the validation files, folders or globs")
    test_files: list[str] = _f([], "the test files, folders or globs")

    def check(self) -> None:
        pass  # a source's rules need the data.* values it inherits: DataConfig.check runs them


@dataclass
class DataConfig:
    dir: str | None = _f(
        None,
        f"folder holding the corpus (default: ${DATA_DIR_ENV}); for wikitext2 it holds wikitext-2/ and wikitext-2-raw/",
    )
    cache_dir: str = _f(".cache/seqjax", "where the tokenizer and token store are built and reused")
    corpus: str = _f("wikitext2", "text source", choices=CORPORA)
    variant: str = _f("tokens", "WikiText-2 variant: word-level (tokens, with <unk>) or raw", choices=("tokens", "raw"))
    train_files: list[str] = _f([], "for corpus text/jsonl/parquet/hf: the training files, folders or globs")
    valid_files: list[str] = _f([], "for corpus text/jsonl/parquet/hf: the validation files, folders or globs")
    test_files: list[str] = _f([], "for corpus text/jsonl/parquet/hf: the test files, folders or globs")
    # The files' content is judged by the train store's identity; which field of them is the text is a key.
    text_field: str = _f("text", "jsonl/parquet/hf: the key or column holding each document's text", resume=DATA)
    # Instruction data (docs/data.md, "Fine-tuning on instruction data"): which tokens the loss sees.
    format: str = _f("text", "what a record is: a document (text), or an instruction example", choices=FORMATS,
                     resume=DATA)
    loss_on: str = _f("auto", "instruction data: which tokens are scored (auto: completion for prompt_completion, "
                      "assistant for chat, the records' labels for tokenized)", choices=LOSS_ON, resume=DATA)
    prompt_field: str = _f("prompt", "prompt_completion: the key or column holding the prompt", resume=DATA)
    completion_field: str = _f("completion", "prompt_completion: the key or column holding the answer", resume=DATA)
    prompt_separator: str = _f("", "prompt_completion: text put between the prompt and the completion", resume=DATA)
    messages_field: str = _f("messages", "chat: the key or column holding the list of {role, content}", resume=DATA)
    tools_field: str = _f("tools", "chat: the key or column holding a record's tool definitions (a list of JSON "
                          "schemas, or JSON text of one), rendered as apply_chat_template(tools=...) renders them; "
                          "a record without it has none", resume=DATA)
    chat_template: str | None = _f(
        None, "chat: a Jinja chat template file (null: the tokenizer's, from its tokenizer_config.json or "
        "chat_template.jinja)", resume=DATA)
    input_ids_field: str = _f("input_ids", "tokenized: the key or column holding the token ids", resume=DATA)
    labels_field: str = _f("labels", "tokenized: the labels (-100: not scored), if the records have them",
                           resume=DATA)
    loss_weights_field: str = _f("loss_weights", "tokenized: a weight per token (0: not scored), if the records "
                                 "have no labels", resume=DATA)
    loss_weights_dtype: str = _f(
        "uint8", "how the store keeps each target's weight: uint8 holds 0/1 (a byte per token); float32 any weight "
        ">= 0, such as Levanter's fractional loss_weights (4 bytes per token)", choices=WEIGHT_DTYPES, resume=DATA)
    validation_split_percentage: float = _f(
        0.0, "a source without valid_files: this percent of its train documents (chosen by a hash of each "
        "document's text, so the same ones in every run and process) becomes its validation split "
        "(run_clm's validation_split_percentage); 0: none (a run without validation data trains without it)",
        min=0.0, max=50.0, resume=DATA)
    sources: list[SourceConfig] = _f(
        [], "a mixture: corpora with weights, each read like data.* (then data.*_files stay empty)", resume=DATA
    )
    workers: int = _f(0, "tokenizer processes for the store build (0: one per core)", min=0)
    shard_bytes: int = _f(
        1 << 28, "source bytes per store shard: consecutive files are grouped up to this size (a bigger file alone)",
        min=1,
    )
    plan_window_tokens: int = _f(
        1 << 24,
        "epochs are planned a window of about this many tokens at a time (windows shuffled, then rows within)",
        min=1,
        resume=DATA,
    )

    # How rows are cut: any change gives other batches, so a resume under it is refused unless allowed. (Which
    # text and tokenizer the rows come from is judged by the train store's identity, which checkpoints record.)
    strategy: str = _f("pack", "how the token stream is cut into rows", choices=STRATEGIES, resume=DATA)
    seq_len: int = _f(256, "tokens per row (model inputs)", min=2, resume=DATA)
    stride: int | None = _f(None, "window: distance between window starts (default: seq_len)", min=1, resume=DATA)
    batch_size: int = _f(16, "rows per global batch (all processes together)", min=1, resume=DATA)
    shuffle: bool = _f(True, "shuffle rows each epoch", resume=DATA)
    cross_document_attention: bool = _f(
        False,
        "stream strategies and the blocks/sliding evaluation windows: one segment per row (HF/GPT-2) "
        "instead of one per document piece",
        resume=DATA,
    )
    break_mode: str = _f(
        "none", "block: fairseq TokenBlockDataset break mode", choices=("none", "complete", "complete_doc", "eos"),
        resume=DATA,
    )
    packer: str = _f("best_fit", "pack: the packing algorithm", choices=PACKERS, resume=DATA)
    pack_buffer: int = _f(
        1024,
        "pack: rows open at once in first_fit/best_fit (best_fit_decreasing sorts windows of this many documents; "
        "grain_*: bins)",
        min=1,
        resume=DATA,
    )
    overlong: str = _f("split", "pack: documents longer than a row", choices=("drop", "truncate", "split", "error"),
                       resume=DATA)
    max_segments_per_row: int | None = _f(None, "pack: cap on segments in one row", min=1, resume=DATA)
    bucket_lengths: list[int] = _f([], "length_grouped: padded row lengths (default: powers of two up to seq_len)",
                                   resume=DATA)
    mega_batch_mult: int = _f(50, "length_grouped: batches per sorted mega-batch", min=1, resume=DATA)

    def check(self) -> None:
        if self.sources:
            for split in ("train", "valid", "test"):
                if getattr(self, f"{split}_files"):
                    raise ConfigError(
                        f"data.{split}_files: got {getattr(self, f'{split}_files')}, expected [] when data.sources is "
                        "set; list each source's files under its own train_files/valid_files/test_files"
                    )
            names = [source.name or f"source{i}" for i, source in enumerate(self.sources)]
            for i, source in enumerate(self.sources):
                key = f"data.sources[{i}]"
                if (source.corpus or self.corpus) != "wikitext2" and not source.train_files:
                    raise ConfigError(
                        f"{key}.train_files: got [], expected at least one file for "
                        f"corpus={source.corpus or self.corpus!r}"
                    )
                if names.index(names[i]) != i:
                    raise ConfigError(f"{key}.name: got {names[i]!r}, expected a name no other source has")
            if not any(source.weight > 0 for source in self.sources):
                raise ConfigError("data.sources: every weight is 0, expected at least one positive weight")
            if self.strategy == "pack" and self.packer in GRAIN_PACKERS:
                raise ConfigError(
                    f"data.packer: got {self.packer!r}, expected a seqjax packer with data.sources: Grain's packers "
                    "run their own iterator, which a mixture cannot draw rows from"
                )
            if self.strategy == "sequential":
                raise ConfigError(
                    "data.strategy: got 'sequential', expected another strategy with data.sources: sequential's rows "
                    "continue each other from batch to batch, and a mixture moves rows between sources"
                )
        # (data.train_files itself is required where the train split or a tokenizer trained on it is read:
        # seqjax.store.build.prepare; eval and prepare of other splits need only theirs)
        for source in self.resolved_sources():
            for split in ("train", "valid", "test"):
                files = getattr(source, f"{split}_files")
                if source.corpus == "wikitext2" and files:
                    key = "data" if source.name == "main" else f"data.sources[{source.name}]"
                    raise ConfigError(
                        f"{key}.{split}_files: got {files}, but corpus=wikitext2 reads WikiText-2's own files; "
                        "expected [] (or data.corpus=text, jsonl, parquet or hf to read these files)")
        if self.overlong != "split" and self.strategy not in OVERLONG_STRATEGIES:
            raise ConfigError(
                f"data.overlong: got {self.overlong!r} with data.strategy={self.strategy}, expected split (the "
                f"default): only {' and '.join(OVERLONG_STRATEGIES)} apply it; {self.strategy} cuts a document longer "
                "than a row itself" + (" into blocks, as fairseq does" if self.strategy == "block" else ""))
        if (
            self.strategy == "pack"
            and self.packer in SPLITTING_PACKERS
            and self.max_segments_per_row is not None
        ):
            what = "fills every row" if self.packer == "fill" else "is Grain's concat-then-split, which"
            raise ConfigError(
                f"data.max_segments_per_row: got {self.max_segments_per_row}, expected null: packer {self.packer} "
                f"{what} cannot cap segments; unset it or pick another packer"
            )
        self._check_formats()
        for length in self.bucket_lengths:
            if not 2 <= length <= self.seq_len:
                raise ConfigError(
                    f"data.bucket_lengths: got {length}, expected values in [2, data.seq_len={self.seq_len}]"
                )

    def _check_formats(self) -> None:
        """Instruction formats: a corpus of records, a loss_on the format has, a strategy that keeps examples whole."""
        formats = {source.format for source in self.resolved_sources()}
        for source in self.resolved_sources():
            if source.format != "text" and source.corpus not in ("jsonl", "parquet", "hf"):
                key = "data.format" if source.name == "main" else f"data.sources[{source.name}].format"
                raise ConfigError(f"{key}: got {source.format!r} with corpus={source.corpus!r}, expected corpus "
                                  "jsonl, parquet or hf (records with fields) for instruction data")
        for fmt in formats - {"text"}:
            if self.loss_on not in LOSS_ON_FOR[fmt]:
                raise ConfigError(f"data.loss_on: got {self.loss_on!r}, expected one of "
                                  f"{', '.join(LOSS_ON_FOR[fmt])} for data.format={fmt}")
        if formats != {"text"}:
            if not keeps_documents_whole(self.strategy, self.packer, self.break_mode):
                how = {"pack": f" with packer={self.packer!r}", "block": f" with break_mode={self.break_mode!r}"}
                raise ConfigError(
                    f"data.strategy: got {self.strategy!r}{how.get(self.strategy, '')}, expected pack (any packer but "
                    f"{' or '.join(SPLITTING_PACKERS)}), length_grouped or block with data.break_mode=complete_doc for "
                    "instruction data: the others cut examples at arbitrary tokens")
            if self.cross_document_attention:
                raise ConfigError("data.cross_document_attention: got true, expected false for instruction data: "
                                  "each example attends only to itself")

    @property
    def resolved_stride(self) -> int:
        return self.seq_len if self.stride is None else self.stride

    def resolved_sources(self) -> list[SourceConfig]:
        """Every source with no null left: each of ``data.sources`` filled in from ``data.*``, or the ``data.*`` corpus.

        ``data.corpus=jsonl data.train_files=[a.jsonl]`` gives one source
        named ``main`` of weight 1; a source that leaves ``corpus`` null reads
        ``data.corpus``.
        """
        if not self.sources:
            return [SourceConfig(name="main", weight=1.0, corpus=self.corpus, variant=self.variant, dir=self.dir,
                                 text_field=self.text_field, format=self.format, train_files=list(self.train_files),
                                 valid_files=list(self.valid_files), test_files=list(self.test_files))]
        return [
            dataclasses.replace(
                source,
                name=source.name or f"source{i}",
                corpus=source.corpus or self.corpus,
                variant=source.variant or self.variant,
                dir=source.dir if source.dir is not None else self.dir,
                text_field=source.text_field or self.text_field,
                format=source.format or self.format,
            )
            for i, source in enumerate(self.sources)
        ]


ATTENTION_BACKENDS = ("auto", "xla", "cudnn", "cudnn_packed", "pallas", "pallas_mosaic", "splash")
DTYPES = ("float32", "bfloat16")
ROPE_SCALING_TYPES = ("none", "linear", "llama3")
# The Hugging Face architectures seqjax reads and writes (seqjax.hf.families holds each one's tables).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
REMAT_POLICIES = ("none", "full", "dots", "names")
# The activations a block tags with jax.ad_checkpoint.checkpoint_name (model.remat=names keeps those listed).
REMAT_NAMES = ("q", "k", "v", "attn_out", "mlp_in", "mlp_out")


@dataclass(frozen=True)  # hashable: the model keeps it as static graph data
class RopeScalingConfig:
    """How RoPE's frequencies are stretched for contexts longer than pretraining's (Llama 3.1's ``rope_scaling``).

    ``llama3`` keeps the high frequencies (wavelengths below
    original_max_position_embeddings / high_freq_factor), divides the low ones
    (wavelengths above original_max_position_embeddings / low_freq_factor) by
    ``factor``, and interpolates smoothly in between.
    """

    # Each of these changes the function the model computes, so a resume under a change is a model change.
    type: str = _f("none", "none: plain RoPE; linear: every frequency divided by factor (positions interpolated, "
                   "Gemma 3's global layers); llama3: Llama 3.1's frequency scaling", choices=ROPE_SCALING_TYPES,
                   resume=MODEL)
    factor: float = _f(8.0, "linear, llama3: how much the (low) frequencies are slowed", min=1.0, resume=MODEL)
    low_freq_factor: float = _f(1.0, "llama3: wavelengths above original / low_freq_factor are divided by factor",
                                min=0.0, resume=MODEL)
    high_freq_factor: float = _f(4.0, "llama3: wavelengths below original / high_freq_factor are kept", min=0.0,
                                 resume=MODEL)
    original_max_position_embeddings: int = _f(8192, "llama3: the context length of pretraining", min=1,
                                               resume=MODEL)

    def check(self) -> None:
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:  # (linear: factor only)
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor: got {self.high_freq_factor}, expected more than "
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor} (and both above 0)"
            )


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LoraConfig:
    """Low-rank adapters (``model.lora``): the base frozen, each target projection W used as W + (alpha / rank) B A.

    Flax's ``nnx.LoRA`` holds each adapter (A ~ its default init, B = 0, so a new adapter changes nothing); only
    the adapters get gradients, optimizer state and checkpoints. ``rank: 0`` is off (every weight trains).
    """

    rank: int = _f(0, "adapter rank r (0: no adapters, every weight trains)", min=0, resume=MODEL)
    alpha: float = _f(16.0, "the adapters are scaled by alpha / rank (PEFT's lora_alpha)", min=0.0, resume=MODEL)
    dropout: float = _f(0.0, "training only: dropout on each adapter's input (PEFT's lora_dropout)", min=0.0)
    targets: list[str] = _f(list(LORA_TARGETS), "the projections that get adapters, of q, k, v, o, gate, up, down "
                            "(PEFT's target_modules q_proj, ..., down_proj)", resume=MODEL)
    quantize: str = _f("none", "QLoRA: the frozen base's projections stored as int8 (per-channel scales) or nf4 "
                       "(4-bit NormalFloat, per-block scales), dequantized per layer in the forward pass",
                       choices=("none", "int8", "nf4"), resume=MODEL)
    quant_block: int = _f(64, "nf4: inputs per scale block of each output channel (bitsandbytes' 64)", min=2,
                          resume=MODEL)

    def check(self) -> None:
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"model.lora.targets: got {unknown[0]!r}, expected names from {list(LORA_TARGETS)}")
        if self.rank and not self.targets:
            raise ConfigError("model.lora.targets: got [], expected at least one projection with model.lora.rank > 0")
        if not self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout: got {self.dropout}, expected a rate in [0, 1)")
        if self.quantize != "none" and not self.rank:
            raise ConfigError(f"model.lora.quantize: got {self.quantize!r} with model.lora.rank 0; a quantized base "
                              "is frozen, so it needs adapters to train (set model.lora.rank)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


@dataclass
class ModelConfig:
    # Keys that change parameter shapes are marked too, though a checkpoint's own array shapes are what decides.
    vocab_size: int | None = _f(None, "embedding rows (default: the tokenizer's vocabulary size)", min=2, resume=MODEL)
    d_model: int = _f(256, "residual width", min=1, resume=MODEL)
    n_layers: int = _f(4, "Transformer blocks", min=1, resume=MODEL)
    n_heads: int = _f(4, "query heads", min=1, resume=MODEL)
    n_kv_heads: int | None = _f(None, "key/value heads for grouped-query attention (default: n_heads)", min=1,
                                resume=MODEL)
    head_dim: int | None = _f(
        None, "width of each attention head (null: d_model // n_heads, filled in when the config is checked)", min=2,
        resume=MODEL,
    )
    d_ff: int = _f(768, "SwiGLU hidden width", min=1, resume=MODEL)
    max_seq_len: int | None = _f(
        None, "longest sequence the model accepts (null: follows data.seq_len, or eval.context when longer)",
        min=1,
    )
    rope_theta: float = _f(10000.0, "RoPE base frequency", min=1.0, resume=MODEL)
    rope_scaling: RopeScalingConfig = field(
        default_factory=RopeScalingConfig,
        metadata={"help": "RoPE frequency scaling for long contexts: model.rope_scaling.type and its factors"},
    )
    norm_eps: float = _f(1e-6, "RMSNorm epsilon (Llama checkpoints use 1e-5)", min=0.0, resume=MODEL)
    tie_embeddings: bool = _f(True, "share the token embedding with the LM head", resume=MODEL)
    param_dtype: str = _f("float32", "parameter storage dtype", choices=DTYPES, resume=MODEL)
    compute_dtype: str = _f("float32", "matmul/activation dtype (softmax and loss stay float32)", choices=DTYPES,
                            resume=MODEL)
    attention: str = _f("auto", "attention backend", choices=ATTENTION_BACKENDS)
    remat: str = _f(
        "none",
        "rematerialization of each block in the backward pass: none (keep every activation), full (keep only each "
        "block's input, recompute the rest), dots (keep the matmul outputs, recompute the rest), names (keep the "
        "activations model.remat_names lists)",
        choices=REMAT_POLICIES,
    )
    remat_names: list[str] = _f(
        ["attn_out", "mlp_out"],
        f"remat=names: the tagged activations to keep, of {list(REMAT_NAMES)}",
    )
    scan_layers: bool = _f(
        False, "stack the blocks' parameters [n_layers, ...] and run them under jax.lax.scan: compile time flat in "
        "depth (checkpoints keep their layout; eval, export and init_from convert)", resume=MODEL)
    loss_chunk_tokens: int = _f(
        0,
        "the LM head and the cross-entropy a chunk of this many tokens at a time, inside one custom VJP, so the "
        "[tokens, vocab] float32 logits never exist whole (0: off, the plain path)",
        min=0,
    )
    init_std: float = _f(0.02, "std of the normal init (residual projections scaled by 1/sqrt(2*n_layers))", min=0.0)
    dropout: float = _f(
        0.0,
        "training only: dropout rate on the token embeddings and on each residual branch (after attention, after "
        "the MLP); evaluation and generation never drop",
        min=0.0,
    )
    token_dropout: float = _f(
        0.0,
        "training only: the chance that a token's whole input embedding is zeroed (the rest scaled up), a data "
        "augmentation that small corpora such as WikiText-2 need",
        min=0.0,
    )
    attention_dropout: float = _f(
        0.0,
        "training only: dropout rate on the attention probabilities; only the xla backend has it (auto then picks "
        "xla), so pallas, cudnn and splash refuse it",
        min=0.0,
    )

    # What differs between the families (each false/null/empty is Llama's choice): seqjax.hf.families sets them
    # from a config.json; a family is these settings, not a second model.
    family: str = _f("llama", "the Hugging Face architecture export writes (llama, mistral, qwen2, qwen3, gemma3); "
                     "the keys below say what the model computes", choices=FAMILIES, resume=MODEL)
    qkv_bias: bool = _f(False, "biases on the q, k and v projections (Qwen2)", resume=MODEL)
    qk_norm: bool = _f(False, "RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)", resume=MODEL)
    norm_plus_one: bool = _f(False, "every RMSNorm multiplies by (1 + scale), its scales starting at 0 (Gemma)",
                             resume=MODEL)
    post_norms: bool = _f(False, "each branch's output normed before the residual add: four norms a block (Gemma 3)",
                          resume=MODEL)
    mlp_activation: str = _f("silu", "the gated MLP's activation: silu (SwiGLU), gelu_tanh (GeGLU, Gemma)",
                             choices=MLP_ACTIVATIONS, resume=MODEL)
    embed_scale: bool = _f(False, "token embeddings multiplied by sqrt(d_model) (Gemma)", resume=MODEL)
    query_pre_attn_scalar: float | None = _f(
        None, "attention scores scaled by this ** -0.5 (null: head_dim ** -0.5; Gemma 3 sets it)", min=1.0,
        resume=MODEL)
    sliding_window: int | None = _f(
        None, "sliding layers: a query attends to the keys of its own segment at most this many positions back, "
        "itself included (Mistral; Gemma 3's local layers)", min=1, resume=MODEL)
    layer_types: list[str] = _f(
        [], "each layer's attention, full or sliding (Gemma 3 interleaves them); empty: every layer sliding when "
        "model.sliding_window is set, else full", resume=MODEL)
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={
        "help": "low-rank adapters on the projections (model.lora.rank > 0): the base frozen, only adapters train"})
    rope_local_theta: float | None = _f(
        None, "RoPE base of the sliding layers, which take no rope_scaling (Gemma 3's rope_local_base_freq; null: "
        "rope_theta and rope_scaling for every layer)", min=1.0, resume=MODEL)

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to its whole segment."""
        kind = self.layer_types[layer] if self.layer_types else ("sliding" if self.sliding_window else "full")
        return self.sliding_window if kind == "sliding" else None

    @property
    def has_windows(self) -> bool:
        return any(self.window_of(i) is not None for i in range(self.n_layers))

    def rope_of(self, layer: int) -> tuple[float, "RopeScalingConfig | None"]:
        """(RoPE base, scaling) of layer ``layer``: a sliding layer's own base when rope_local_theta is set."""
        if self.rope_local_theta is not None and self.window_of(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def check(self) -> None:
        """The model's own rules; a null ``head_dim`` becomes d_model // n_heads here, so every reader sees an int."""
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ConfigError(f"model.layer_types: got {len(self.layer_types)} entries, expected one per layer "
                              f"(model.n_layers={self.n_layers}) or none")
        bad = [kind for kind in self.layer_types if kind not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"model.layer_types: got {bad[0]!r}, expected full or sliding")
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.layer_types: got sliding layers but model.sliding_window is null; expected a "
                              "window size")
        for name in ("dropout", "token_dropout", "attention_dropout"):
            rate = getattr(self, name)
            if not rate < 1.0:
                raise ConfigError(f"model.{name}: got {rate}, expected a rate in [0, 1) (1 would drop everything)")
        if self.attention_dropout and self.attention not in ("xla", "auto"):
            raise ConfigError(
                f"model.attention_dropout: got {self.attention_dropout}, expected 0 with "
                f"model.attention={self.attention!r}: only the xla backend drops attention probabilities "
                "(set model.attention=xla, or model.attention_dropout=0 and use model.dropout)"
            )
        kv = self.kv_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"model.n_heads: got {self.n_heads}, expected a divisor of model.d_model={self.d_model} "
                    "(or set model.head_dim)"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim: got {self.head_dim}, expected an even number (RoPE rotates pairs)")
        if self.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads: got {kv}, expected a divisor of model.n_heads={self.n_heads}")
        self.rope_scaling.check()
        self.lora.check()
        unknown = [name for name in self.remat_names if name not in REMAT_NAMES]
        if unknown:
            raise ConfigError(f"model.remat_names: got {unknown[0]!r}, expected names from {list(REMAT_NAMES)}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


@dataclass
class TrainConfig:
    steps: int = _f(1000, "optimizer steps", min=1)
    lr: float = _f(3e-3, "peak learning rate", min=0.0)
    schedule: str = _f("cosine", "learning-rate schedule after warmup", choices=("cosine", "constant", "linear"))
    warmup_steps: int = _f(100, "linear warmup steps from 0 to lr", min=0)
    min_lr_ratio: float = _f(0.1, "floor of the decay, as a fraction of lr", min=0.0, max=1.0)
    b1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    b2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = _f(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = _f(0.1, "decoupled weight decay (not on norms, biases)", min=0.0)
    decay_embeddings: bool = _f(False, "apply weight decay to the embeddings too")
    grad_clip: float | None = _f(1.0, "global-norm clipping threshold (null or 0: off, as HF's max_grad_norm=0)",
                                 min=0.0)
    grad_accum: int = _f(1, "micro-batches per step (data.batch_size is split between them)", min=1)
    z_loss: float = _f(0.0, "z-loss coefficient on log(Z)^2", min=0.0)
    loss_normalization: str = _f(
        "tokens", "tokens: every scored token of the global batch weighs the same; examples: each example's mean "
        "loss weighs the same (weights 1/its scored tokens; docs/design.md, contract 3)",
        choices=("tokens", "examples"), resume=DATA)
    init_from: str | None = _f(
        None,
        "start from these weights: a seqjax run or checkpoint folder, or a Hugging Face folder of a family seqjax "
        "loads (parameters only; optimizer, step and data position start fresh; the tokenizer comes with them). "
        "Under model.lora they are the frozen base",
    )
    init_adapter: str | None = _f(
        None, "model.lora: start the adapters from this PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors), to continue someone else's adapter on the base train.init_from names")
    checkpoint_every: int = _f(200, "steps between checkpoints (one is also written at the end)", min=1)
    keep_checkpoints: int = _f(3, "newest checkpoints kept", min=1)
    async_checkpoint: bool = _f(True, "write checkpoints in the background")
    eval_every: int = _f(200, "steps between validation runs (0: only at the end)", min=0)
    eval_batches: int | None = _f(None, "cap on validation batches during training (null: whole split)", min=1)
    log_every: int = _f(
        10, "steps between fetches of the step metrics from the device (one host sync per window) and log lines", min=1
    )
    prefetch: int = _f(2, "batches built and put on the device ahead of the step (0: build each in the loop)", min=0)
    profile: list[int] = _f(
        [], "a jax.profiler trace of [start_step, num_steps] into run.dir/profile (TensorBoard/Perfetto); [] = off"
    )
    nonfinite: str = _f("stop", "on a NaN/inf loss: stop the run, or skip the update", choices=("stop", "skip"))
    allow_config_change: bool = _f(
        False,
        "resume a checkpoint under a config that changes the batches (data.*, run.seed, the tokenizer or the "
        "training text) or the model's function (model.rope_theta, compute_dtype, ...); the data then restarts "
        "at the next epoch boundary; parameter shapes must still match",
    )
    peak_flops: float | None = _f(
        None, "peak FLOP/s per device for MFU (null: a table of known accelerators; CPU: MFU is null)", min=0.0
    )

    def check(self) -> None:
        if self.profile and (len(self.profile) != 2 or self.profile[0] < 1 or self.profile[1] < 1):
            raise ConfigError(f"train.profile: got {self.profile}, expected [start_step, num_steps], both >= 1, or []")
        if self.warmup_steps > self.steps:
            # A quick run needs only train.steps: the warmup shrinks to fit it, and says so once.
            logging.getLogger(__name__).warning("train.warmup_steps: %d is longer than train.steps=%d; warming up over "
                                                "all %d steps", self.warmup_steps, self.steps, self.steps)
            self.warmup_steps = self.steps


@dataclass
class MeshConfig:
    data: int = _f(-1, "data-parallel axis size (-1: the remaining devices)", min=-1)
    fsdp: int = _f(1, "fully-sharded data-parallel axis size (-1: the remaining devices)", min=-1)
    tensor: int = _f(1, "tensor-parallel axis size (-1: the remaining devices)", min=-1)

    def check(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0:
                raise ConfigError(f"mesh.{name}: got 0, expected a positive size or -1")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"mesh: got {sizes}, expected at most one axis set to -1")


@dataclass
class DistributedConfig:
    coordinator_address: str | None = _f(None, "host:port of process 0 for multi-host runs (env: SEQJAX_COORDINATOR)")
    num_processes: int | None = _f(None, "processes in a multi-host run (env: SEQJAX_NUM_PROCESSES)", min=1)
    process_id: int | None = _f(None, "this process's index (env: SEQJAX_PROCESS_ID)", min=0)

    def check(self) -> None:
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ConfigError(
                f"dist.process_id: got {self.process_id}, expected less than dist.num_processes={self.num_processes}"
            )


EVAL_MODES = ("blocks", "sliding", "documents", "lm_eval")


@dataclass
class EvalConfig:
    split: str = _f("valid", "split to score", choices=("valid", "test"))
    mode: str = _f(
        "sliding",
        "evaluation protocol; lm_eval: the lm-evaluation-harness wikitext task (raw WikiText-2, its detokenizer)",
        choices=EVAL_MODES,
    )
    context: int | None = _f(
        None, "tokens of context per window (default: data.seq_len; lm_eval: the model's max_seq_len)", min=2
    )
    stride: int | None = _f(None, "sliding: new tokens scored per window (default: context // 2)", min=1)
    lm_eval_special_tokens: bool = _f(
        True, "lm_eval: encode each page with the tokenizer's default special tokens, as lm-evaluation-harness "
        ">= 0.4.9.2 does (an opening BOS is then scored); false: without them, as <= 0.4.9.1 did")
    batch_size: int = _f(8, "rows per evaluation batch", min=1)
    pack: bool = _f(True, "documents: pack the windows of short documents into rows, each its own segment, as "
                    "training packs examples (the same sums; false: one window per row, padded to eval.context)")
    loss_normalization: str = _f(
        "tokens", "tokens: the loss is the mean over scored tokens; examples: the mean of each document's (example's) "
        "mean, as train.loss_normalization=examples weighs them", choices=("tokens", "examples"))

    def check(self) -> None:
        pass  # eval.context and eval.stride default to data.seq_len: Config.check relates them


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    dist: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def eval_context(self) -> int:
        """Tokens of context per evaluation window: ``eval.context``, else ``data.seq_len``.

        The lm_eval protocol, like the harness, defaults to the model's own limit
        (``model.max_seq_len``, when set).
        """
        if self.eval.context:
            return self.eval.context
        if self.eval.mode == "lm_eval" and self.model.max_seq_len:
            return self.model.max_seq_len
        return self.data.seq_len

    @property
    def max_seq_len(self) -> int:
        """``model.max_seq_len``, or when null the longest sequence this config feeds the model.

        A null limit follows the data (``data.seq_len``, or ``eval.context`` when
        longer), so a tool that builds no model never has to agree with it.
        """
        return self.model.max_seq_len or max(self.data.seq_len, self.eval_context)

    def check(self) -> None:
        """Run every section's own rules, then the rules that span sections."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).check()
        limit = self.model.max_seq_len
        if limit is not None and self.data.seq_len > limit:
            raise ConfigError(f"data.seq_len: got {self.data.seq_len}, expected at most model.max_seq_len={limit}")
        if limit is not None and self.eval_context > limit:
            raise ConfigError(f"eval.context: got {self.eval_context}, expected at most model.max_seq_len={limit}, the "
                              f"longest sequence the model was trained on (add model.max_seq_len={self.eval_context} "
                              "to evaluate beyond it anyway)")
        stride_used = self.eval.mode == "sliding" or self.eval.context is not None  # else the stride is ignored
        if stride_used and self.eval.stride is not None and self.eval.stride > self.eval_context:
            raise ConfigError(f"eval.stride: got {self.eval.stride}, expected at most eval.context={self.eval_context}")
        if self.eval.mode == "lm_eval" and (self.data.corpus, self.data.variant) != ("wikitext2", "raw"):
            got = self.data.corpus if self.data.corpus != "wikitext2" else f"wikitext2 {self.data.variant}"
            raise ConfigError(
                f"eval.mode: got 'lm_eval' on data.corpus={got}, expected data.corpus=wikitext2 with "
                "data.variant=raw (the harness's wikitext task scores wikitext-2-raw-v1)"
            )
        if self.data.batch_size % self.train.grad_accum:
            raise ConfigError(
                f"train.grad_accum: got {self.train.grad_accum}, "
                f"expected a divisor of data.batch_size={self.data.batch_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the resolved config as YAML, atomically, so a run's folder always holds a loadable one."""
        return write_text_atomic(path, self.to_yaml())
