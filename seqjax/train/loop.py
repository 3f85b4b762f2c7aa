"""Training, the library behind ``python -m seqjax.train``: config -> data -> sharded model and
optimizer -> steps.

Everything a run produces lives in ``run.dir``: ``config.yaml`` (resolved,
with the tokenizer's vocabulary size filled in), ``tokenizer.json`` (its own
copy, which the saved config points to, so the folder stands alone on another
machine), ``metrics.jsonl``, ``checkpoints/``, ``loss.png``,
``summary.json`` and, when ``run.trackers`` asks for them, ``tensorboard/`` or a
wandb run.

Starting a run in a ``run.dir`` that holds checkpoints resumes from the newest
readable one: parameters, optimizer state, RNG and the data iterator's
position come back, so the steps after it are the ones an uninterrupted run
would have taken (tests/test_resume.py compares the losses exactly).
``train.init_from`` starts a new run from another model's parameters
(:mod:`seqjax.weights.init_from`).

The loop is this module: what a run holds before its first step is
:mod:`seqjax.train.setup`, the step itself :mod:`seqjax.train.step` (whose loss
is ``train.objective``'s, :mod:`seqjax.objectives`), the duties after each step
:mod:`seqjax.train.hooks`, and summary.json :mod:`seqjax.train.summary`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
from flax import nnx

from seqjax.config.load import announce
from seqjax.config.tree import Config, ConfigError
from seqjax.data.strategies import check_config
from seqjax.eval.evaluate import evaluate
from seqjax.eval.objective import evaluate_objective
from seqjax.model import sharding
from seqjax.model.attention import resolve_backend
from seqjax.train.checkpoint import Checkpointer
from seqjax.train.distributed import initialize_distributed
from seqjax.train.flops import flops_per_token, peak_flops_per_device
from seqjax.train.hooks import Duties, Hook, StepState, builtin_hooks
from seqjax.train.metrics import MetricsLog, StepLogger, check_trackers
from seqjax.train.profiling import ProfileWindow
from seqjax.train.rundir import RunLock
from seqjax.train.setup import Setup, keep_tokenizer, objective_of, restore, resume_row, setup
from seqjax.train.signals import StopRequest, should_stop
from seqjax.train.summary import SUMMARY_FILE, finished_summary, write_summary
from seqjax.weights import init_from, sources
from seqjax.weights.reference import COPY, decide
from seqjax.weights.saved import CHECKPOINTS, Restored

__all__ = ["SUMMARY_FILE", "finished_summary", "train"]

logger = logging.getLogger(__name__)  # (``log`` in train() is the run's MetricsLog)


def train(config: Config, *, validate: Callable[[nnx.Module, int], dict[str, Any]] | None = None,
          hooks: Sequence[Hook] = ()) -> dict[str, Any]:
    """Run (or resume) training for ``train.steps`` steps; return the summary also written to
    summary.json.

    The run holds the lock on ``run.dir`` from before any work to the end
    (:class:`~seqjax.train.rundir.RunLock`): a second run there is refused.

    ``validate(model, step)``, when given, replaces the built-in validation (every
    ``train.eval_every`` steps and at the end). It returns the row logged under "valid", with at
    least ``val_loss``, ``val_perplexity``, ``val_word_perplexity`` and ``val_bits_per_byte``, which
    the summary reports. scripts/study_strategies.py scores a fixed subset of articles this way.

    ``hooks`` run after the built-in ones (flush, checkpoint, validate, stop, profile) at the steps
    each names: see :mod:`seqjax.train.hooks`.
    """
    wall_start = time.perf_counter()
    if config.eval.mode == "lm_eval":
        raise ConfigError(
            "eval.mode: got 'lm_eval' for training's validation, expected blocks, sliding or documents "
            "(lm_eval scores raw pages with python -m seqjax.eval after training)")
    check_config(config)  # the strategy tables' rules, as every command checks them after loading
    # the model train.init_from's weights are (their own config decides its shape), their tokenizer
    config, source = _init_source(config)
    # an unknown objective, or one reading fields the data lacks: refused before any work
    objective_of(config)
    # a tracker asked for but not installed: refused before any work
    check_trackers(config.run.trackers)
    initialize_distributed(config.dist)
    # bad mesh sizes fail before any data work (over the trainer's devices: mesh.sampler_devices
    # sample apart)
    mesh = sharding.build_mesh(config.mesh, sharding.split_devices(config.mesh)[0])
    # so does a backend this machine lacks
    resolve_backend(config.model.attention, config.model.compute_dtype,
                    windows=config.model.has_windows)
    sharding.check_batch_fits(config.data.batch_size, mesh, config.train.grad_accum)
    sharding.check_experts(config.model.experts.count, mesh)
    with RunLock(config.run.dir, jax.process_index(), jax.process_count()):
        finished = finished_summary(Path(config.run.dir), config.train.steps)
        if finished is not None:
            # A scheduler that requeues a finished job lands here: its results stay as they are.
            logger.info(
                "%s already finished its %d steps (its summary.json holds the final validation); "
                "nothing to do and nothing rewritten: raise train.steps to continue it",
                config.run.dir, config.train.steps)
            return finished
        return _train(config, mesh, wall_start, validate, source, hooks)


def _init_source(config: Config) -> tuple[Config, init_from.Source | None]:
    """``train.init_from``: the source's tokenizer and shapes (a mismatch is refused before run.dir
    exists); None when there is none, or when run.dir's own checkpoints win (a full fine-tune
    resumes them)."""
    if not config.train.init_from:
        return config, None
    source = init_from.read_source(config.train.init_from)
    config = init_from.adopt(config, source, getattr(config, "explicit", ()))
    config = sources.adopt_processor(config, source.home, getattr(config, "explicit", ()))
    saved = _saved_steps(Path(config.run.dir))
    # checkpoints hold the adapters only: their base is read again
    if saved and config.model.lora.rank:
        logger.info(
            "run.dir %s holds checkpoints (newest: step %d): the adapters resume from them, on their "
            "base train.init_from=%s", config.run.dir, max(saved), config.train.init_from)
    elif saved and decide(config, objective_of(config).reference).kind == COPY:
        logger.info(
            "run.dir %s holds checkpoints (newest: step %d): the run resumes from them, and the reference "
            "model is again a frozen copy of train.init_from=%s", config.run.dir, max(saved),
            config.train.init_from)
    elif saved:
        # said before any work: resuming the run's own checkpoints wins (as a requeued job expects)
        logger.warning("run.dir %s holds checkpoints (newest: step %d): the run resumes from them and "
                       "train.init_from=%s is not read (it only starts a new run; use a new run.dir to "
                       "fine-tune afresh)", config.run.dir, max(saved), config.train.init_from)
        source = None
    return config, source


def _saved_steps(run_dir: Path) -> list[int]:
    """The committed checkpoint steps in ``run_dir`` (orbax names a step folder by its number once
    committed)."""
    folder = run_dir / CHECKPOINTS
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []


def _validation(run: Setup, params, mesh, step: int, validate, log: MetricsLog) -> dict[str, Any]:
    """One validation (the caller's ``validate``, or the built-in one), logged to metrics.jsonl and
    stderr.

    The built-in one is the eval command's, capped at train.eval_batches during training and over
    the whole split at the end; a mixture's also scores each source's split alone (as Levanter
    reports each dataset's loss): ``val_sources`` holds each one's loss and perplexity.
    """
    model = run.policy.model(params, run.frozen)
    config = run.config
    if validate is not None:
        row = {"step": step, **validate(model, step)}
    else:
        cap = None if step == config.train.steps else config.train.eval_batches
        row = {"step": step, **_scores(model, run.valid_store, config, mesh, cap, run.primary,
                                       _reference(run, params, model))}
    log.write(row, prefix="valid")
    if run.primary and "val_rewards/accuracies" in row:
        logger.info("step %d: validation loss %.4f, reward accuracy %.3f, margin %.4f", step,
                    row["val_loss"], row["val_rewards/accuracies"], row["val_rewards/margins"])
    elif run.primary:
        logger.info("step %d: validation loss %.4f, perplexity %.2f", step, row["val_loss"],
                    row["val_perplexity"])
        for name, source in row.get("val_sources", {}).items():
            logger.info("step %d: validation loss %.4f, perplexity %.2f on source %s", step,
                        source["loss"], source["perplexity"], name)
    return row


def _reference(run: Setup, params, model):
    """The preference objective's reference model as the step runs it (the policy record's,
    :mod:`seqjax.train.policy`): a frozen copy or a named model, the state with the adapters off (on the
    run's base, or a named model's); the validation split's precomputed table; None when the objective has
    none."""
    if run.reference.kind is None:  # (an objective without one: simpo, orpo, sft)
        return None
    if run.reference_tables is not None:  # train.precompute_reference: the split's table
        return run.reference_tables[run.config.eval.split]
    return run.policy.reference_model(params, run.frozen)


def run_reports(config: Config) -> tuple[str, ...]:
    """The metrics the run's objective reports (validation logs them as val_<name>)."""
    return objective_of(config).reports


def _scores(model, store, config: Config, mesh, max_batches: int | None, progress: bool,
            reference=None) -> dict[str, Any]:
    if config.data.format == "preference":  # the objective and TRL's metrics over pairs
        result = evaluate_objective(model, reference, store, config, max_batches=max_batches)
        return {
            "val_loss": result["loss"], "val_complete": result["complete"],
            "val_pairs": result["pairs"],
            **{f"val_{k}": v for k, v in result.items() if k in run_reports(config)}
        }
    if config.data.image_processor is not None:  # chats with images: the batches training builds
        result = evaluate_objective(model, None, store, config, max_batches=max_batches)
        return {"val_loss": result["loss"], "val_perplexity": math.exp(result["loss"]),
                "val_tokens": result["weight"], "val_complete": result["complete"]}
    result = evaluate(model, store, config, mesh=mesh, max_batches=max_batches, progress=progress)
    val_loss = result["nll_sum"] / result["tokens"]
    row = {"val_loss": val_loss, "val_perplexity": math.exp(val_loss), "val_tokens": result["tokens"],
           "val_complete": result["complete"], "val_word_perplexity": result["word_perplexity"],
           "val_bits_per_byte": result["bits_per_byte"]}
    if store.source_stores:
        row["val_sources"] = {}
        for (name, *_), source in zip(store.sources, store.source_stores):
            alone = evaluate(model, source, config, mesh=mesh, max_batches=max_batches, progress=False)
            loss = alone["nll_sum"] / alone["tokens"]
            row["val_sources"][name] = {
                "loss": loss, "perplexity": math.exp(loss), "tokens": alone["tokens"]
            }
    return row


def _last_good(checkpoints: Checkpointer) -> str:
    checkpoints.wait()
    kept = checkpoints.latest_step()
    return f"step {kept} in {checkpoints.directory}" if kept is not None else "none"


def _step_logger(run: Setup, log: MetricsLog, restored: Restored | None, checkpoints: Checkpointer,
                 start_step: int, peak: float | None) -> StepLogger:
    tc = run.config.train
    return StepLogger(log, steps=tc.steps, start_step=start_step, log_every=tc.log_every,
                      tokens_seen=int(restored.meta["tokens_seen"]) if restored else 0,
                      learning_rates=run.learning_rates, flops_per_token=_flops_per_token(run),
                      peak=peak, z_loss=bool(tc.z_loss), nonfinite=tc.nonfinite,
                      primary=run.primary, last_good=functools.partial(_last_good, checkpoints))


def _flops_per_token(run: Setup):
    return functools.partial(flops_per_token, run.config.model, num_params=run.model_params,
                             vocab_size=run.config.model.vocab_size, trained=run.num_params)


def _builtin_hooks(run: Setup, mesh, validate, log: MetricsLog, steps: StepLogger,
                   checkpoints: Checkpointer, stop_request: StopRequest, profiler: ProfileWindow,
                   last_val: list) -> Any:
    """The run's own hooks (seqjax.train.hooks.builtin_hooks) over this run's objects; the validate
    hook keeps its newest row in ``last_val``."""
    tc = run.config.train
    meta = {
        "processes": jax.process_count(), "devices": jax.device_count(),
        "data_identity": run.identity, **({"lora_base": run.base} if run.base is not None else {}),
        **({"reference": run.reference_identity} if run.reference_identity is not None else {})
    }

    def validation(state: StepState) -> None:
        last_val[:] = [_validation(run, state.params, mesh, state.step, validate, log)]

    def checkpoint_meta() -> dict[str, Any]:
        return {"tokens_seen": steps.tokens_seen, "row": steps.last_row or None, **meta}

    validating = run.valid_store is not None or validate is not None
    duties = Duties(steps, checkpoints, checkpoint_meta, run.config, validation if validating else None,
                    lambda: stop_request.signum, profiler, stop_request.critical)
    return builtin_hooks(duties, last_step=tc.steps, checkpoint_every=tc.checkpoint_every,
                         eval_every=tc.eval_every)


def _train(config: Config, mesh, wall_start: float, validate, source: init_from.Source | None,
           extra_hooks: Sequence[Hook]) -> dict[str, Any]:
    run = setup(config, mesh, source)
    config, tc = run.config, run.config.train
    checkpoints = Checkpointer(run.run_dir, tc)
    restored = restore(checkpoints, run)
    params, opt_state, rng = (restored.params, restored.opt_state, restored.rng) if restored else \
        (run.params, run.opt_state, run.rng)
    start = restored.step if restored else 0
    # after the resume was accepted: a refused one leaves config.yaml and tokenizer.json as they
    # were
    if run.primary:
        keep_tokenizer(run.tokenizer_source, run.run_dir)
        init_from.keep_carried(source, run.run_dir)
        announce(config, run.run_dir)
        logger.info("%s parameters; mesh %s; %d process(es); unigram %s perplexity %s",
                    f"{run.num_params:,}", dict(mesh.shape), jax.process_count(), config.eval.split,
                    "n/a" if run.unigram is None else f"{run.unigram:.1f}")
    log = MetricsLog(run.run_dir, resume_step=start, enabled=run.primary, trackers=config.run.trackers,
                     config=config, checkpoint_row=restored.meta.get("row") if restored else None)
    if restored is not None:
        log.note(resume_row(restored))
    peak = peak_flops_per_device(override=tc.peak_flops)
    steps = _step_logger(run, log, restored, checkpoints, start, peak)
    profiler = ProfileWindow(tc.profile, run.run_dir / "profile")
    last_val: list[dict[str, Any]] = []  # the newest validation row, kept by the validate hook
    stop_request = StopRequest(enabled=jax.process_count() == 1)
    hooks = _builtin_hooks(run, mesh, validate, log, steps, checkpoints, stop_request, profiler,
                           last_val)
    hooks.extend(extra_hooks)
    try:
        with stop_request, steps, run.source as source:
            profiler.begin(start + 1)
            for step in range(start + 1, tc.steps + 1):
                # the store's batches (built ahead), or an RL run's rollouts of the current policy
                batch, position, extra = source.next(params, step)
                # rng, step: dropout's key; run.frozen: the base under adapters, a reference's weights
                params, opt_state, m = run.step_fn(params, opt_state, batch, rng, step, run.frozen.base,
                                                   run.frozen.reference)
                # No host sync here: the metrics stay on the device until a hook flushes them, so
                # the host runs ahead and dispatches the next step while this one computes.
                steps.add(step, {**m, "reported": {**m["reported"], **extra}}, batch["inputs"].shape)
                hooks.after_step(
                    StepState(step, params, opt_state, rng, position,
                              stopping=should_stop(stop_request, step, jax.process_count())))
            if not last_val and start == tc.steps and "validate" in hooks.names:
                # Resumed at the last step (the final validation was cut short, or never recorded):
                # redo it.
                logger.info(
                    "step %d was saved but its final validation never completed: running it now",
                    start)
                last_val[:] = [_validation(run, params, mesh, start, validate, log)]
        with stop_request.critical():
            checkpoints.wait()
    finally:
        profiler.close()
        with stop_request.critical():  # (a write under way, after a second Ctrl-C, finishes first)
            checkpoints.close()
        log.close()
    return write_summary(run, steps, restored, last_val[0] if last_val else None,
                         _flops_per_token(run)(config.data.seq_len), peak, wall_start)
