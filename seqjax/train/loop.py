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
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from flax import nnx

from seqjax.config.load import announce
from seqjax.config.tree import DATA_DIR_ENV, Config, ConfigError
from seqjax.core.files import json_text, write_text_atomic
from seqjax.data.pipeline import build_pipeline
from seqjax.data.strategies import check_config
from seqjax.eval.evaluate import evaluate
from seqjax.eval.windows import resolve_stride
from seqjax.model import build_model, quant, sharding, split_params
from seqjax.model.attention import resolve_backend
from seqjax.store.build import has_split, prepare
from seqjax.store.examples import CHAT_TEMPLATE_FILE, find_chat_template
from seqjax.train import adapters, init_from
from seqjax.train.checkpoint import Checkpointer
from seqjax.train.distributed import initialize_distributed
from seqjax.train.flops import flops_per_token, peak_flops_per_device
from seqjax.train.hooks import Hook, Hooks, StepState
from seqjax.train.metrics import (
    MetricsLog,
    StepLogger,
    check_trackers,
    peak_memory_bytes,
    plot_losses,
    unigram_perplexity,
)
from seqjax.train.optimizer import build_optimizer
from seqjax.train.prefetch import DevicePrefetch
from seqjax.train.profiling import ProfileWindow
from seqjax.train.resume import CHECKPOINTS, TOKENIZER_FILE, Restored
from seqjax.train.rundir import RunLock
from seqjax.train.signals import Interrupted, StopRequest, should_stop
from seqjax.train.step import make_train_step

SUMMARY_FILE = "summary.json"

logger = logging.getLogger(__name__)  # (``log`` in train() is the run's MetricsLog)


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
    """Copy the tokenizer (and its chat template, if any) into run.dir (the saved config points there), so the
    run folder stands alone."""
    own = run_dir / TOKENIZER_FILE
    if tokenizer_path.resolve() != own.resolve():
        write_text_atomic(own, tokenizer_path.read_text(encoding="utf-8"))
        template = find_chat_template(tokenizer_path)
        if template is not None:
            write_text_atomic(run_dir / CHAT_TEMPLATE_FILE, template)


def _validation(model, store, config: Config, mesh, step: int, primary: bool, final: bool) -> dict[str, Any]:
    """Validation with the eval CLI's code; capped at train.eval_batches during training, whole split at the end.

    A mixture's validation also scores each source's split alone (as Levanter reports each dataset's loss):
    ``val_sources`` holds each one's loss and perplexity.
    """
    max_batches = None if final else config.train.eval_batches
    result = evaluate(model, store, config, mesh=mesh, max_batches=max_batches, progress=primary)
    val_loss = result["nll_sum"] / result["tokens"]
    row = {
        "step": step,
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "val_tokens": result["tokens"],
        "val_complete": result["complete"],
        "val_word_perplexity": result["word_perplexity"],
        "val_bits_per_byte": result["bits_per_byte"],
    }
    if store.source_stores:
        row["val_sources"] = {}
        for (name, *_), source in zip(store.sources, store.source_stores):
            alone = evaluate(model, source, config, mesh=mesh, max_batches=max_batches, progress=False)
            loss = alone["nll_sum"] / alone["tokens"]
            row["val_sources"][name] = {"loss": loss, "perplexity": math.exp(loss), "tokens": alone["tokens"]}
    return row


@dataclasses.dataclass
class _Placed:
    """The model split for training and placed on the mesh: what trains (every parameter, or model.lora's adapters)
    and, under adapters, the frozen base, each a pure dict with its shardings."""

    graphdef: nnx.GraphDef
    rest: nnx.State
    params: dict
    param_shardings: dict
    frozen: dict | None = None
    frozen_shardings: dict | None = None


def _sharded_model(config: Config, mesh) -> _Placed:
    model = build_model(config, rngs=nnx.Rngs(config.run.seed))
    graphdef, trained, frozen, rest = split_params(model)
    placed = _Placed(graphdef, rest, {}, sharding.param_shardings(trained, mesh))
    placed.params = sharding.place(nnx.to_pure_dict(trained), placed.param_shardings)
    if frozen is not None:
        placed.frozen_shardings = sharding.param_shardings(frozen, mesh)
        placed.frozen = sharding.place(nnx.to_pure_dict(frozen), placed.frozen_shardings)
    return placed


def _sharded_optimizer_state(tx: optax.GradientTransformation, params: dict, param_shardings: dict, replicated):
    """AdamW's state created directly on the mesh: moments sharded like their parameters, counters replicated."""
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, params), param_shardings, transform_non_params=lambda _: replicated
    )
    return jax.jit(tx.init, out_shardings=opt_shardings)(params), opt_shardings


def train(config: Config, *, validate: Callable[[nnx.Module, int], dict[str, Any]] | None = None,
          hooks: Sequence[Hook] = ()) -> dict[str, Any]:
    """Run (or resume) training for ``train.steps`` steps; return the summary also written to summary.json.

    The run holds the lock on ``run.dir`` from before any work to the end
    (:class:`~seqjax.train.rundir.RunLock`): a second run there is refused.

    ``validate(model, step)``, when given, replaces the built-in validation (every ``train.eval_every``
    steps and at the end). It returns the row logged under "valid", with at least ``val_loss``,
    ``val_perplexity``, ``val_word_perplexity`` and ``val_bits_per_byte``, which the summary reports.
    scripts/study_strategies.py scores a fixed subset of articles this way.

    ``hooks`` run after the built-in ones (flush, checkpoint, validate, stop, profile) at the steps each names:
    see :mod:`seqjax.train.hooks`.
    """
    wall_start = time.perf_counter()
    if config.eval.mode == "lm_eval":
        raise ConfigError("eval.mode: got 'lm_eval' for training's validation, expected blocks, sliding or documents "
                          "(lm_eval scores raw pages with python -m seqjax.eval after training)")
    check_config(config)  # the strategy tables' rules, as every command checks them after loading
    check_trackers(config.run.trackers)  # a tracker asked for but not installed: refused before any work
    initialize_distributed(config.dist)
    mesh = sharding.build_mesh(config.mesh)  # bad mesh sizes fail before any data work
    resolve_backend(config.model.attention, config.model.compute_dtype,  # so does a backend this machine lacks
                    windows=config.model.has_windows)
    sharding.check_batch_fits(config.data.batch_size, mesh, config.train.grad_accum)
    source = None
    if config.train.init_from:  # the source's tokenizer and shapes: a mismatch is refused before run.dir exists
        source = init_from.locate(config.train.init_from)
        config = init_from.adopt(config, source)
        saved = _saved_steps(Path(config.run.dir))
        if saved and config.model.lora.rank:  # checkpoints hold the adapters only: their base is read again
            logger.info("run.dir %s holds checkpoints (newest: step %d): the adapters resume from them, on their "
                        "base train.init_from=%s", config.run.dir, max(saved), config.train.init_from)
        elif saved:  # said before any work: resuming the run's own checkpoints wins (as a requeued job expects)
            logger.warning("run.dir %s holds checkpoints (newest: step %d): the run resumes from them and "
                           "train.init_from=%s is not read (it only starts a new run; use a new run.dir to "
                           "fine-tune afresh)", config.run.dir, max(saved), config.train.init_from)
            source = None
    with RunLock(config.run.dir, jax.process_index(), jax.process_count()):
        finished = finished_summary(Path(config.run.dir), config.train.steps)
        if finished is not None:
            # A scheduler that requeues a finished job lands here: its results stay as they are.
            logger.info("%s already finished its %d steps (its summary.json holds the final validation); "
                        "nothing to do and nothing rewritten: raise train.steps to continue it", config.run.dir,
                        config.train.steps)
            return finished
        return _train(config, mesh, wall_start, validate, source, hooks)


def _saved_steps(run_dir: Path) -> list[int]:
    """The committed checkpoint steps in ``run_dir`` (orbax names a step folder by its number once committed)."""
    folder = run_dir / CHECKPOINTS
    return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []


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
    validated = summary.get("val_loss") is not None or summary.get("validation") is False  # (none asked for)
    return summary if summary.get("finished") and validated else None


@dataclasses.dataclass
class _Setup:
    """What a run builds before its first step: the resolved config, data, sharded state and the compiled step."""

    config: Config
    run_dir: Path
    primary: bool
    tokenizer_source: Path
    valid_store: Any  # None: no validation data, the run trains without validation
    unigram: float | None
    graphdef: nnx.GraphDef
    rest: nnx.State
    params: Any
    opt_state: Any
    rng: jax.Array
    num_params: int
    learning_rates: np.ndarray
    data_iterator: Any
    identity: dict[str, Any]
    frozen: tuple  # () or (the frozen base under model.lora,): the step's last argument
    base: dict[str, Any] | None  # model.lora: the base the adapters belong to (train.init_from and a hash)
    step_fn: Callable
    to_device: Callable


def _setup(config: Config, mesh, source: init_from.Source | None) -> _Setup:
    """Tokenizer and stores, the sharded model and optimizer state, the data iterator and the jitted step."""
    tc = config.train
    # The tokenizer first: a model vocabulary too small for it is refused before any store is built.
    config = _with_data_dir(_with_vocab(config, prepare(config, splits=()).tokenizer.vocab_size))
    # The longest sequence it trains on becomes the saved model's limit: eval and generate then refuse longer ones
    # alike (model.max_seq_len=N on their command line evaluates beyond it, on purpose).
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_seq_len=config.max_seq_len))
    validation = has_split(config, config.eval.split)
    if not validation:
        logger.warning("no %s split (no %s_files, and data.validation_split_percentage is 0): training without "
                       "validation", config.eval.split, config.eval.split)
    prepared = prepare(config, splits=("train", config.eval.split) if validation else ("train",))
    train_store, valid_store = prepared.stores["train"], prepared.stores.get(config.eval.split)
    # The run keeps its own copy of the tokenizer (written once the resume is accepted, with config.yaml).
    run_dir = Path(config.run.dir)
    config = dataclasses.replace(config, tokenizer=dataclasses.replace(config.tokenizer,
                                                                       path=str(run_dir / TOKENIZER_FILE)))
    placed = _sharded_model(config, mesh)
    lora = config.model.lora.rank > 0
    if source is not None:
        loaded = init_from.load_params(source, config.model.param_dtype, config.model.scan_layers)
        if lora:  # the source is the frozen base; the adapters start as LoRA starts (B = 0: the base's function)
            placed.frozen = sharding.place(loaded, placed.frozen_shardings)
        else:
            placed.params = sharding.place(loaded, placed.param_shardings)
        logger.info("%s from %s (optimizer, step and data position start fresh)",
                    "base parameters" if lora else "parameters", source.path)
    # What the adapters belong to: the base as read, before QLoRA stores it quantized.
    base = None if placed.frozen is None else adapters.base_identity(placed.frozen, config.train.init_from)
    if config.model.lora.quantize != "none":
        lora = config.model.lora
        frozen = quant.quantize_base(placed.frozen, lora.quantize, lora.quant_block, config.model.scan_layers)
        logger.info("base stored with its projections as %s: %.1f MB (%.1f MB as read)", lora.quantize,
                    quant.stored_bytes(frozen) / 1e6, quant.stored_bytes(placed.frozen) / 1e6)
        placed.frozen_shardings = quant.shardings(placed.frozen_shardings, frozen, sharding.replicated(mesh))
        placed.frozen = sharding.place(frozen, placed.frozen_shardings)
    if tc.init_adapter:
        placed.params = sharding.place(adapters.read_adapter(tc.init_adapter, config), placed.param_shardings)
        logger.info("adapters from %s", tc.init_adapter)
    graphdef, rest, params, param_shardings = placed.graphdef, placed.rest, placed.params, placed.param_shardings
    tx, schedule = build_optimizer(tc)
    replicated = sharding.replicated(mesh)
    opt_state, opt_shardings = _sharded_optimizer_state(tx, params, param_shardings, replicated)
    batch_sharding = sharding.batch_sharding(mesh)
    process_index, process_count = jax.process_index(), jax.process_count()
    return _Setup(
        config=config, run_dir=run_dir, primary=process_index == 0,
        tokenizer_source=Path(prepared.tokenizer.path), valid_store=valid_store,
        unigram=None if valid_store is None else unigram_perplexity(train_store.tokens, valid_store.tokens,
                                                                     config.model.vocab_size),
        graphdef=graphdef, rest=rest, params=params, opt_state=opt_state,
        frozen=() if placed.frozen is None else (placed.frozen,),
        rng=sharding.place(jax.random.key_data(jax.random.key(config.run.seed)), replicated),
        num_params=sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        # Every step's learning rate up front: one small computation instead of eager ops in the loop.
        learning_rates=np.asarray(jax.jit(jax.vmap(schedule))(np.arange(tc.steps + 1))),
        data_iterator=iter(build_pipeline(config, train_store, process_index=process_index,
                                          process_count=process_count)),
        # What the batches are cut from; a checkpoint records it, so a resume on other text or tokenizer is seen.
        identity={"tokenizer": prepared.tokenizer.hash, "sources": train_store.text_identity},
        base=base,
        step_fn=jax.jit(
            make_train_step(graphdef, rest, tx, grad_accum=tc.grad_accum, z_loss=tc.z_loss),
            in_shardings=(param_shardings, opt_shardings, batch_sharding, replicated, replicated,
                          *([] if placed.frozen is None else [placed.frozen_shardings])),
            out_shardings=(param_shardings, opt_shardings, replicated),
            donate_argnums=(0, 1),
        ),
        to_device=functools.partial(sharding.global_batch, sharding=batch_sharding, process_count=process_count),
    )


def _with_data_dir(config: Config) -> Config:
    """data.dir filled from $SEQJAX_DATA_DIR when unset, so the saved config.yaml finds the corpus again.

    (The eval command run after a train command then needs no environment of its own.)
    """
    env = os.environ.get(DATA_DIR_ENV)
    if config.data.dir is not None or not env:
        return config
    return dataclasses.replace(config, data=dataclasses.replace(config.data, dir=str(Path(env).expanduser().resolve())))


def _restore(checkpoints: Checkpointer, run: _Setup) -> Restored | None:
    """Resume from the newest readable checkpoint (None: a new run), and say what the resume changed."""
    config = run.config
    try:
        restored = checkpoints.restore_latest(run.params, run.opt_state, run.rng, config, run.identity)
        if restored is not None and restored.step > config.train.steps:
            raise ConfigError(f"train.steps: got {config.train.steps}, expected at least {restored.step}, the step "
                              f"of the newest checkpoint in {checkpoints.directory} (raise it to continue the run)")
        if restored is not None and run.base is not None:  # adapters belong to one base: another is refused
            adapters.check_base(restored.meta.get("lora_base"), run.base, checkpoints.directory / str(restored.step))
    except BaseException:
        checkpoints.close()
        raise
    if restored is None:
        return None
    step = restored.step
    if restored.data_state is not None:
        run.data_iterator.set_state(restored.data_state)
    logger.info("resuming from %s (step %d)", checkpoints.directory / str(step), step)
    if restored.changes:
        logger.warning("config changes since checkpoint %d: %s", step, "; ".join(map(str, restored.changes)))
    if restored.data_restart is not None:
        logger.warning("the data restarts at %s of the new config (train.allow_config_change), not where "
                       "checkpoint %d stopped (%s)", restored.data_restart["to"], step, restored.data_restart["from"])
    was = (restored.meta.get("processes"), restored.meta.get("devices"))
    if None not in was and was != (jax.process_count(), jax.device_count()):
        logger.info("elastic resume: checkpoint %d was written by %d process(es) on %d device(s), now %d on %d",
                    step, *was, jax.process_count(), jax.device_count())
    return restored


def _resume_row(restored: Restored) -> dict[str, Any]:
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


def _validate(run: _Setup, params, mesh, step: int, validate, log: MetricsLog) -> dict[str, Any]:
    """One validation (the caller's ``validate``, or the built-in one), logged to metrics.jsonl and stderr."""
    model = nnx.merge(run.graphdef, params, *run.frozen, run.rest)
    if validate is not None:
        row = {"step": step, **validate(model, step)}
    else:
        row = _validation(model, run.valid_store, run.config, mesh, step, run.primary,
                          final=step == run.config.train.steps)
    log.write(row, prefix="valid")
    if run.primary:
        logger.info("step %d: validation loss %.4f, perplexity %.2f", step, row["val_loss"], row["val_perplexity"])
        for name, source in row.get("val_sources", {}).items():
            logger.info("step %d: validation loss %.4f, perplexity %.2f on source %s", step, source["loss"],
                        source["perplexity"], name)
    return row


def _last_good(checkpoints: Checkpointer) -> str:
    checkpoints.wait()
    kept = checkpoints.latest_step()
    return f"step {kept} in {checkpoints.directory}" if kept is not None else "none"


def _train(config: Config, mesh, wall_start: float, validate, source: init_from.Source | None,
           extra_hooks: Sequence[Hook]) -> dict[str, Any]:
    run = _setup(config, mesh, source)
    config, tc, process_count = run.config, run.config.train, jax.process_count()
    checkpoints = Checkpointer(run.run_dir, tc)
    restored = _restore(checkpoints, run)
    params, opt_state, rng = (restored.params, restored.opt_state, restored.rng) if restored else \
        (run.params, run.opt_state, run.rng)
    start_step = restored.step if restored else 0
    if run.primary:  # after the resume was accepted: a refused one leaves config.yaml and tokenizer.json as they were
        _keep_tokenizer(run.tokenizer_source, run.run_dir)
        announce(config, run.run_dir)
        logger.info("%s parameters; mesh %s; %d process(es); unigram %s perplexity %s",
                    f"{run.num_params:,}", dict(mesh.shape), process_count, config.eval.split,
                    "n/a" if run.unigram is None else f"{run.unigram:.1f}")
    log = MetricsLog(run.run_dir, resume_step=start_step, enabled=run.primary, trackers=config.run.trackers,
                     config=config, checkpoint_row=restored.meta.get("row") if restored else None)
    if restored is not None:
        log.note(_resume_row(restored))
    peak = peak_flops_per_device(override=tc.peak_flops)
    flops_per_tok = functools.partial(flops_per_token, config.model, num_params=run.num_params,
                                      vocab_size=config.model.vocab_size)
    steps = StepLogger(log, steps=tc.steps, start_step=start_step, log_every=tc.log_every,
                       tokens_seen=int(restored.meta["tokens_seen"]) if restored else 0,
                       learning_rates=run.learning_rates, flops_per_token=flops_per_tok, peak=peak,
                       z_loss=bool(tc.z_loss), nonfinite=tc.nonfinite, primary=run.primary,
                       last_good=functools.partial(_last_good, checkpoints))
    profiler = ProfileWindow(tc.profile, run.run_dir / "profile")
    validating = run.valid_store is not None or validate is not None
    last_val: list[dict[str, Any]] = []  # the newest validation row, filled by the validate hook

    def flush(state: StepState) -> None:
        steps.flush(state.step)
        checkpoints.check()  # a background save that failed stops the run here, not later

    def save(state: StepState) -> None:
        meta = {"tokens_seen": steps.tokens_seen, "row": steps.last_row or None,
                "processes": process_count, "devices": jax.device_count(), "data_identity": run.identity,
                **({"lora_base": run.base} if run.base is not None else {})}
        checkpoints.save(state.step, state.params, state.opt_state, state.rng, state.position, meta,
                         config.to_dict())

    def validation(state: StepState) -> None:
        last_val[:] = [_validate(run, state.params, mesh, state.step, validate, log)]
        steps.restart()  # validation time is not training throughput

    def stop(state: StepState) -> None:
        checkpoints.wait()
        raise Interrupted(stop_request.signum or signal.SIGTERM, state.step)

    hooks = Hooks(Hook("flush", flush, when=lambda s: steps.due(s.step)), last_step=tc.steps)
    hooks.add(Hook("checkpoint", save, every=tc.checkpoint_every, when=lambda s: s.stopping))
    if validating:
        hooks.add(Hook("validate", validation, every=tc.eval_every))
    hooks.add(Hook("stop", stop, at_last=False, when=lambda s: s.stopping))
    hooks.add(Hook("profile", profiler.after, at_last=False, when=profiler.due, after_flush=False))
    hooks.extend(extra_hooks)
    try:
        with StopRequest(enabled=process_count == 1) as stop_request, steps, \
                DevicePrefetch(run.data_iterator, run.to_device, depth=tc.prefetch) as prefetch:
            profiler.begin(start_step + 1)
            for step in range(start_step + 1, tc.steps + 1):
                batch, position = next(prefetch)
                # rng, step: dropout's key; run.frozen: the base under adapters, if any
                params, opt_state, m = run.step_fn(params, opt_state, batch, rng, step, *run.frozen)
                # No host sync here: the metrics stay on the device until a hook flushes them, so the host
                # runs ahead and dispatches the next step while this one computes.
                steps.add(step, m, batch["inputs"].shape)
                hooks.after_step(StepState(step, params, opt_state, rng, position,
                                           stopping=should_stop(stop_request, step, process_count)))
            if not last_val and start_step == tc.steps and validating:
                # Resumed at the last step (the final validation was cut short, or never recorded): redo it.
                logger.info("step %d was saved but its final validation never completed: running it now", start_step)
                last_val[:] = [_validate(run, params, mesh, start_step, validate, log)]
        checkpoints.wait()
    finally:
        profiler.close()
        checkpoints.close()
        log.close()
    return _summary(run, steps, restored, last_val[0] if last_val else None, flops_per_tok(config.data.seq_len), peak,
                    wall_start)


def _summary(run: _Setup, steps: StepLogger, restored: Restored | None, last_val: dict[str, Any] | None,
             flops_per_tok: float, peak: float | None, wall_start: float) -> dict[str, Any]:
    """summary.json: what the run did, its throughput, and the final validation (written by the primary process)."""
    config, window = run.config, steps.window
    # A run resumed at its last step took no step: its last train row is the checkpoint's.
    last_row = steps.last_row or (restored.meta.get("row") if restored else None) or {}
    summary = {
        "run_dir": str(run.run_dir),
        "steps": config.train.steps,
        "resumed_from": restored.step if restored else 0,
        "parameters": run.num_params,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "tokens_seen": steps.tokens_seen,
        "tokens_per_s": window.tokens_per_s(),
        "step_time_s": window.median_step_seconds(),
        "mfu": window.mfu(flops_per_tok, jax.device_count(), peak),
        "peak_memory_bytes": peak_memory_bytes(),
        "wall_seconds": time.perf_counter() - wall_start,
        "final_train_loss": last_row.get("loss"),
        "val_loss": last_val and last_val["val_loss"],
        "val_perplexity": last_val and last_val["val_perplexity"],
        "val_word_perplexity": last_val and last_val["val_word_perplexity"],
        "val_bits_per_byte": last_val and last_val["val_bits_per_byte"],
        "val_sources": last_val and last_val.get("val_sources"),
        "unigram_perplexity": run.unigram,
        "eval": dataclasses.asdict(config.eval),
        # What the final validation really used (the keys above may be null: their defaults resolved here).
        "eval_context": config.eval_context,
        "eval_stride": resolve_stride(config.eval.mode, config.eval_context, config.eval.stride),
        # The final validation completed and is recorded above: a re-run of this command changes nothing.
        "finished": (last_val is not None and bool(last_val.get("val_complete", True))) or (
            run.valid_store is None and last_val is None),  # (no validation data: reaching the last step is all)
        "validation": run.valid_store is not None,
    }
    if run.primary:
        plot_losses(run.run_dir)
        write_text_atomic(run.run_dir / SUMMARY_FILE, json_text(summary, indent=2))
    return summary
