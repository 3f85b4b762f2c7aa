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

Each section is a dataclass in its own module (``data``, ``model``, ``train``;
the small ones here), declared with :func:`seqjax.config.fields.setting`.
Cross-field rules (``n_heads`` divisible by ``n_kv_heads``, ...) live in each
section's ``check`` method. :func:`seqjax.config.load.load_config` reads a
file and overrides into this tree and runs every check; the rules that tie
``data.strategy`` and ``data.packer`` to other keys live in
:mod:`seqjax.data.strategies`' table, and every command runs them right after
loading (:func:`seqjax.data.strategies.check_config`). So a config a command
accepts is a config that can run; :mod:`seqjax.config.diff` compares two of
them on resume.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from seqjax.config.data import DataConfig, SourceConfig
from seqjax.config.engine import EngineConfig
from seqjax.config.fields import DATA, DATA_DIR_ENV, RESUME_KINDS, setting
from seqjax.config.model import SPLIT_ROW_BACKENDS, LoraConfig, ModelConfig, RopeScalingConfig
from seqjax.config.rl import RLConfig
from seqjax.config.train import TrainConfig
from seqjax.core.errors import ConfigError
from seqjax.core.files import write_text_atomic

# The sections, importable from here as from their own modules; ConfigError and DATA_DIR_ENV with
# them.
__all__ = [
    "Config", "ConfigError", "DATA_DIR_ENV", "DataConfig", "DistributedConfig", "EngineConfig", "EvalConfig",
    "LoraConfig", "MeshConfig", "ModelConfig", "RESUME_KINDS", "RLConfig", "RopeScalingConfig", "RunConfig",
    "SourceConfig", "TokenizerConfig", "TrainConfig"
]

TRACKERS = ("jsonl", "tensorboard", "wandb")


@dataclass
class RunConfig:
    dir: str = setting("runs/default",
                       "where a run writes its config, metrics, checkpoints and plots")
    seed: int = setting(0, "the one seed: data order, initialization and sampling derive from it",
                        min=0, resume=DATA)
    trackers: list[str] = setting([
        "jsonl"
    ], f"where training metrics go, some of {', '.join(TRACKERS)} (metrics.jsonl is always written)"
                                  )
    wandb_project: str = setting("seqjax",
                                 "the Weights & Biases project, when run.trackers has wandb")

    def check(self) -> None:
        for i, name in enumerate(self.trackers):
            if name not in TRACKERS:
                raise ConfigError(
                    f"run.trackers[{i}]: got {name!r}, expected one of {', '.join(TRACKERS)}")


@dataclass
class TokenizerConfig:
    # The tokenizer's effect on a resumed run is judged by its hash (the checkpoint records it), not
    # by these keys: a tokenizer.path that moved but holds the same file changes nothing.
    path: str | None = setting(None, "an existing tokenizer.json to load instead of training one")
    vocab_size: int = setting(8192, "BPE vocabulary size, special tokens included", min=1)
    min_frequency: int = setting(2, "a pair must occur this often to be merged", min=1)
    special_tokens: list[str] = setting(["<|endoftext|>"],
                                        "special tokens; the first is end-of-text")
    bos_token: str | None = setting(
        None,
        "the token that opens every prompt and lm_eval window (Llama's <s> or <|begin_of_text|>); "
        "null: the end-of-text token, which opens every sequence seqjax trains on",
    )
    pad_token: str | None = setting(
        None,
        "the padding token a Hugging Face tokenizer names (its pad_token), carried from import to export; seqjax "
        "itself pads with segment id 0 and never reads it",
    )
    train_bytes: int = setting(
        1 << 27,
        "bytes of train-split text the tokenizer trains on, streamed from the start of each train file in turn "
        "(the whole split when smaller)",
        min=1,
    )

    def check(self) -> None:
        if not self.special_tokens:
            raise ConfigError(
                "tokenizer.special_tokens: got [], expected at least the end-of-text token")
        if self.vocab_size <= len(self.special_tokens):
            raise ConfigError(
                f"tokenizer.vocab_size: got {self.vocab_size}, expected more than the "
                f"{len(self.special_tokens)} special tokens {self.special_tokens}"
            )


@dataclass
class MeshConfig:
    data: int = setting(-1, "data-parallel axis size (-1: the remaining devices)", min=-1)
    fsdp: int = setting(1, "fully-sharded data-parallel axis size (-1: the remaining devices)",
                        min=-1)
    expert: int = setting(
        1, "expert-parallel axis size: a mixture of experts' experts split over it, the batch's rows too between "
        "its layers (docs/model.md; -1: the remaining devices)", min=-1)
    context: int = setting(
        1, "context-parallel axis size: each row's tokens split over it, attention exact (docs/scale.md; -1: the "
        "remaining devices)", min=-1)
    tensor: int = setting(1, "tensor-parallel axis size (-1: the remaining devices)", min=-1)
    sampler_devices: int = setting(
        0, "devices set apart for an RL run's sampler (the last ones), which samples the next "
        "generation batches while the rest train (needs rl.max_staleness >= 1; docs/rl.md); 0: "
        "the sampler runs on the training mesh", min=0)

    def check(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "context": self.context,
                 "tensor": self.tensor}
        for name, size in sizes.items():
            if size == 0:
                raise ConfigError(f"mesh.{name}: got 0, expected a positive size or -1")
        if list(sizes.values()).count(-1) > 1:
            raise ConfigError(f"mesh: got {sizes}, expected at most one axis set to -1")


@dataclass
class DistributedConfig:
    coordinator_address: str | None = setting(
        None, "host:port of process 0 for multi-host runs (env: SEQJAX_COORDINATOR)")
    num_processes: int | None = setting(
        None, "processes in a multi-host run (env: SEQJAX_NUM_PROCESSES)", min=1)
    process_id: int | None = setting(None, "this process's index (env: SEQJAX_PROCESS_ID)", min=0)

    def check(self) -> None:
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ConfigError(
                f"dist.process_id: got {self.process_id}, expected less than dist.num_processes={self.num_processes}"
            )


EVAL_MODES = ("blocks", "sliding", "documents", "lm_eval")


@dataclass
class EvalConfig:
    split: str = setting("valid", "split to score", choices=("valid", "test"))
    mode: str | None = setting(
        None,
        "evaluation protocol; lm_eval: the lm-evaluation-harness wikitext task (raw WikiText-2, its detokenizer); "
        "null: documents for instruction data (each example scored alone, its per-example figure), else sliding",
        choices=EVAL_MODES,
    )
    context: int | None = setting(
        None,
        "tokens of context per window (default: data.seq_len; lm_eval: the model's max_seq_len)",
        min=2)
    stride: int | None = setting(None,
                                 "sliding: new tokens scored per window (default: context // 2)",
                                 min=1)
    lm_eval_special_tokens: bool = setting(
        True,
        "lm_eval: encode each page with the tokenizer's default special tokens, as lm-evaluation-harness "
        ">= 0.4.9.2 does (an opening BOS is then scored); false: without them, as <= 0.4.9.1 did")
    batch_size: int = setting(8, "rows per evaluation batch", min=1)
    pack: bool = setting(
        True, "documents: pack the windows of short documents into rows, each its own segment, as "
        "training packs examples (the same sums; false: one window per row, padded to eval.context)"
    )
    loss_normalization: str = setting(
        "tokens",
        "tokens: the loss is the mean over scored tokens; examples: the mean of each document's (example's) "
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
    rl: RLConfig = field(default_factory=RLConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
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
        if self.eval.mode is None:  # (filled in, as model.head_dim is: every reader sees the protocol used)
            self.eval.mode = "documents" if self.data.instruction else "sliding"
        limit = self.model.max_seq_len
        if limit is not None and self.data.seq_len > limit:
            raise ConfigError(
                f"data.seq_len: got {self.data.seq_len}, expected at most model.max_seq_len={limit}"
            )
        if limit is not None and self.eval_context > limit:
            raise ConfigError(
                f"eval.context: got {self.eval_context}, expected at most model.max_seq_len={limit}, the "
                f"longest sequence the model was trained on (add model.max_seq_len={self.eval_context} "
                "to evaluate beyond it anyway)")
        # else the stride is ignored
        stride_used = self.eval.mode == "sliding" or self.eval.context is not None
        if stride_used and self.eval.stride is not None and self.eval.stride > self.eval_context:
            raise ConfigError(
                f"eval.stride: got {self.eval.stride}, expected at most eval.context={self.eval_context}"
            )
        if self.eval.mode == "lm_eval" and (self.data.corpus, self.data.variant) != ("wikitext2",
                                                                                     "raw"):
            got = self.data.corpus if self.data.corpus != "wikitext2" else f"wikitext2 {self.data.variant}"
            raise ConfigError(
                f"eval.mode: got 'lm_eval' on data.corpus={got}, expected data.corpus=wikitext2 with "
                "data.variant=raw (the harness's wikitext task scores wikitext-2-raw-v1)")
        if self.mesh.context > 1:
            self._check_context()
        if self.mesh.sampler_devices:
            self._check_sampler()
        if self.data.batch_size % self.train.grad_accum:
            raise ConfigError(
                f"train.grad_accum: got {self.train.grad_accum}, "
                f"expected a divisor of data.batch_size={self.data.batch_size}"
            )

    def _check_context(self) -> None:
        """A split row (mesh.context > 1): the rows cut into 2 x context chunks, and the backend
        and dropout honour it (seqjax.model.context)."""
        n = self.mesh.context
        for key, width in (("data.seq_len", self.data.seq_len), ("eval.context", self.eval_context)):
            if width % (2 * n):
                raise ConfigError(f"{key}: got {width}, expected a multiple of 2 x mesh.context = {2 * n} (each "
                                  "device holds two of the row's 2 x mesh.context equal chunks)")
        if self.model.attention not in SPLIT_ROW_BACKENDS:
            raise ConfigError(f"model.attention: got {self.model.attention!r}, which attends over one whole row and "
                              f"cannot honour mesh.context={n}; expected one of {', '.join(SPLIT_ROW_BACKENDS)}")
        if self.model.attention == "pallas" and any(width // (2 * n) % 16 for width in (self.data.seq_len,
                                                                                    self.eval_context)):
            raise ConfigError(f"data.seq_len: got {self.data.seq_len} (eval.context {self.eval_context}) with "
                              f"model.attention=pallas, whose tiles are at least 16 tokens; expected a multiple of "
                              f"2 x mesh.context x 16 = {32 * n}")
        if self.model.attention_dropout:
            raise ConfigError(f"model.attention_dropout: got {self.model.attention_dropout}, which draws its random "
                              f"bits per whole row and cannot honour mesh.context={n}; expected 0")
        if "linear" in self.model.layer_types:  # (its state would have to pass from shard to shard)
            raise ConfigError(f"mesh.context: got {n} with linear layers (model.layer_types "
                              f"{self.model.layer_types}): a Gated DeltaNet's state runs along the "
                              "whole row, and seqjax does not hand it from one shard to the next; "
                              "expected mesh.context=1")
        # (not yet shown equal to one device: an RL run's sampler and the vision tower take whole rows)
        if self.data.format == "prompt" or self.data.image_processor is not None:
            what = "data.format='prompt'" if self.data.format == "prompt" else "data.image_processor (images)"
            raise ConfigError(f"mesh.context: got {n} with {what}, which does not split rows over mesh.context yet; "
                              "expected mesh.context=1")

    def _check_sampler(self) -> None:
        """Devices set apart for sampling (mesh.sampler_devices): an RL run that samples, ahead."""
        n = self.mesh.sampler_devices
        if self.data.format != "prompt":
            raise ConfigError(f"mesh.sampler_devices: got {n} with data.format="
                              f"{self.data.format!r}, expected 0: only an RL run "
                              "(data.format=prompt) samples")
        if self.rl.rollouts_file:
            raise ConfigError(f"mesh.sampler_devices: got {n} with rl.rollouts_file="
                              f"{self.rl.rollouts_file}, expected 0: replayed completions are not "
                              "sampled")
        if self.rl.max_staleness < 1:
            raise ConfigError(f"mesh.sampler_devices: got {n} with rl.max_staleness=0, expected "
                              "rl.max_staleness >= 1: the sampler can only run ahead of the "
                              "trainer on batches it may make with older weights")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the resolved config as YAML, atomically, so a run's folder always holds a loadable
        one."""
        return write_text_atomic(path, self.to_yaml())
