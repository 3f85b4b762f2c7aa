"""The rollouts source: the batch source of an RL run (``data.format=prompt``; docs/rl.md), a row of
:data:`seqjax.train.source.SOURCES` beside the offline one.

Every ``rl.steps_per_generation x rl.num_iterations`` steps it makes a generation batch:

1. the next ``rl.prompts_per_step x rl.steps_per_generation`` prompts (shuffled per epoch from
   ``run.seed``, in file order without ``data.shuffle``);
2. ``rl.num_generations`` completions each, sampled with the current policy on the training mesh
   (:func:`seqjax.engine.sample_rollouts`, its key ``run.seed``'s folded with the generation's
   number: a resumed run samples the same), or replayed from ``rl.rollouts_file`` (:class:`Replay`);
3. scored by the reward functions (:mod:`seqjax.train.rewards`);
4. laid out in rows (:mod:`seqjax.data.rollouts`), and, when a later step or pass will train on them
   or the loss type puts its KL in the reward, their log-probabilities under the sampling policy
   computed once (TRL's ``old_per_token_logps``), as the reference's are when ``rl.beta > 0``;
5. their advantages, by the estimator the loss type names (:data:`seqjax.train.rewards.ADVANTAGES`),
   written into the rows.

Each generation batch is written to ``run.dir/rollouts/`` before its first step, so a run resumed
in the middle of one trains on the same batches; a damaged one is set aside and made again, in
one line. With ``rl.max_staleness`` the batches are launched ahead (:mod:`seqjax.train.ahead`)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqjax.config.tree import Config
from seqjax.core.errors import DataError, SeqjaxError
from seqjax.core.files import json_text, write_bytes_atomic, write_text_atomic
from seqjax.data.rollouts import Group, rollout_batches, rows_needed, with_advantages
from seqjax.engine.rollout import EngineRollout, Rollout
from seqjax.model.sampling import SamplingConfig
from seqjax.model.sharding import AXES, BATCH_AXES, local_rows, mesh_shape
from seqjax.objectives import resolve
from seqjax.store.chat import end_of_turn
from seqjax.store.corpus import source_files
from seqjax.store.examples import example_spec
from seqjax.store.prompts import Prompt, read_prompts
from seqjax.store.replay import Replay, ReplayRollout, read_rollouts
from seqjax.train.ahead import Ahead, AheadPosition, Side, Tally, sampler_side
from seqjax.train.prefetch import IteratorPosition
from seqjax.train.rewards import Reward, RewardLogs, TrainerState, advantages, load_rewards, quiet, score

log = logging.getLogger(__name__)

ROLLOUT_STREAM = 0x726F6C6C  # "roll": the sampling keys' stream of the run key
FOLDER = "rollouts"
KEEP = 2  # generation batches kept on disk (the one in progress, the one before), and those ahead


class RolloutWriteError(RuntimeError):
    """A generation batch could not be written to ``run.dir/rollouts/`` (a full disk, a read-only
    folder): the run stops before training on it, in one line; nothing already written is lost."""


@dataclasses.dataclass
class Plan:
    """What an RL run reads before any weight: its prompts, stop tokens, reward functions and
    replayed completions, and the loss type whose rollouts it makes."""

    prompts: list[Prompt]
    stop_ids: list[int]
    rewards: list[Reward]
    replay: Replay | None
    loss_type: Any  # seqjax.objectives.rl.LossType


class RolloutSource:
    """``next(params, step) -> (device batch, position, host metrics)``, and its state for
    checkpoints (``position``: which prompts were taken, how many tokens were generated, which
    step of which generation batch this is)."""

    def __init__(self, config: Config, plan: Plan, tokenizer, policy, frozen, to_device: Callable[[dict], dict],
                 run_dir: Path, shards: int = 1, side: Side | None = None):
        self.config, self.rl, self.plan, self.tokenizer = config, config.rl, plan, tokenizer
        self.prompts, self.rewards, self.stop_ids = plan.prompts, plan.rewards, plan.stop_ids
        self.policy, self.frozen, self.to_device = policy, frozen, to_device
        self.folder, self.shards = Path(run_dir) / FOLDER, shards
        self.pending = None
        self.tally = Tally()
        self.fresh_at = None  # a step whose batch was made again at its start (its ratio is 1 there)
        self.every = self.rl.steps_per_generation * self.rl.num_iterations
        self.ahead = Ahead(self._generate, self.rl.max_staleness, side)
        self.key = jax.random.fold_in(jax.random.key(config.run.seed), ROLLOUT_STREAM)
        sampling = SamplingConfig(self.rl.temperature, self.rl.top_k, self.rl.top_p)
        self.rollout: Rollout = (
            ReplayRollout(plan.replay, self.stop_ids) if plan.replay is not None
            else EngineRollout(self.key, self.stop_ids, self.rl.max_completion_length, sampling, config.engine))
        self._logprobs = jax.jit(lambda params, frozen, batch, reference: policy.logprobs(
            policy.reference_model(params, frozen) if reference else policy.model(params, frozen), batch),
            static_argnums=3)

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.ahead.close(cancel=kind is not None)

    # -- state

    def get_state(self, launched: int | None = None) -> dict[str, Any]:
        """The prompts taken and tokens sampled through the ``launched``-th generation (the
        newest launched: a checkpoint waits until it is made)."""
        launched = self.ahead.launched if launched is None else launched
        self.ahead.wait()
        state = {"taken": (launched + 1) * self.rl.generation_prompts,
                 **self.tally.state(launched, self.rl.max_staleness)}
        return state | ({"launched": launched} if self.rl.max_staleness else {})

    def set_state(self, state: dict[str, Any], step: int) -> None:
        """Go on after ``step``: the generation batch it was in read back when later steps still
        train on it, and those launched ahead of it (a damaged one is set aside, and made again
        when its step comes)."""
        generation, within = divmod(step, self.every)
        launched = int(state.get("launched", generation if within else generation - 1))
        self.tally.restore(state, launched)
        self.ahead.launched = launched
        if within:
            self.pending = self._read(generation)
        for later in range(generation + bool(within), launched + 1):
            made = self._read(later)
            if made is not None:
                self.ahead.queue[later] = made

    # -- the batches

    def next(self, params, step: int) -> tuple[dict, IteratorPosition, dict[str, float]]:
        """Step ``step``'s batch (1-based), making a generation batch first when one starts here
        (or when the one this step is in was damaged on disk)."""
        generation, within = divmod(step - 1, self.every)
        metrics = {}
        if within == 0 or self.pending is None:
            if within:  # (made again: with the weights as they are now)
                self.fresh_at = step
            self.pending = self.ahead.take(generation, params, step)
            metrics = self.pending["metrics"]
            if "table" in self.pending:
                self._log_table(step, *self.pending.pop("table"))
        batches = self.pending["batches"]
        batch = dict(batches[within % self.rl.steps_per_generation])
        # (the ratio is 1 where the batch was sampled with this step's weights)
        fresh = (within == 0 and not self.rl.max_staleness) or step == self.fresh_at
        batch["fresh"] = np.full((len(batch["inputs"]), 1), int(fresh), np.int32)
        if not self.rl.max_staleness:
            return self._placed(batch), IteratorPosition(self.get_state()), metrics
        launched = self.ahead.launched
        return self._placed(batch), AheadPosition({}, lambda: self.get_state(launched)), metrics

    def _placed(self, batch: dict[str, np.ndarray], side: Side | None = None) -> dict:
        """A batch every process made whole, placed as a global batch from this process's rows."""
        if side is not None:  # (the sampler's mesh: one process)
            return side.to_device(batch)
        return self.to_device(local_rows(batch, jax.process_index(), jax.process_count()))

    def _prompts_of(self, generation: int) -> list[Prompt]:
        """Generation ``generation``'s prompts: the next ``rl.generation_prompts`` in the order
        ``run.seed`` shuffles each epoch to (file order without ``data.shuffle``)."""
        n, out = len(self.prompts), []
        per = self.rl.generation_prompts
        for taken in range(generation * per, (generation + 1) * per):
            epoch, at = divmod(taken, n)
            order = (np.random.default_rng([self.config.run.seed, epoch]).permutation(n)
                     if self.config.data.shuffle else np.arange(n))
            out.append(self.prompts[int(order[at])])
        return out

    def _completions(self, params, prompts: list[Prompt], generation: int, side: Side | None
                     ) -> list[tuple[list[int], bool]]:
        """(ids, stopped) of each prompt's G completions, in order, from the run's rollout (the
        engine's samples, or the file's replay: seqjax.engine.rollout)."""
        policy, frozen = (self.policy, self.frozen) if side is None else (side.policy, side.frozen)
        self.rollout.update_params(policy.model(params, frozen))
        return self.rollout.generate(prompts, copies=self.rl.num_generations, generation=generation)

    def _generate(self, params, generation: int, step: int,
                  side: Side | None = None) -> dict[str, Any]:
        """One generation batch: prompts, completions, rewards, the steps' batches, advantages;
        made with ``params`` at ``step``'s start, where ``side`` says (None: the training mesh)."""
        prompts = self._prompts_of(generation)
        g = self.rl.num_generations
        made = self._completions(params, prompts, generation, side)
        repeated = [p for p in prompts for _ in range(g)]
        own = sum(len(p.ids) + len(ids) for p, (ids, _) in zip(repeated, made))
        num_tokens = self.tally.add(generation, own)
        conversational = isinstance(prompts[0].prompt, list)
        texts = [self.tokenizer.decode_text(ids) for ids, _ in made]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns: dict[str, list] = {}
        for p in repeated:
            for key in p.columns:
                columns.setdefault(key, [])
        for key in columns:
            columns[key] = [p.columns.get(key) for p in repeated]
        taken = (generation + 1) * self.rl.generation_prompts
        state = TrainerState(global_step=step - 1, max_steps=self.config.train.steps,
                             epoch=taken / len(self.prompts), num_input_tokens_seen=num_tokens)
        logs = RewardLogs()
        table, total = score(self.rewards, self.rl.reward_weights, [p.prompt for p in repeated], completions,
                             [ids for ids, _ in made], columns, state, logs)
        if self.rl.reward_clip_range:
            total = np.clip(total, *self.rl.reward_clip_range)
        truncated = np.asarray([not stopped for _, stopped in made])
        masked = truncated & self.rl.mask_truncated_completions
        groups = [Group(p.ids, [np.asarray(made[k * g + j][0], np.int64) for j in range(g)], np.zeros(g),
                        masked[k * g:(k + 1) * g]) for k, p in enumerate(prompts)]
        data = self.config.data
        batches = rollout_batches(groups, self.rl.layout, data.seq_len, data.batch_size,
                                  self.rl.steps_per_generation, self.shards)
        kl = self._logps(params, batches, step, len(made), side)
        if kl is not None:  # (a loss type that takes its KL from the reward: RLOO's, per completion)
            total = total - self.rl.beta * kl["per_completion"]
        estimator = self.plan.loss_type.advantage or self.rl.scale_rewards
        adv, zero_std = advantages(total, g, estimator, self.rl.normalize_advantages)
        for batch in batches:
            with_advantages(batch, adv)
        scored = total if kl is None else total + self.rl.beta * kl["per_completion"]
        metrics = generation_metrics(self.rewards, table, scored, zero_std, made, truncated)
        metrics["num_tokens"] = float(num_tokens)
        if kl is not None:
            metrics["kl"] = kl["per_token"]
        pending = {"batches": batches, "generation": generation, "metrics": metrics | logs.means()}
        self._write(generation, pending, step)
        return pending | {"table": (prompts, texts, table, adv, logs.columns)}

    def _logps(self, params, batches: list[dict[str, np.ndarray]], step: int, completions: int,
               side: Side | None) -> dict | None:
        """Each batch's old log-probabilities (when a later step or pass trains on it, or the KL
        goes in the reward) and the reference's (``rl.beta > 0``), computed once here; the
        reward's KL per completion (the sum of old - ref over its tokens) and per token, when the
        loss type takes it there."""
        policy, frozen = (self.policy, self.frozen) if side is None else (side.policy, side.frozen)
        in_reward = self.plan.loss_type.kl == "reward" and bool(self.rl.beta)
        same = None
        if self.rl.beta and policy.same_weights is not None:
            same = bool(policy.same_weights(params, frozen.reference, step))
        per_completion, tokens, kl_sum = np.zeros(completions), 0.0, 0.0
        old = self.every > 1 or in_reward or self.rl.max_staleness
        for batch in batches:
            # (placed only for a log-probability: a step places its own batch)
            device = self._placed(batch, side) if old or (self.rl.beta and not same) else None
            zeros = np.zeros_like(batch["weights"])
            batch["old_logps"] = whole(self._logprobs(params, frozen, device, False)) if old else zeros
            # (the reference is the sampling policy: its log-probabilities are the old ones, and on
            # the first pass the step's own, bit for bit)
            batch["rollout_reference_logps"] = batch["old_logps"] if same else zeros
            batch["reference_is_policy"] = np.full((len(batch["inputs"]), 1), int(bool(same)), np.int32)
            if self.rl.beta and not same:
                reference = self._logprobs(params, frozen, device, True)
                batch["rollout_reference_logps"] = whole(reference)
            if in_reward:
                scored = (batch["weights"] > 0) & (batch["completion"] > 0)
                gap = np.where(scored, batch["old_logps"] - batch["rollout_reference_logps"], 0.0)
                per_completion += np.bincount(batch["completion"][scored] - 1, weights=gap[scored],
                                              minlength=completions)[:completions]
                tokens, kl_sum = tokens + scored.sum(), kl_sum + float(gap.sum())
        if not in_reward:
            return None
        return {"per_completion": per_completion, "per_token": kl_sum / max(tokens, 1.0)}

    # -- files

    def _path(self, generation: int) -> Path:
        return self.folder / f"generation_{generation:06d}.npz"

    def _write(self, generation: int, pending: dict, step: int) -> None:
        if jax.process_index():  # (every process made the same batch: process 0 keeps it)
            return
        buffer = io.BytesIO()
        np.savez(buffer, **{f"{i}/{k}": v for i, b in enumerate(pending["batches"]) for k, v in b.items()},
                 metrics=np.asarray(json.dumps(pending["metrics"])))
        path = self._path(generation)
        try:
            write_bytes_atomic(path, buffer.getvalue())
            for old in sorted(self.folder.glob("generation_*.npz"))[:-KEEP - self.rl.max_staleness]:
                old.unlink(missing_ok=True)
        except OSError as err:
            raise RolloutWriteError(
                f"{path} could not be written at step {step}: [Errno {err.errno}] {err.strerror}. "
                "The run stops before training on it (nothing already written is lost); once "
                "there is room, run the same command again: it resumes from the newest "
                "checkpoint") from None

    def _read(self, generation: int) -> dict[str, Any] | None:
        """The generation batch the run was in, as written; None when it is damaged (set aside:
        the next step makes it again)."""
        path = self._path(generation)
        if not path.is_file():
            raise DataError(f"{path}: the generation batch this run was in the middle of is "
                            "missing; expected the rollouts the run wrote before training on them "
                            "(resume from a step that ends one)")
        try:
            with np.load(path) as f:
                batches: dict[int, dict] = {}
                for name in f.files:
                    if name == "metrics":
                        continue
                    index, key = name.split("/", 1)
                    batches.setdefault(int(index), {})[key] = f[name]
                metrics = json.loads(str(f["metrics"]))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            aside = path.with_name(f"{path.stem}.damaged-{time.strftime('%Y%m%dT%H%M%S')}.npz")
            path.rename(aside)
            log.warning("%s is damaged (%s: %s): set aside as %s; the generation batch is made "
                        "again with the weights as resumed, so the steps after it differ from an "
                        "uninterrupted run's", path,
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "", aside.name)
            return None
        return {"batches": [batches[i] for i in sorted(batches)], "generation": generation,
                "metrics": metrics}

    def _log_table(self, step: int, prompts: list[Prompt], texts: list[str], table, adv,
                   extra: dict[str, list]) -> None:
        """The completions table at every ``rl.log_completions_every``-th step (N, 2N, ...: the
        generation batch that step trains on), with the columns the reward functions added
        (``log_extra``)."""
        every = self.rl.log_completions_every
        if not every or step % every or jax.process_index():
            return
        g = self.rl.num_generations
        names = [r.name for r in self.rewards]
        extra = {k: v for k, v in extra.items() if len(v) == len(texts)}
        rows = []
        lines = [f"# Completions at step {step}", "",
                 "| prompt | completion | " + " | ".join([*names, *extra]) + " | advantage |",
                 "|---|---|" + "---|" * (len(names) + len(extra)) + "---|"]
        for i, text in enumerate(texts):
            prompt = prompts[i // g]
            rows.append({"step": step, "prompt": prompt.text, "completion": text,
                         "rewards": {n: _finite(table[i, j]) for j, n in enumerate(names)},
                         **({"extra": {k: v[i] for k, v in extra.items()}} if extra else {}),
                         "advantage": float(adv[i])})
            cells = [_cell(prompt.text if i % g == 0 else ""), _cell(text),
                     *(f"{table[i, j]:.3g}" for j in range(len(names))), *(_cell(str(v[i])) for v in extra.values()),
                     f"{adv[i]:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
        folder = self.folder.parent / "completions"
        try:
            write_text_atomic(folder / f"step_{step:06d}.md", "\n".join(lines) + "\n")
            write_text_atomic(folder / f"step_{step:06d}.jsonl", "".join(json_text(r) + "\n" for r in rows))
        except OSError as err:  # (a table is a view: the run goes on without it)
            log.warning("the completions table of step %d could not be written to %s: [Errno %s] "
                        "%s", step, folder,
                        err.errno, err.strerror)


def _finite(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")[:400]


def generation_metrics(rewards: list[Reward], table: np.ndarray, total: np.ndarray, zero_std: np.ndarray,
                       made: list[tuple[list[int], bool]], truncated: np.ndarray) -> dict[str, float]:
    """TRL's metrics of a generation batch: rewards per function and in total, completion lengths
    (and of those that stopped), the share cut at the limit, the groups whose rewards are all
    equal."""
    with quiet():
        lengths = np.asarray([len(ids) for ids, _ in made], np.float64)
        ended = lengths[~truncated] if (~truncated).any() else np.zeros(1)
        out = {"reward": float(np.nanmean(total)), "reward_std": float(_std(total)),
               "frac_reward_zero_std": float(np.mean(zero_std)),
               "completions/mean_length": float(lengths.mean()),
               "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()),
               "completions/clipped_ratio": float(truncated.mean()),
               "completions/mean_terminated_length": float(ended.mean()),
               "completions/min_terminated_length": float(ended.min()),
               "completions/max_terminated_length": float(ended.max())}
        for j, reward in enumerate(rewards):
            out[f"rewards/{reward.name}/mean"] = float(np.nanmean(table[:, j]))
            out[f"rewards/{reward.name}/std"] = float(_std(table[:, j]))
    return {k: v for k, v in out.items() if not np.isnan(v)}  # (an undefined std: none logged, as TRL's NaN)


def _std(values: np.ndarray) -> float:
    kept = values[~np.isnan(values)]
    return float(np.std(kept, ddof=1)) if len(kept) > 1 else float("nan")


def load_prompts(config: Config, tokenizer) -> tuple[list[Prompt], list[int]]:
    """The run's prompts (its training files) and the tokens that stop a completion: the
    tokenizer's end of text, and a chat template's end of turn for conversational prompts."""
    source = config.data.resolved_sources()[0]
    spec = example_spec(config, source, Path(tokenizer.path), tokenizer.eot_token)
    prompts = read_prompts(config, source_files(source, "train"), tokenizer, spec)
    stop_ids = [tokenizer.eot_id]
    if spec.chat_template is not None and isinstance(prompts[0].prompt, list):
        turn = end_of_turn(spec, tokenizer)
        stop_ids += [] if turn is None else [turn]
    return prompts, stop_ids


def whole(rows: jax.Array) -> np.ndarray:
    """A global array's every row on this process's host, float32 (each process holds a block of
    them)."""
    return np.asarray(multihost_utils.process_allgather(rows, tiled=True), np.float32)


def row_shards(config: Config, trainer: dict[str, int]) -> int:
    """The ways a step's rows are split: the trainer's mesh's (``trainer``: its axis sizes), and
    the sampler's too where it has devices of its own (it places the same rows)."""
    shards = math.prod(trainer[a] for a in BATCH_AXES)
    if config.mesh.sampler_devices:
        sampler = dict(zip(AXES, mesh_shape(config.mesh, config.mesh.sampler_devices)))
        shards = math.lcm(shards, math.prod(sampler[a] for a in BATCH_AXES))
    return shards


def sized_rows(config: Config, prompts: list[Prompt], shards: int) -> Config:
    """``data.batch_size`` as a step's groups need it: the rows of a generation batch's worst
    case (its longest prompts, every completion at ``rl.max_completion_length``), over its steps,
    rounded up to ``shards`` (data x fsdp) times ``train.grad_accum``. A larger one given on the
    command line stays, said in one line (its rows beyond are padding); one from a file (a saved
    config.yaml of another format) yields."""
    rl, data = config.rl, config.data
    lengths = np.sort([len(p.ids) for p in prompts])[::-1][:rl.generation_prompts]
    lengths = np.resize(lengths, rl.generation_prompts)  # (fewer prompts than a generation: drawn again)
    rows = rows_needed(lengths, rl.num_generations, rl.max_completion_length, rl.layout, data.seq_len)
    ways = shards * config.train.grad_accum
    need = max(ways, -(-math.ceil(rows / rl.steps_per_generation) // ways) * ways)
    if data.batch_size <= need:
        return config
    padding = 1 - need / data.batch_size
    if "data.batch_size" in getattr(config, "explicit", ()):
        log.warning("data.batch_size=%d: a step's %d group(s) take at most %d rows of "
                    "data.seq_len=%d (rl.layout=%s, every completion at "
                    "rl.max_completion_length): at least %.0f%% of each step's rows will be "
                    "padding (leave data.batch_size out to size it so)", data.batch_size,
                    rl.prompts_per_step, need, data.seq_len, rl.layout, 100 * padding)
        return config
    log.info("data.batch_size: %d rows a step, what its %d group(s) take at most (rl.layout=%s, data.seq_len=%d); "
             "the file's %d would be at least %.0f%% padding", need, rl.prompts_per_step, rl.layout, data.seq_len,
             data.batch_size, 100 * padding)
    sized = dataclasses.replace(config, data=dataclasses.replace(data, batch_size=need))
    sized.explicit = getattr(config, "explicit", frozenset())
    return sized


def plan(config: Config, prepared, mesh) -> tuple[Config, Plan]:
    """An RL run's checks before any weight is read: its prompts, reward functions and replayed
    completions, and its rows sized to its groups (:func:`sized_rows`)."""
    tokenizer = prepared.tokenizer
    prompts, stop_ids = load_prompts(config, tokenizer)
    objective = resolve(config.train.objective, config.train.objective_weights)
    loss_type = next((row.rl for row in (objective, *objective.parts) if row.rl is not None), None)
    if loss_type is None:
        raise SeqjaxError(f"train.objective={','.join(config.train.objective)}: no RL loss type; "
                          "expected one of docs/rl.md's (dapo, grpo, rloo, ...) for "
                          "data.format=prompt")
    replay = read_rollouts(config, tokenizer, prompts, stop_ids) if config.rl.rollouts_file else None
    config = sized_rows(config, prompts, row_shards(config, dict(mesh.shape)))
    log.info("%d prompts; %d completions a prompt, %d prompts a step, a generation every %d "
             "step(s)%s",
             len(prompts), config.rl.num_generations, config.rl.prompts_per_step,
             config.rl.steps_per_generation * config.rl.num_iterations,
             f"; completions replayed from {config.rl.rollouts_file}" if replay is not None else "")
    return config, Plan(prompts, stop_ids, load_rewards(config), replay, loss_type)


def open_source(opening) -> RolloutSource:
    """The rollouts source of a run set up by :func:`seqjax.train.setup.setup` (a
    :class:`seqjax.train.source.Opening`)."""
    config = opening.config
    side = None
    if config.mesh.sampler_devices:
        side = sampler_side(config, opening.policy, opening.params, opening.frozen)
        log.info("mesh.sampler_devices=%d: the sampler's mesh %s makes generation batches up to "
                 "rl.max_staleness=%d ahead while the trainer's %s trains",
                 config.mesh.sampler_devices, dict(side.mesh.shape), config.rl.max_staleness,
                 dict(opening.mesh.shape))
    return RolloutSource(config, opening.plan, opening.prepared.tokenizer, opening.policy, opening.frozen,
                         opening.to_device, Path(config.run.dir),
                         shards=math.prod(opening.mesh.shape[a] for a in BATCH_AXES), side=side)

