"""Two reward functions with TRL's signature, imported by TRL's GRPOTrainer in scripts/make_grpo_reference.py and by
seqjax (``rl.reward_funcs=[grpo_rewards:even_tokens, grpo_rewards:near_target]``) in tests/test_grpo_trl.py: the same
code scores the same completions on both sides."""

from __future__ import annotations


def even_tokens(prompts, completions, completion_ids, **kwargs):
    """The share of a completion's token ids that are even."""
    return [sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def near_target(prompts, completions, completion_ids, target=None, **kwargs):
    """How close a completion's text length comes to the record's ``target`` column; None where it has none."""
    return [None if t is None else -abs(len(c) - int(t)) / 10 for c, t in zip(completions, target)]


def staged(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """even_tokens, shaped by the run's progress as a TRL reward may shape it (trainer_state), with a column of
    the completions table (log_extra) and a metric (log_metric) of its own."""
    shares = even_tokens(prompts, completions, completion_ids)
    log_extra("length", [len(ids) for ids in completion_ids])
    log_metric("staged/step", float(trainer_state.global_step))
    return [share * (1 + trainer_state.global_step / max(trainer_state.max_steps, 1)) for share in shares]
