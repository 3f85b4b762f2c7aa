"""The rollouts source: the batch source of an RL run (``data.format=prompt``; docs/rl.md), beside the offline one
(:mod:`seqjax.train.source`).

Every ``rl.steps_per_generation x rl.num_iterations`` steps it makes a generation batch: the next
``rl.prompts_per_step x rl.steps_per_generation`` prompts (shuffled per epoch from ``run.seed``, in
file order without ``data.shuffle``), ``rl.num_generations`` completions each, sampled with the
current policy on the training mesh (:func:`seqjax.model.decode.sample_rollouts`, its key
``run.seed``'s folded with the generation's number: a resumed run samples the same) or replayed from
``rl.rollouts_file``; scored by the reward functions (:mod:`seqjax.train.rewards`), their advantages
computed, the groups laid out in rows (:mod:`seqjax.data.rollouts`), and, when a later step or pass
will train on them, their log-probabilities under the sampling policy computed once (TRL's
``old_per_token_logps``), as the reference's are when ``rl.beta > 0``. Each generation batch is
written to ``run.dir/rollouts/`` before its first step, so a run resumed in the middle of one trains
on the same batches."""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqjax.config.tree import Config
from seqjax.core.errors import DataError
from seqjax.core.files import json_text, write_bytes_atomic, write_text_atomic
from seqjax.data.rollouts import Group, rollout_batches
from seqjax.model.decode import sample_rollouts
from seqjax.model.sampling import SamplingConfig
from seqjax.model.sharding import BATCH_AXES
from seqjax.objectives.base import target_logprobs
from seqjax.store.chat import end_of_turn
from seqjax.store.corpus import source_files
from seqjax.store.examples import example_spec
from seqjax.store.prompts import Prompt, read_prompts
from seqjax.train.prefetch import IteratorPosition
from seqjax.train.rewards import Reward, advantages, load_rewards, score
from seqjax.train.step import reference_states
from seqjax.weights.reference import same_weights_rule

log = logging.getLogger(__name__)

ROLLOUT_STREAM = 0x726F6C6C  # "roll": the sampling keys' stream of the run key
FOLDER = "rollouts"
KEEP = 2  # generation batches kept on disk (the one in progress, and the one before)


class RolloutSource:
    """``next(params, step) -> (device batch, position, host metrics)``, and its state for checkpoints
    (``position``: which prompts were taken and which step of which generation batch this is)."""

    def __init__(self, config: Config, prompts: list[Prompt], rewards: list[Reward], tokenizer, stop_ids: list[int],
                 model_parts: dict[str, Any], to_device: Callable[[dict], dict], run_dir: Path,
                 rollouts: dict[int, list] | None = None, shards: int = 1):
        self.config, self.rl, self.prompts, self.rewards = config, config.rl, prompts, rewards
        self.tokenizer, self.stop_ids, self.parts, self.to_device = tokenizer, stop_ids, model_parts, to_device
        self.folder, self.rollouts, self.shards = Path(run_dir) / FOLDER, rollouts, shards
        self.taken, self.pending, self.metrics = 0, None, {}
        self.every = self.rl.steps_per_generation * self.rl.num_iterations
        self.key = jax.random.fold_in(jax.random.key(config.run.seed), ROLLOUT_STREAM)
        self._logprobs = jax.jit(lambda graphdef, states, batch: target_logprobs(
            nnx.merge(graphdef, *states), batch, None, batch["weights"] > 0), static_argnums=0)

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc) -> None:
        return None

    # -- state

    def get_state(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def set_state(self, state: dict[str, Any], step: int) -> None:
        """Go on after ``step``: its prompts taken, and the generation batch it was in read back when later
        steps still train on it."""
        self.taken = int(state["taken"])
        if step % self.every:
            self.pending = self._read(step // self.every)

    # -- the batches

    def next(self, params, step: int) -> tuple[dict, IteratorPosition, dict[str, float]]:
        """Step ``step``'s batch (1-based), making a generation batch first when one starts here."""
        generation, within = divmod(step - 1, self.every)
        metrics = {}
        if within == 0:
            self.pending = self._generate(params, generation, step)
            metrics = self.metrics
        batches = self.pending["batches"]
        batch = dict(batches[within % self.rl.steps_per_generation])
        batch["fresh"] = np.full((len(batch["inputs"]), 1), int(within == 0), np.int32)
        return self.to_device(batch), IteratorPosition(self.get_state()), metrics

    def _next_prompts(self) -> list[Prompt]:
        n, out = len(self.prompts), []
        for _ in range(self.rl.generation_prompts):
            epoch, at = divmod(self.taken, n)
            order = (np.random.default_rng([self.config.run.seed, epoch]).permutation(n)
                     if self.config.data.shuffle else np.arange(n))
            out.append(self.prompts[int(order[at])])
            self.taken += 1
        return out

    def _completions(self, params, prompts: list[Prompt], generation: int) -> list[tuple[list[int], bool]]:
        """(ids, stopped) of each prompt's G completions, in order: sampled, or replayed from the file."""
        g = self.rl.num_generations
        if self.rollouts is not None:
            out = []
            for prompt in prompts:
                given = self.rollouts.get(prompt.index)
                if given is None or len(given) < g:
                    raise DataError(
                        f"rl.rollouts_file: prompt {prompt.index} ({prompt.where}) has "
                        f"{0 if given is None else len(given)} completions there; "
                        f"expected rl.num_generations={g}")
                for ids in given[:g]:
                    out.append((ids, bool(ids) and ids[-1] in self.stop_ids))
            return out
        parts = self.parts
        model = nnx.merge(parts["graphdef"], params, *parts["frozen"], parts["rest"])
        sampling = SamplingConfig(self.rl.temperature, self.rl.top_k, self.rl.top_p)
        made = sample_rollouts(model, [p.ids.tolist() for p in prompts], stop_ids=self.stop_ids,
                               max_new_tokens=self.rl.max_completion_length, sampling=sampling,
                               key=jax.random.fold_in(self.key, generation), copies=g)
        return [(m.tokens, m.stopped) for m in made]

    def _generate(self, params, generation: int, step: int) -> dict[str, Any]:
        """One generation batch: prompts, completions, rewards, advantages, the steps' batches."""
        prompts = self._next_prompts()
        g = self.rl.num_generations
        made = self._completions(params, prompts, generation)
        conversational = isinstance(prompts[0].prompt, list)
        texts = [self.tokenizer.decode_text(ids) for ids, _ in made]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        repeated = [p for p in prompts for _ in range(g)]
        columns: dict[str, list] = {}
        for p in repeated:
            for key in p.columns:
                columns.setdefault(key, [])
        for key in columns:
            columns[key] = [p.columns.get(key) for p in repeated]
        table, total = score(self.rewards, self.rl.reward_weights, [p.prompt for p in repeated], completions,
                             [ids for ids, _ in made], columns)
        adv, zero_std = advantages(total, g, self.rl.scale_rewards)
        truncated = np.asarray([not stopped for _, stopped in made])
        masked = truncated & self.rl.mask_truncated_completions
        groups = [Group(p.ids, [np.asarray(made[k * g + j][0], np.int64) for j in range(g)],
                        adv[k * g:(k + 1) * g], masked[k * g:(k + 1) * g])
                  for k, p in enumerate(prompts)]
        data = self.config.data
        batches = rollout_batches(groups, self.rl.layout, data.seq_len, data.batch_size,
                                  self.rl.steps_per_generation, self.shards)
        self._logps(params, batches, step)
        self.metrics = generation_metrics(self.rewards, table, total, zero_std, made, truncated)
        pending = {"batches": batches, "generation": generation}
        self._write(generation, pending, prompts, texts, table, adv)
        self._log_table(step, prompts, texts, table, adv)
        return pending

    def _logps(self, params, batches: list[dict[str, np.ndarray]], step: int) -> None:
        """Each batch's old log-probabilities (when a later step or pass trains on it) and the reference's
        (``rl.beta > 0``), computed once here."""
        parts = self.parts
        policy = (params, *parts["frozen"], parts["rest"])
        same = None
        if self.rl.beta and parts.get("same_weights") is not None:
            same = bool(parts["same_weights"](params, parts.get("reference_weights"), step))
        for batch in batches:
            device = {k: jnp.asarray(v) for k, v in batch.items()}
            zeros = np.zeros_like(batch["weights"])
            batch["old_logps"] = (np.asarray(self._logprobs(parts["graphdef"], policy, device), np.float32)
                                  if self.every > 1 else zeros)
            # (the reference is the sampling policy: its log-probabilities are the old ones, and on
            # the first pass the step's own, bit for bit)
            batch["rollout_reference_logps"] = batch["old_logps"] if same else zeros
            batch["reference_is_policy"] = np.full((len(batch["inputs"]), 1), int(bool(same)), np.int32)
            if self.rl.beta and not same:
                graphdef, states = parts["reference"](params)
                batch["rollout_reference_logps"] = np.asarray(self._logprobs(graphdef, states, device), np.float32)

    # -- files

    def _path(self, generation: int) -> Path:
        return self.folder / f"generation_{generation:06d}.npz"

    def _write(self, generation: int, pending: dict, prompts, texts, table, adv) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, **{f"{i}/{k}": v for i, b in enumerate(pending["batches"]) for k, v in b.items()},
                 metrics=np.asarray(json.dumps(self.metrics)))
        write_bytes_atomic(self._path(generation), buffer.getvalue())
        for old in sorted(self.folder.glob("generation_*.npz"))[:-KEEP]:
            old.unlink(missing_ok=True)

    def _read(self, generation: int) -> dict[str, Any]:
        path = self._path(generation)
        if not path.is_file():
            raise DataError(f"{path}: the generation batch this run was in the middle of is missing; "
                            "expected the rollouts the run wrote before training on them (resume from a "
                            "step that ends one)")
        with np.load(path) as f:
            batches: dict[int, dict] = {}
            for name in f.files:
                if name == "metrics":
                    continue
                index, key = name.split("/", 1)
                batches.setdefault(int(index), {})[key] = f[name]
            self.metrics = json.loads(str(f["metrics"]))
        return {"batches": [batches[i] for i in sorted(batches)], "generation": generation}

    def _log_table(self, step: int, prompts: list[Prompt], texts: list[str], table, adv) -> None:
        every = self.rl.log_completions_every
        if not every or step % every not in (0, 1 % every):
            return
        g = self.rl.num_generations
        names = [r.name for r in self.rewards]
        rows = []
        lines = [f"# Completions at step {step}", "",
                 "| prompt | completion | " + " | ".join(names) + " | advantage |",
                 "|---|---|" + "---|" * len(names) + "---|"]
        for i, text in enumerate(texts):
            prompt = prompts[i // g]
            rows.append({"step": step, "prompt": prompt.text, "completion": text,
                         "rewards": {n: _finite(table[i, j]) for j, n in enumerate(names)},
                         "advantage": float(adv[i])})
            cells = [_cell(prompt.text if i % g == 0 else ""), _cell(text),
                     *(f"{table[i, j]:.3g}" for j in range(len(names))), f"{adv[i]:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
        folder = self.folder.parent / "completions"
        write_text_atomic(folder / f"step_{step:06d}.md", "\n".join(lines) + "\n")
        write_text_atomic(folder / f"step_{step:06d}.jsonl", "".join(json_text(r) + "\n" for r in rows))


def _finite(value: float) -> float | None:
    return None if np.isnan(value) else float(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")[:400]


def generation_metrics(rewards: list[Reward], table: np.ndarray, total: np.ndarray, zero_std: np.ndarray,
                       made: list[tuple[list[int], bool]], truncated: np.ndarray) -> dict[str, float]:
    """TRL's metrics of a generation batch: rewards per function and in total, completion lengths (and of
    those that stopped), the share cut at the limit, the groups whose rewards are all equal."""
    with np.errstate(all="ignore"):
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


def read_rollouts(path: str, tokenizer) -> dict[int, list[list[int]]]:
    """``rl.rollouts_file``: each prompt's completions (token ids, or text tokenized as a continuation), by the
    prompt's number; a bad line is one line naming the file and line."""
    out: dict[int, list[list[int]]] = {}
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"rl.rollouts_file: {path!r} not found; expected a JSONL file of "
                        "{\"index\": ..., \"completions\": [...]} lines")
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            index, completions = int(record["index"]), record["completions"]
            ids = [c if isinstance(c, list) else tokenizer.encode_text(c) for c in completions]
            if not all(isinstance(i, int) for c in ids for i in c):
                raise ValueError("a completion's ids are not integers")
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{file}:{number}: {err}; expected {{\"index\": the prompt's line number from 0, "
                            "\"completions\": [text or token ids, ...]}") from None
        out[index] = ids
    return out


def load_prompts(config: Config, tokenizer) -> tuple[list[Prompt], list[int]]:
    """The run's prompts (its training files) and the tokens that stop a completion: the tokenizer's end of
    text, and a chat template's end of turn for conversational prompts."""
    source = config.data.resolved_sources()[0]
    spec = example_spec(config, source, Path(tokenizer.path), tokenizer.eot_token)
    prompts = read_prompts(config, source_files(source, "train"), tokenizer, spec)
    stop_ids = [tokenizer.eot_id]
    if spec.chat_template is not None and isinstance(prompts[0].prompt, list):
        turn = end_of_turn(spec, tokenizer)
        stop_ids += [] if turn is None else [turn]
    return prompts, stop_ids


def build_source(config: Config, prepared, placed, mesh, ref, reference: tuple, to_device) -> RolloutSource:
    """The rollouts source of a run set up by :func:`seqjax.train.setup.setup`: its prompts read, its reward
    functions loaded, its stop tokens (the tokenizer's end of text, and a chat template's end of
    turn), and the reference model of ``rl.beta`` (``ref``, :mod:`seqjax.weights.reference`) as
    ``reference`` gives its weights (the step's extra arguments and the graph with the adapters
    off)."""

    if jax.process_count() > 1:
        raise DataError(f"data.format=prompt: got {jax.process_count()} processes; an RL run samples in one "
                        "process (docs/rl.md, not built)")
    tokenizer = prepared.tokenizer
    prompts, stop_ids = load_prompts(config, tokenizer)
    extras, reference_graphdef = reference
    frozen = [] if placed.frozen is None else [placed.frozen]
    parts = {"graphdef": placed.graphdef, "rest": placed.rest, "frozen": frozen}
    if ref.kind is not None:
        copy = extras[1] if len(extras) == 2 else None
        parts["reference"] = lambda params: (lambda g, *s: (g, s))(*reference_states(
            placed.graphdef, reference_graphdef, placed.rest, params, placed.frozen, copy))
        parts["same_weights"], parts["reference_weights"] = same_weights_rule(ref, config), copy
    rollouts = read_rollouts(config.rl.rollouts_file, tokenizer) if config.rl.rollouts_file else None
    log.info("%d prompts; %d completions a prompt, %d prompts a step, a generation every %d step(s)%s",
             len(prompts), config.rl.num_generations, config.rl.prompts_per_step,
             config.rl.steps_per_generation * config.rl.num_iterations,
             f"; completions replayed from {config.rl.rollouts_file}" if rollouts is not None else "")
    return RolloutSource(config, prompts, load_rewards(config), tokenizer, stop_ids, parts, to_device,
                         Path(config.run.dir), rollouts, shards=math.prod(mesh.shape[a] for a in BATCH_AXES))
