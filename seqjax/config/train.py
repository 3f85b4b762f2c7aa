"""``train.*``: the optimizer, the schedule, checkpoints, validation and what a run starts from (one
section of the config tree, :mod:`seqjax.config.tree`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from seqjax.config.fields import DATA, MODEL, setting
from seqjax.core.errors import ConfigError


@dataclass
class TrainConfig:
    steps: int = setting(1000, "optimizer steps", min=1)
    lr: float = setting(3e-3, "peak learning rate", min=0.0)
    schedule: str = setting("cosine", "learning-rate schedule after warmup",
                            choices=("cosine", "constant", "linear"))
    warmup_steps: int = setting(100, "linear warmup steps from 0 to lr", min=0)
    min_lr_ratio: float = setting(0.1, "floor of the decay, as a fraction of lr", min=0.0, max=1.0)
    b1: float = setting(0.9, "AdamW beta1", min=0.0, max=1.0)
    b2: float = setting(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = setting(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = setting(0.1, "decoupled weight decay (not on norms, biases)", min=0.0)
    decay_embeddings: bool = setting(False, "apply weight decay to the embeddings too")
    grad_clip: float | None = setting(
        1.0, "global-norm clipping threshold (null or 0: off, as HF's max_grad_norm=0)", min=0.0)
    grad_accum: int = setting(1, "micro-batches per step (data.batch_size is split between them)",
                              min=1)
    z_loss: float = setting(0.0, "z-loss coefficient on log(Z)^2", min=0.0)
    loss_normalization: str = setting(
        "tokens",
        "tokens: every scored token of the global batch weighs the same; examples: each example's mean "
        "loss weighs the same (weights 1/its scored tokens; docs/design.md, contract 3)",
        choices=("tokens", "examples"), resume=DATA)
    objective: list[str] = setting(
        ["lm"],
        "what the loss is (seqjax.objectives' table): lm, next-token cross-entropy; a list adds several, "
        "weighted by train.objective_weights (TRL's loss_type=[...]); a single name is a list of one; with "
        "data.format=prompt, dapo (TRL's default loss_type) unless named",
        one_or_list=True)
    objective_weights: list[float] = setting(
        [], "the weight of each train.objective entry (TRL's loss_weights); []: 1 each")
    # Preference objectives (seqjax.objectives.preference; TRL's names and defaults)
    beta: float = setting(
        0.1,
        "preference: how far the policy may move from the reference (DPO's beta; IPO's tau; SimPO's and "
        "ORPO's beta)", min=0.0)
    label_smoothing: float = setting(
        0.0,
        "dpo, robust, simpo: the chance a pair's preference is flipped (cDPO's and robust DPO's epsilon)",
        min=0.0)
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin gamma", min=0.0)
    cpo_alpha: float = setting(
        1.0, "simpo: the weight of the chosen completions' NLL added to SimPO's loss (TRL's CPO default; 0: the "
        "SimPO paper's loss alone)", min=0.0)
    reference: str = setting(
        "auto",
        "the reference model of dpo/ipo/hinge/robust (TRL's ref_model): auto (the base with adapters off under "
        "model.lora, else a frozen copy of the starting weights), copy (a frozen copy under model.lora too: for a "
        "run that starts from trained adapters), or a model of your choosing: a Hugging Face folder, a seqjax run "
        "or one of its step folders. (precompute: auto with train.precompute_reference=true, its older spelling)",
        resume=MODEL)
    precompute_reference: bool = setting(
        False,
        "compute the reference's log-probabilities once before training and store them with the run: no "
        "reference in the step (TRL's precompute_ref_log_probs)", resume=MODEL)
    init_from: str | None = setting(
        None,
        "start from these weights: a seqjax run or checkpoint folder, or a Hugging Face folder of a family seqjax "
        "loads (parameters only; optimizer, step and data position start fresh; the tokenizer comes with them). "
        "Under model.lora they are the frozen base",
    )
    init_adapter: str | None = setting(
        None, "model.lora: start the adapters from this PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors), to continue someone else's adapter on the base train.init_from names"
    )
    checkpoint_every: int = setting(200,
                                    "steps between checkpoints (one is also written at the end)",
                                    min=1)
    keep_checkpoints: int = setting(3, "newest checkpoints kept", min=1)
    async_checkpoint: bool = setting(True, "write checkpoints in the background")
    eval_every: int = setting(200, "steps between validation runs (0: only at the end)", min=0)
    eval_batches: int | None = setting(
        None, "cap on validation batches during training (null: whole split)", min=1)
    log_every: int = setting(
        10,
        "steps between fetches of the step metrics from the device (one host sync per window) and log lines",
        min=1)
    prefetch: int = setting(
        2, "batches built and put on the device ahead of the step (0: build each in the loop)",
        min=0)
    profile: list[int] = setting(
        [],
        "a jax.profiler trace of [start_step, num_steps] into run.dir/profile (TensorBoard/Perfetto); [] = off"
    )
    nonfinite: str = setting("stop", "on a NaN/inf loss: stop the run, or skip the update",
                             choices=("stop", "skip"))
    allow_config_change: bool = setting(
        False,
        "resume a checkpoint under a config that changes the batches (data.*, run.seed, the tokenizer or the "
        "training text) or the model's function (model.rope_theta, compute_dtype, ...); the data then restarts "
        "at the next epoch boundary; parameter shapes must still match",
    )
    peak_flops: float | None = setting(
        None,
        "peak FLOP/s per device for MFU (null: a table of known accelerators; CPU: MFU is null)",
        min=0.0)

    def check(self) -> None:
        if self.reference == "precompute":  # (its older spelling, in the config.yaml of earlier runs too)
            self.reference, self.precompute_reference = "auto", True
        if not self.reference:
            raise ConfigError("train.reference: got '', expected auto, copy, or the path of a model folder")
        if not self.label_smoothing < 0.5:
            raise ConfigError(
                f"train.label_smoothing: got {self.label_smoothing}, expected a flip chance below 0.5"
            )
        if self.profile and (len(self.profile) != 2 or self.profile[0] < 1 or self.profile[1] < 1):
            raise ConfigError(
                f"train.profile: got {self.profile}, expected [start_step, num_steps], both >= 1, or []"
            )
        if self.warmup_steps > self.steps:
            # A quick run needs only train.steps: the warmup shrinks to fit it, and says so once.
            logging.getLogger(__name__).warning(
                "train.warmup_steps: %d is longer than train.steps=%d; warming up over "
                "all %d steps", self.warmup_steps, self.steps, self.steps)
            self.warmup_steps = self.steps
