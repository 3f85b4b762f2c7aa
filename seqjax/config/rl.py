"""``rl.*``: online reinforcement learning on rollouts the run generates (GRPO and its variants, as TRL 1.16's
GRPOTrainer computes them; docs/rl.md): how prompts become groups of completions, how they are
scored, and the settings the GRPO-family objectives read (one section of the config tree,
:mod:`seqjax.config.tree`).

The keys take TRL's names and defaults (``GRPOConfig``), except where a name says what it counts:
``steps_per_generation`` counts optimizer steps here (TRL's counts micro-batches: TRL's
``steps_per_generation`` is this times ``gradient_accumulation_steps``), and ``prompts_per_step``
replaces ``per_device_train_batch_size`` (TRL's generation batch is ``prompts_per_step x
num_generations x steps_per_generation`` completions)."""

from __future__ import annotations

from dataclasses import dataclass

from seqjax.config.fields import DATA, MODEL, setting
from seqjax.core.errors import ConfigError

LAYOUTS = ("prompt_once", "prompt_per_completion", "padded")
SCALES = ("group", "batch", "none")
LEVELS = ("token", "sequence")


@dataclass
class RLConfig:
    num_generations: int = setting(8, "completions sampled for each prompt: a group (TRL's G)", min=2, resume=DATA)
    prompts_per_step: int = setting(
        4, "prompts whose groups one optimizer step trains on (a generation batch holds this x "
        "rl.steps_per_generation)", min=1, resume=DATA)
    steps_per_generation: int = setting(
        1, "optimizer steps each generation batch is cut into (TRL's counts micro-batches: it is this x "
        "gradient_accumulation_steps)", min=1, resume=DATA)
    num_iterations: int = setting(
        1, "passes over each generation batch (TRL's mu): after the first, the ratio to the policy that sampled "
        "it moves away from 1 and the clipping works", min=1, resume=DATA)
    max_completion_length: int = setting(512, "tokens a completion may take before it is cut "
                                              "(truncated)", min=1,
                                         resume=DATA)
    temperature: float = setting(1.0, "sampling temperature (0: greedy)", min=0.0, resume=DATA)
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens whose probability "
                                "reaches this",
                           min=0.0, max=1.0, resume=DATA)
    top_k: int = setting(0, "sample among the k most likely tokens (0: all)", min=0, resume=DATA)
    layout: str = setting(
        "prompt_once",
        "how a group is packed: prompt_once (the prompt once, each completion attending to it and to itself "
        "only), prompt_per_completion (Tunix: each completion with its own copy of the prompt), padded (TRL: one "
        "completion a row)", choices=LAYOUTS, resume=DATA)
    rollouts_file: str | None = setting(
        None, "JSONL of completions sampled elsewhere, replayed instead of generating: one line per prompt, "
        "{\"index\": its line in the prompts file, \"completions\": [text or token ids, ...]}", resume=DATA)
    reward_funcs: list[str] = setting(
        ["accuracy"],
        "the reward functions: accuracy (the completion's answer, \\boxed{} or its last number, "
        "against the record's rl.answer_field), format (rl.format_pattern matched), length "
        "(DAPO's soft overlong penalty), or module:function with TRL's signature (prompts, "
        "completions, completion_ids, **the record's columns)",
        one_or_list=True, resume=DATA)
    reward_weights: list[float] = setting([], "the weight of each reward function (TRL's "
                                              "reward_weights); []: 1 each",
                                          resume=DATA)
    answer_field: str = setting("answer", "accuracy: the record's column holding "
                                          "the right answer", resume=DATA)
    format_pattern: str = setting(
        r"^<think>(?!.*<think>)(.*?)</think>.*$",
        "format: the regular expression a completion matches for 1 (else 0): TRL's "
        "think_format_reward's",
        resume=DATA)
    overlong_buffer: int = setting(
        0, "length: DAPO's soft punishment band before rl.max_completion_length (0: a quarter of "
           "it)", min=0,
        resume=DATA)
    scale_rewards: str = setting(
        "group", "advantages: (reward - group mean) divided by the group's std (group), the batch's (batch), or "
        "not (none; Dr. GRPO)", choices=SCALES, resume=DATA)
    normalize_advantages: bool = setting(
        False, "advantages normalized over the whole generation batch to mean 0 and std 1 after the estimator's "
        "(TRL's RLOOTrainer's normalize_advantages)", resume=DATA)
    reward_clip_range: list[float] = setting(
        [], "[min, max]: the weighted reward clipped to this range before the advantages (TRL's RLOOTrainer's "
        "reward_clip_range); []: not clipped", resume=DATA)
    mask_truncated_completions: bool = setting(
        False, "a completion cut at rl.max_completion_length is kept out of the "
               "loss (DAPO)", resume=DATA)
    # the GRPO-family objectives' settings (seqjax.objectives.rl)
    epsilon: float = setting(0.2, "clipping: the ratio is kept within [1 - epsilon, 1 + "
                                  "epsilon_high]", min=0.0,
                             resume=MODEL)
    epsilon_high: float | None = setting(
        None, "the clip's upper side (DAPO's clip-higher; null: rl.epsilon; cispo: its "
              "ratio cap)", min=0.0,
        resume=MODEL)
    delta: float | None = setting(None, "two-sided clipping: the unclipped ratio is capped at "
                                        "this too (INTELLECT-2)",
                                  min=1.0, resume=MODEL)
    importance_sampling_level: str = setting(
        "token", "the ratio per token, or one per completion, the mean of its tokens' log-ratios "
                 "(GSPO)",
        choices=LEVELS, resume=MODEL)
    beta: float = setting(0.0, "the weight of the k3 KL to the reference model (train.reference "
                               "decides which)",
                          min=0.0, resume=MODEL)
    use_bias_correction_kl: bool = setting(
        True, "the per-token KL weighted by the ratio to the sampling policy, as TRL does by "
              "default", resume=MODEL)
    sapo_temperature_pos: float = setting(1.0, "sapo: the soft gate's temperature for positive "
                                               "advantages",
                                          min=0.0, resume=MODEL)
    sapo_temperature_neg: float = setting(1.05, "sapo: the soft gate's temperature for negative "
                                                "advantages",
                                          min=0.0, resume=MODEL)
    max_staleness: int = setting(
        0, "generation batches the sampler may run ahead of training (0: on-policy): generation "
        "g is sampled with the weights at the start of generation g - max_staleness (TRL's "
        "AsyncGRPOTrainer's max_staleness; with mesh.sampler_devices, while the trainer trains)",
        min=0, resume=DATA)
    log_completions_every: int = setting(
        0, "steps between tables of sampled completions written to run.dir/completions/ "
           "(0: never)", min=0)

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def generation_prompts(self) -> int:
        """Prompts a generation batch samples: one optimizer step's, times rl.steps_per_generation."""
        return self.prompts_per_step * self.steps_per_generation

    def check(self) -> None:
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                f"rl.reward_weights: got {self.reward_weights}, expected one weight per "
                f"rl.reward_funcs entry ({self.reward_funcs}) or []")
        if self.reward_clip_range and (len(self.reward_clip_range) != 2
                                       or self.reward_clip_range[0] > self.reward_clip_range[1]):
            raise ConfigError(f"rl.reward_clip_range: got {self.reward_clip_range}, expected [min, "
                              "max] with min <= max, or []")
        if not self.reward_funcs:
            raise ConfigError("rl.reward_funcs: got [], expected at least one reward function")
