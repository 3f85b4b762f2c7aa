"""Training, the library behind ``python -m seqjax.train``: config -> data -> sharded model and optimizer -> steps.

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
(:mod:`seqjax.train.init_from`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from seqjax import sharding
from seqjax.config import Config, ConfigError, announce
from seqjax.data.build import prepare
from seqjax.data.pipeline import build_pipeline
from seqjax.evaluate import evaluate
from seqjax.files import json_text, write_text_atomic
from seqjax.model import build_model
from seqjax.train import init_from
from seqjax.train.checkpoint import TOKENIZER_FILE, Checkpointer, Restored
from seqjax.train.distributed import initialize_distributed
from seqjax.train.flops import flops_per_token, mfu, peak_flops_per_device
from seqjax.train.metrics import (
    MetricsLog,
    StepWindow,
    check_trackers,
    peak_memory_bytes,
    plot_losses,
    unigram_perplexity,
)
from seqjax.train.optimizer import build_optimizer
from seqjax.train.prefetch import DevicePrefetch
from seqjax.train.profiling import ProfileWindow
from seqjax.train.rundir import RunLock
from seqjax.train.step import make_train_step

SUMMARY_FILE = "summary.json"

logger = logging.getLogger(__name__)  # (``log`` in train() is the run's MetricsLog)


class NonFiniteLoss(RuntimeError):
    """A step produced a NaN/inf loss or gradient and ``train.nonfinite`` is ``stop``."""


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; a checkpoint of the last finished step was written."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum = signum


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (a step is never cut in half).

    A second SIGINT interrupts at once, for a user who does not want to wait.
    Multi-host runs leave SIGTERM to JAX's preemption notifier (see
    :func:`_should_stop`), so the handlers are only installed for one process.
    """

    def __init__(self, enabled: bool = True):
        self.signum: int | None = None
        self.enabled = enabled
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("%s: saving a checkpoint after this step, then exiting", signal.Signals(signum).name)

    def __enter__(self):
        if not self.enabled:
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _with_vocab(config: Config, vocab_size: int) -> Config:
    """Fill model.vocab_size from the tokenizer; a larger one (padded rows) is fine, a smaller one is refused.

    A smaller embedding would only show up as NaN losses under jit, where
    out-of-range ids cannot raise, so it is stopped here, before any work.
    """
    if config.model.vocab_size is None:
        return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab_size))
    if config.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size: got {config.model.vocab_size}, expected at least the tokenizer's {vocab_size} "
            "(or null to take it from the tokenizer)"
        )
    return config


def _keep_tokenizer(tokenizer_path: Path, run_dir: Path) -> None:
    """Copy the tokenizer into run.dir (the saved config points there), so the run folder stands alone."""
    own = run_dir / TOKENIZER_FILE
    if tokenizer_path.resolve() != own.resolve():
        write_text_atomic(own, tokenizer_path.read_text(encoding="utf-8"))


def _validation(model, store, config: Config, mesh, step: int, primary: bool, final: bool) -> dict[str, Any]:
    """Validation with the eval CLI's code; capped at train.eval_batches during training, whole split at the end."""
    max_batches = None if final else config.train.eval_batches
    result = evaluate(model, store, config, mesh=mesh, max_batches=max_batches, progress=primary)
    val_loss = result["nll_sum"] / result["tokens"]
    return {
        "step": step,
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_tokens": result["tokens"],
        "val_complete": result["complete"],
        "val_word_perplexity": result["word_perplexity"],
        "val_bits_per_byte": result["bits_per_byte"],
    }


def _sharded_model(config: Config, mesh) -> tuple[nnx.GraphDef, nnx.State, dict, dict]:
    """(graphdef, non-Param state, params as a pure dict placed on the mesh, their shardings)."""
    model = build_model(config, rngs=nnx.Rngs(config.run.seed))
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    param_shardings = sharding.param_shardings(param_state, mesh)
    return graphdef, rest, sharding.place(nnx.to_pure_dict(param_state), param_shardings), param_shardings


def _sharded_optimizer_state(tx: optax.GradientTransformation, params: dict, param_shardings: dict, replicated):
    """AdamW's state created directly on the mesh: moments sharded like their parameters, counters replicated."""
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings, transform_non_params=lambda _: replicated
    )
    return jax.jit(tx.init, out_shardings=opt_shardings)(params), opt_shardings


def train(config: Config, *, validate: Callable[[nnx.Module, int], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run (or resume) training for ``train.steps`` steps; return the summary also written to summary.json.

    The run holds the lock on ``run.dir`` from before any work to the end
    (:class:`~seqjax.train.rundir.RunLock`): a second run there is refused.

    ``validate(model, step)``, when given, replaces the built-in validation (every ``train.eval_every``
    steps and at the end). It returns the row logged under "valid", with at least ``val_loss``,
    ``val_perplexity``, ``val_word_perplexity`` and ``val_bits_per_byte``, which the summary reports.
    scripts/study_strategies.py scores a fixed subset of articles this way.
    """
    wall_start = time.perf_counter()
    if config.eval.mode == "lm_eval":
        raise ConfigError("eval.mode: got 'lm_eval' for training's validation, expected blocks, sliding or documents "
                          "(lm_eval scores raw pages with seqjax.eval after training)")
    check_trackers(config.run.trackers)  # a tracker asked for but not installed: refused before any work
    initialize_distributed(config.dist)
    mesh = sharding.build_mesh(config.mesh)  # bad mesh sizes fail before any data work
    sharding.check_batch_fits(config.data.batch_size, mesh, config.train.grad_accum)
    source = None
    if config.train.init_from:  # the source's tokenizer and shapes: a mismatch is refused before run.dir exists
        source = init_from.locate(config.train.init_from)
        config = init_from.adopt(config, source)
    with RunLock(config.run.dir, jax.process_index(), jax.process_count()):
        finished = finished_summary(Path(config.run.dir), config.train.steps)
        if finished is not None:
            # A scheduler that requeues a finished job lands here: its results stay as they are.
            logger.info("%s already finished its %d steps (its summary.json holds the final validation); "
                        "nothing to do and nothing rewritten: raise train.steps to continue it", config.run.dir,
                        config.train.steps)
            return finished
        return _train(config, mesh, wall_start, validate, source)


def finished_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """The summary of a run that reached ``steps`` and completed its final validation, else None.

    A summary without the final validation (a run killed while validating, or one written before the
    ``finished`` key existed with null losses) does not count: the run is resumed and the validation redone.
    """
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != steps:
        return None
    return summary if summary.get("finished") and summary.get("val_loss") is not None else None


def _resume_row(restored: Restored, config: Config) -> dict[str, Any]:
    """The metrics.jsonl row that marks a resume: what changed since the checkpoint, and where the data went on."""
    was = restored.meta
    row: dict[str, Any] = {"step": restored.step, "event": "resume",
                           "config_changes": {c.key: [c.old, c.new] for c in restored.changes}}
    for key, now in (("processes", jax.process_count()), ("devices", jax.device_count())):
        if was.get(key, now) != now:
            row[key] = [was[key], now]
    if restored.data_restart is not None:
        row["data_restart"] = restored.data_restart
    return row


def _train(config: Config, mesh, wall_start: float, validate, source: init_from.Source | None) -> dict[str, Any]:
    process_index, process_count = jax.process_index(), jax.process_count()
    primary = process_index == 0
    run_dir = Path(config.run.dir)
    tc = config.train

    # The tokenizer first: a model vocabulary too small for it is refused before any store is built.
    config = _with_vocab(config, prepare(config, splits=()).tokenizer.vocab_size)
    prepared = prepare(config, splits=("train", config.eval.split))
    train_store, valid_store = prepared.stores["train"], prepared.stores[config.eval.split]
    # The run keeps its own copy of the tokenizer (written once the resume is accepted, with config.yaml).
    tokenizer_source = Path(prepared.tokenizer.path)
    config = dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer,
                                                                       path=str(run_dir / TOKENIZER_FILE)))
    unigram = unigram_perplexity(train_store.tokens, valid_store.tokens, config.model.vocab_size)

    graphdef, rest, params, param_shardings = _sharded_model(config, mesh)
    if source is not None:
        params = sharding.place(init_from.load_params(source, config.model.param_dtype), param_shardings)
        logger.info("parameters from %s (optimizer, step and data position start fresh)", source.path)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    tx, schedule = build_optimizer(tc)
    # Every step's learning rate up front: one small computation instead of eager ops in the loop.
    learning_rates = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(tc.steps + 1)))
    replicated = sharding.replicated(mesh)
    opt_state, opt_shardings = _sharded_optimizer_state(tx, params, param_shardings, replicated)
    rng = sharding.place(jax.random.key_data(jax.random.key(config.run.seed)), replicated)

    data_iterator = iter(build_pipeline(config, train_store, process_index=process_index, process_count=process_count))
    # What the batches are cut from; a checkpoint records it, so a resume on other text or another tokenizer is seen.
    identity = {"tokenizer": prepared.tokenizer.hash,
                "sources": train_store.text_identity}
    checkpoints = Checkpointer(run_dir, tc)
    start_step, tokens_seen, restored = 0, 0, None
    try:
        restored = checkpoints.restore_latest(params, opt_state, rng, config, identity)
        if restored is not None and restored.step > tc.steps:
            raise ConfigError(f"train.steps: got {tc.steps}, expected at least {restored.step}, the step of the "
                              f"newest checkpoint in {checkpoints.directory} (raise it to continue the run)")
    except BaseException:
        checkpoints.close()
        raise
    if restored is not None:
        params, opt_state, rng = restored.params, restored.opt_state, restored.rng
        start_step, tokens_seen = restored.step, int(restored.meta["tokens_seen"])
        if restored.data_state is not None:
            data_iterator.set_state(restored.data_state)
        logger.info("resuming from %s (step %d)", checkpoints.directory / str(start_step), start_step)
        if restored.changes:
            logger.warning("config changes since checkpoint %d: %s", start_step,
                           "; ".join(map(str, restored.changes)))
        if restored.data_restart is not None:
            logger.warning("the data restarts at %s of the new config (train.allow_config_change), not where "
                           "checkpoint %d stopped (%s)", restored.data_restart["to"], start_step,
                           restored.data_restart["from"])
        was = (restored.meta.get("processes"), restored.meta.get("devices"))
        if None not in was and was != (process_count, jax.device_count()):
            logger.info("elastic resume: checkpoint %d was written by %d process(es) on %d device(s), now %d on %d",
                        start_step, *was, process_count, jax.device_count())
    if primary:  # after the resume was accepted: a refused one leaves config.yaml and tokenizer.json as they were
        _keep_tokenizer(tokenizer_source, run_dir)
        announce(config, run_dir)

    batch_sharding = sharding.batch_sharding(mesh)
    step_fn = jax.jit(
        make_train_step(graphdef, rest, tx, grad_accum=tc.grad_accum, z_loss=tc.z_loss),
        in_shardings=(param_shardings, opt_shardings, batch_sharding, replicated, replicated),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )
    peak = peak_flops_per_device(override=tc.peak_flops)
    log = MetricsLog(run_dir, resume_step=start_step, enabled=primary, trackers=config.run.trackers, config=config,
                     checkpoint_row=restored.meta.get("row") if restored else None)
    if restored is not None:
        log.note(_resume_row(restored, config))
    if primary:
        logger.info("%s parameters; mesh %s; %d process(es); unigram %s perplexity %.1f",
                    f"{num_params:,}", dict(mesh.shape), process_count, config.eval.split, unigram)
    # Where stderr is a file (SLURM, Kubernetes), the progress bar is no reading matter: log a plain line too.
    plain_progress = primary and not sys.stderr.isatty()

    def save(step: int, position) -> None:
        meta = {"tokens_seen": tokens_seen, "row": row if row.get("step") == step else None,
                "processes": process_count, "devices": jax.device_count(), "data_identity": identity}
        checkpoints.save(step, params, opt_state, rng, position, meta, config.to_dict())

    def validation(step: int) -> dict[str, Any]:
        model = nnx.merge(graphdef, params, rest)
        if validate is not None:
            row = {"step": step, **validate(model, step)}
        else:
            row = _validation(model, valid_store, config, mesh, step, primary, final=step == tc.steps)
        log.write(row, prefix="valid")
        return row

    to_device = functools.partial(sharding.global_batch, sharding=batch_sharding, process_count=process_count)
    flops_per_tok = functools.partial(flops_per_token, config.model, num_params=num_params,
                                      vocab_size=config.model.vocab_size)
    window = StepWindow()
    profiler = ProfileWindow(tc.profile, run_dir / "profile")
    last_val: dict[str, Any] | None = None
    row: dict[str, Any] = {}

    def flush(step: int) -> None:
        """Fetch the window's step metrics in one host sync, then check, count and log each step."""
        nonlocal tokens_seen, row
        fetched, seconds = window.fetch()
        for (s, length, rows_), m in zip(window.steps, fetched):
            if not bool(m["finite"]) and tc.nonfinite == "stop":
                checkpoints.wait()
                kept = checkpoints.latest_step()
                raise NonFiniteLoss(
                    f"non-finite loss {float(m['loss'])} (grad norm {float(m['grad_norm'])}) at step {s}; "
                    f"stopping without saving it. Last good checkpoint: "
                    + (f"step {kept} in {run_dir / 'checkpoints'}" if kept is not None else "none")
                    + ". Lower train.lr or set train.nonfinite=skip."
                )
            tokens = int(m["tokens"])
            tokens_seen += tokens
            window.count(tokens, seconds, first=s == start_step + 1)
            tokens_per_s = tokens / seconds
            row = {
                "step": s,
                "loss": float(m["loss"]),
                "learning_rate": float(learning_rates[s]),
                "grad_norm": float(m["grad_norm"]),
                "tokens_per_s": tokens_per_s,
                "mfu": mfu(tokens_per_s, flops_per_tok(length), jax.device_count(), peak),
                "tokens_seen": tokens_seen,
                "padding_fraction": 1.0 - tokens / (rows_ * length),
                "seconds": seconds,
            }
            if tc.z_loss:
                row["objective"] = float(m["objective"])
            if not bool(m["finite"]):
                row["skipped"] = True
            log.write(row)
        window.clear()
        checkpoints.check()  # a background save that failed stops the run here, not one interval later
        bar.update(step - bar.n)
        if row:
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}", refresh=False)
        if plain_progress and row and (step % tc.log_every == 0 or step == tc.steps):
            logger.info("step %d/%d: loss %.4f, %.0f tokens/s", step, tc.steps, row["loss"], row["tokens_per_s"])

    bar = tqdm(total=tc.steps, initial=start_step, desc="train", unit="step", disable=not primary, file=sys.stderr)
    prefetch = DevicePrefetch(data_iterator, to_device, depth=tc.prefetch)
    try:
        with StopRequest(enabled=process_count == 1) as stop, bar, prefetch:
            window.restart()
            for step in range(start_step + 1, tc.steps + 1):
                profiler.before(step)
                batch, position = next(prefetch)
                params, opt_state, m = step_fn(params, opt_state, batch, rng, step)  # rng, step: dropout's key
                # No host sync here: the metrics stay on the device until the window is flushed, so the host
                # runs ahead and dispatches the next step while this one computes.
                window.add(step, m, batch["inputs"].shape)
                profiler.after(step, m)
                checkpoint = step % tc.checkpoint_every == 0 or step == tc.steps
                evaluate = (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps
                stopping = _should_stop(stop, step, process_count)
                # The first step is flushed alone: its time is mostly compilation, kept out of throughput.
                if (step == start_step + 1 or step % tc.log_every == 0 or checkpoint or evaluate or stopping
                        or step == tc.steps):
                    flush(step)  # before any save: a non-finite step must never reach a checkpoint
                if checkpoint or stopping:
                    save(step, position)
                if evaluate:
                    last_val = validation(step)
                    window.restart()  # evaluation time is not training throughput
                if stopping:
                    checkpoints.wait()
                    raise Interrupted(stop.signum or signal.SIGTERM, step)
            if last_val is None and start_step == tc.steps:
                # Resumed at the last step (the final validation was cut short, or never recorded): redo it.
                logger.info("step %d was saved but its final validation never completed: running it now",
                            start_step)
                last_val = validation(start_step)
        checkpoints.wait()
    finally:
        profiler.close()
        checkpoints.close()
        log.close()

    summary = {
        "run_dir": str(run_dir),
        "steps": tc.steps,
        "resumed_from": start_step,
        "parameters": num_params,
        "devices": jax.device_count(),
        "processes": process_count,
        "tokens_seen": tokens_seen,
        "tokens_per_s": window.tokens_per_s(),
        "step_time_s": window.median_step_seconds(),
        "mfu": window.mfu(flops_per_tok(config.data.seq_len), jax.device_count(), peak),
        "peak_memory_bytes": peak_memory_bytes(),
        "wall_seconds": time.perf_counter() - wall_start,
        # A run resumed at its last step took no step: its last train row is the checkpoint's.
        "final_train_loss": (row or (restored.meta.get("row") or {} if restored else {})).get("loss"),
        "val_loss": last_val and last_val["val_loss"],
        "val_perplexity": last_val and last_val["val_perplexity"],
        "val_word_perplexity": last_val and last_val["val_word_perplexity"],
        "val_bits_per_byte": last_val and last_val["val_bits_per_byte"],
        "unigram_perplexity": unigram,
        "eval": dataclasses.asdict(config.eval),
        # The final validation completed and is recorded above: a re-run of this command changes nothing.
        "finished": last_val is not None and bool(last_val.get("val_complete", True)),
    }
    if primary:
        plot_losses(run_dir)
        write_text_atomic(run_dir / SUMMARY_FILE, json_text(summary, indent=2))
    return summary


def _should_stop(stop: StopRequest, step: int, process_count: int) -> bool:
    """Single process: a signal arrived. Multi-host: JAX's preemption sync point, so all processes stop at one step."""
    if process_count > 1:
        return multihost_utils.reached_preemption_sync_point(step)
    return stop.signum is not None

