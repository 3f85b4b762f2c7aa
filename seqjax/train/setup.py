"""What a run holds before its first step: the resolved config, the data, the model's state placed
on the mesh, the optimizer state and the compiled step; and, when the run dir holds checkpoints,
that state restored.

The model's state is split as training needs it (:func:`seqjax.model.split_params`): what trains
(every weight, or ``model.lora``'s adapters) and, under adapters, the frozen base, stored as
``model.lora.quantize`` says (:func:`seqjax.model.assembly.stored_base`). Where each part starts:

==================  =============================================  ==============================================
part                new run                                         resumed run
==================  =============================================  ==============================================
trained weights     ``run.seed``'s initialization, or              the newest readable checkpoint
                    ``train.init_from`` (no adapters)
adapters            ``model.lora.init`` (B = 0; DoRA's m = ||W||),  the newest readable checkpoint
                    or ``train.init_adapter`` (a PEFT folder)
modules_to_save     as the trained weights                          the newest readable checkpoint
frozen base         ``train.init_from``, or ``run.seed``'s init     the same again, checked against the
                                                                    checkpoint's record of it (xxh3)
optimizer, RNG,     fresh                                           the checkpoint
data position
==================  =============================================  ==============================================
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from seqjax.config.tree import DATA_DIR_ENV, Config, ConfigError
from seqjax.core.errors import CheckpointMismatchError
from seqjax.core.files import write_text_atomic
from seqjax.data.contract import check_reads
from seqjax.model import build_model, quant, sharding, split_params
from seqjax.model.assembly import dora_magnitudes, stored_base
from seqjax.model.lora import adapters_off, frozen_part, saved_part
from seqjax.objectives import Objective, resolve, settings_of
from seqjax.store.build import prepare
from seqjax.store.chat import find_chat_template
from seqjax.store.image_chats import read_image_spec
from seqjax.store.spec import CHAT_TEMPLATE_FILE
from seqjax.train import precompute
from seqjax.train.checkpoint import Checkpointer
from seqjax.train.metrics import unigram_perplexity
from seqjax.train.optimizer import build_optimizer
from seqjax.train.policy import Frozen, Policy, reference_states
from seqjax.train.source import Opening, SourceRow, source_row
from seqjax.train.step import make_train_step
from seqjax.weights import adapters, init_from
from seqjax.weights.reference import BASE, MODEL, Reference, decide, named_weights, same_weights_rule
from seqjax.weights.saved import CHECKPOINTS, TOKENIZER_FILE, Restored

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Setup:
    """What a run builds before its first step: the resolved config, data, sharded state and the
    compiled step."""

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
    num_params: int  # what trains
    model_params: int  # the whole model's (the frozen base included)
    learning_rates: np.ndarray
    source: Any  # where the batches come from (seqjax.train.source's row): the store's, or an RL run's rollouts
    identity: dict[str, Any]
    # what the step reads but never trains: the frozen base under model.lora, a reference's own
    # weights
    frozen: Frozen
    # model.lora: the base the adapters belong to (train.init_from and a hash)
    base: dict[str, Any] | None
    # the reference decision (weights.reference), and a named model's identity (path and hash)
    reference: Reference
    reference_identity: dict[str, Any] | None
    objective: Objective
    # the policy and its reference, as one record (seqjax.train.policy)
    policy: Policy
    # train.reference=precompute: each split's reference log-probabilities [pairs, 2], else None
    reference_tables: dict[str, np.ndarray] | None
    overlong: dict[
        str, Any] | None  # what data.overlong did to the train split (the log's line, summary.json)
    step_fn: Callable
    to_device: Callable


@dataclasses.dataclass
class Placed:
    """The model split for training and placed on the mesh: what trains (every parameter, or
    model.lora's adapters) and, under adapters, the frozen base, each a pure dict with its
    shardings."""

    graphdef: nnx.GraphDef
    rest: nnx.State
    params: dict
    param_shardings: dict
    frozen: dict | None = None
    frozen_shardings: dict | None = None
    model_params: int = 0  # every parameter, the frozen base's as built (before QLoRA stores it)


def with_vocab(config: Config, vocab_size: int) -> Config:
    """Fill model.vocab_size from the tokenizer; a larger one (padded rows) is fine, a smaller one
    is refused.

    A smaller embedding would only show up as NaN losses under jit, where
    out-of-range ids cannot raise, so it is stopped here, before any work.
    """
    if config.model.vocab_size is None:
        return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                     vocab_size=vocab_size))
    if config.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size: got {config.model.vocab_size}, expected at least the tokenizer's "
            f"{vocab_size} (or null to take it from the tokenizer)")
    return config


def with_data_dir(config: Config) -> Config:
    """data.dir filled from $SEQJAX_DATA_DIR when unset, so the saved config.yaml finds the corpus
    again.

    (The eval command run after a train command then needs no environment of its own.)
    """
    env = os.environ.get(DATA_DIR_ENV)
    if config.data.dir is not None or not env:
        return config
    return dataclasses.replace(
        config, data=dataclasses.replace(config.data, dir=str(Path(env).expanduser().resolve())))


def keep_tokenizer(tokenizer_path: Path, run_dir: Path) -> None:
    """Copy the tokenizer (and its chat template, if any) into run.dir (the saved config points
    there), so the run folder stands alone."""
    own = run_dir / TOKENIZER_FILE
    if tokenizer_path.resolve() != own.resolve():
        write_text_atomic(own, tokenizer_path.read_text(encoding="utf-8"))
        template = find_chat_template(tokenizer_path)
        if template is not None:
            write_text_atomic(run_dir / CHAT_TEMPLATE_FILE, template)


def count(tree) -> int:
    """The number of parameters in ``tree``."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def sharded_model(config: Config, mesh) -> Placed:
    """The model of ``run.seed``'s initialization, split (what trains; the frozen base) and placed
    on the mesh."""
    model = build_model(config, rngs=nnx.Rngs(config.run.seed))
    graphdef, trained, frozen, rest = split_params(model)
    placed = Placed(graphdef, rest, {}, sharding.param_shardings(trained, mesh))
    placed.params = sharding.place(nnx.to_pure_dict(trained), placed.param_shardings)
    if frozen is not None:
        placed.frozen_shardings = sharding.param_shardings(frozen, mesh)
        placed.frozen = sharding.place(nnx.to_pure_dict(frozen), placed.frozen_shardings)
    placed.model_params = count(placed.params) + count(placed.frozen)
    return placed


def starting_weights(config: Config, mesh,
                     source: init_from.Source | None) -> tuple[Placed, dict | None]:
    """The placed model with its starting weights (``train.init_from``, ``train.init_adapter``), the
    base stored as QLoRA asks; and the record of the base the adapters belong to (None without
    adapters)."""
    placed = sharded_model(config, mesh)
    lora = config.model.lora
    if source is not None:
        loaded = init_from.load_params(source, config.model.param_dtype, config.model.scan_layers)
        # the source is the frozen base (and where modules_to_save start); the adapters start as
        # LoRA starts (B = 0: the base's function)
        if lora.rank:
            placed.frozen = sharding.place(frozen_part(loaded, lora), placed.frozen_shardings)
            placed.params = sharding.place({**placed.params, **saved_part(loaded, lora)},
                                           placed.param_shardings)
        else:
            placed.params = sharding.place(loaded, placed.param_shardings)
        # (a run resuming its own checkpoints reads its base here, and the rest from the checkpoint:
        # say which)
        saved = Path(config.run.dir) / CHECKPOINTS
        resuming = saved.is_dir() and any(p.name.isdigit() for p in saved.iterdir())
        log.info("%s from %s%s", "base parameters" if lora.rank else "parameters", source.path,
                 "" if resuming else " (optimizer, step and data position start fresh)")
    # What the adapters belong to: the base as read, before QLoRA stores it quantized.
    base = None if placed.frozen is None else adapters.base_identity(placed.frozen,
                                                                     config.train.init_from)
    if lora.quantize != "none":
        frozen = stored_base(placed.frozen, config.model)
        log.info("base stored with its projections as %s: %.1f MB (%.1f MB as read)", lora.quantize,
                 quant.stored_bytes(frozen) / 1e6, quant.stored_bytes(placed.frozen) / 1e6)
        placed.frozen_shardings = quant.shardings(placed.frozen_shardings, frozen,
                                                  sharding.replicated(mesh))
        placed.frozen = sharding.place(frozen, placed.frozen_shardings)
    if config.train.init_adapter:
        placed.params = sharding.place(adapters.read_adapter(config.train.init_adapter, config),
                                       placed.param_shardings)
        log.info("adapters from %s", config.train.init_adapter)
    elif source is not None and lora.dora:  # DoRA's magnitudes start at the norms of the base read
        placed.params = sharding.place(dora_magnitudes(placed.params, placed.frozen, config.model),
                                       placed.param_shardings)
    return placed, base


def sharded_optimizer_state(tx: optax.GradientTransformation, params: dict, param_shardings: dict,
                            replicated):
    """AdamW's state created directly on the mesh: moments sharded like their parameters, counters
    replicated."""
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                                          param_shardings,
                                          transform_non_params=lambda _: replicated)
    return jax.jit(tx.init, out_shardings=opt_shardings)(params), opt_shardings


def resolved(config: Config, row: SourceRow) -> tuple[Config, Any]:
    """The config with the tokenizer's vocabulary, $SEQJAX_DATA_DIR and the trained length filled
    in; the stores its batch source reads (``row.splits``)."""
    # The tokenizer first: a model vocabulary too small for it is refused before any store is built.
    config = with_data_dir(with_vocab(config, prepare(config, splits=()).tokenizer.vocab_size))
    # The longest sequence it trains on becomes the saved model's limit: eval and generate then
    # refuse longer ones alike (model.max_seq_len=N on their command line evaluates beyond it, on
    # purpose).
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, max_seq_len=config.max_seq_len))
    prepared = prepare(config, splits=row.splits(config))
    # The run keeps its own copy of the tokenizer (written once the resume is accepted, with
    # config.yaml).
    tokenizer = dataclasses.replace(config.tokenizer, path=str(Path(config.run.dir) / TOKENIZER_FILE))
    return dataclasses.replace(config, tokenizer=tokenizer), prepared


def objective_of(config: Config) -> Objective:
    """``train.objective``'s row (or weighted sum of rows), refused in one line when unknown, when
    it reads a batch field the data does not give, or ignores one the data needs read; images
    need a model with a vision tower."""
    tc = config.train
    if config.data.image_processor is not None and not config.model.vision.depth:
        raise ConfigError(
            f"data.image_processor: got {config.data.image_processor!r} for a model without a "
            "vision tower (model.vision.depth 0); expected model.vision and model.mrope_section "
            "set as the checkpoint's (configs/qwen3_vl_lora.yaml)")
    if config.data.image_processor is not None:
        check_processor(config)
    objective = resolve(tc.objective, tc.objective_weights)
    who = f"train.objective={','.join(tc.objective)}"
    check_reads(objective.reads, config, who)
    # (a reference that cannot be: one line before any work)
    decide(config, source_row(config).wants_reference(config, objective))
    return objective


def check_processor(config: Config) -> None:
    """The image processor cuts the patches the tower takes: its patch, temporal pair and merge
    sizes are the tower's, or one line before any image is read."""
    processor, vision = config.data.image_processor, config.model.vision
    spec = read_image_spec(processor)
    tower = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
             "merge_size": vision.spatial_merge_size}
    for key, ours in tower.items():
        if getattr(spec, key) != ours:
            raise ConfigError(f"data.image_processor: {processor} has {key} {getattr(spec, key)}, "
                              f"but model.vision's tower takes {ours}; expected the processor of "
                              "its tower")


def reference_arguments(placed: Placed, config: Config, ref: Reference):
    """(:class:`Frozen`, its shardings, the adapters-off graph or None, a named reference's
    identity or None): the frozen base under adapters and the reference's own weights
    (:mod:`seqjax.weights.reference`): none (no reference, or the base with the adapters off); a
    frozen copy of what trains; or a named model's weights, in the copy's place (a full
    fine-tune) or the base's (its adapters off). A reference whose log-probabilities are
    precomputed gets its weights only to compute them (a copy is then the starting weights
    themselves: nothing has trained yet)."""
    frozen, shardings = Frozen(base=placed.frozen), Frozen(base=placed.frozen_shardings)
    if ref.kind is None:
        return frozen, shardings, None, None
    off = None if placed.frozen is None else adapters_off(placed.graphdef, placed.params, placed.frozen,
                                                          placed.rest)
    if ref.kind == BASE:
        return frozen, shardings, off, None
    if ref.kind == MODEL:
        named = named_weights(ref, config)
        identity = adapters.base_identity(named, ref.path)
        log.info("the reference model: %s", ref.path)
        if placed.frozen is None:
            return (frozen._replace(reference=sharding.place(named, placed.param_shardings)),
                    shardings._replace(reference=placed.param_shardings), None, identity)
        stored = stored_base(frozen_part(named, config.model.lora), config.model)
        return (frozen._replace(reference=sharding.place(stored, placed.frozen_shardings)),
                shardings._replace(reference=placed.frozen_shardings), off, identity)
    # a copy of the starting weights (the step donates what trains, so the copy is its own buffers)
    copy = placed.params if ref.precompute else sharding.place(jax.tree.map(jnp.copy, placed.params),
                                                               placed.param_shardings)
    log.info("the reference model: a frozen copy of the starting %s", "adapters" if placed.frozen else "weights")
    return frozen._replace(reference=copy), shardings._replace(reference=placed.param_shardings), None, None


def precomputed_reference(config: Config, policy: Policy, placed: Placed, frozen: Frozen, base: dict[str, Any] | None,
                          named: dict[str, Any] | None, stores: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """``train.precompute_reference``: each split's table of the reference's log-probabilities
    (:mod:`seqjax.train.precompute`) of the policy's reference model (the base with the adapters
    off, the starting weights, or the model ``train.reference`` names), with its identity. None
    for a reference the step runs, or none."""
    ref = policy.reference
    if ref.kind is None or not ref.precompute:
        return None
    if ref.kind == MODEL:
        base = named
    elif placed.frozen is None:
        base = adapters.base_identity(placed.params, config.train.init_from)
    graphdef, *states = reference_states(policy.graphdef, policy.reference_graphdef, policy.rest, placed.params,
                                         frozen.base, frozen.reference)
    return precompute.reference_tables(config, graphdef, tuple(states), base,
                                       {k: v for k, v in stores.items() if v is not None})


def setup(config: Config, mesh, source: init_from.Source | None) -> Setup:
    """Tokenizer and stores, the sharded model and optimizer state, the batch source and the
    jitted step. What differs between kinds of data is the batch source's row
    (:func:`source_row`), asked once."""
    row = source_row(config)
    config, prepared = resolved(config, row)
    train_store, valid_store = prepared.stores.get("train"), prepared.stores.get(config.eval.split)
    objective = objective_of(config)
    overlong = row.overlong(config, prepared)
    config, plan = row.plan(config, prepared, mesh)  # (before any weight is read: bad data is one line at once)
    tc = config.train
    placed, base = starting_weights(config, mesh, source)
    ref = decide(config, row.wants_reference(config, objective))
    if ref.kind is None and config.train.reference not in ("auto", "copy"):
        log.warning("train.reference=%s is not used: this run compares with no reference model (train.objective=%s "
                    "has none, or an RL run's rl.beta is 0)", config.train.reference, ",".join(config.train.objective))
    frozen, frozen_shardings, reference_graphdef, named = reference_arguments(placed, config, ref)
    policy = Policy(placed.graphdef, placed.rest, ref, reference_graphdef, same_weights_rule(ref, config))
    tables = precomputed_reference(config, policy, placed, frozen, base, named,
                                   {"train": train_store, config.eval.split: valid_store}) if row.precomputes else None
    if ref.precompute:  # (the step reads the tables: it keeps no reference weights)
        frozen, frozen_shardings = frozen._replace(reference=None), frozen_shardings._replace(reference=None)
    tx, schedule = build_optimizer(tc)
    replicated = sharding.replicated(mesh)
    opt_state, opt_shardings = sharded_optimizer_state(tx, placed.params, placed.param_shardings,
                                                       replicated)
    batch_sharding = sharding.batch_sharding(mesh)
    to_device = functools.partial(sharding.global_batch, sharding=batch_sharding, process_count=jax.process_count())
    batch_source = row.open(Opening(config, prepared, plan, policy, placed.params, frozen, mesh, to_device, tables))
    step = make_train_step(placed.graphdef, placed.rest, tx, grad_accum=tc.grad_accum,
                           z_loss=tc.z_loss, objective=objective, settings=settings_of(config, objective),
                           reference_graphdef=reference_graphdef, precomputed=tables is not None,
                           same_weights=policy.same_weights, model_config=config.model)
    return Setup(
        config=config,
        run_dir=Path(config.run.dir),
        primary=jax.process_index() == 0,
        tokenizer_source=Path(prepared.tokenizer.path),
        valid_store=valid_store,
        unigram=None if valid_store is None or train_store is None else unigram_perplexity(
            train_store.tokens, valid_store.tokens, config.model.vocab_size),
        graphdef=placed.graphdef,
        rest=placed.rest,
        params=placed.params,
        opt_state=opt_state,
        frozen=frozen,
        rng=sharding.place(jax.random.key_data(jax.random.key(config.run.seed)), replicated),
        num_params=count(placed.params),
        model_params=placed.model_params,
        # Every step's learning rate up front: one small computation instead of eager ops in the
        # loop.
        learning_rates=np.asarray(jax.jit(jax.vmap(schedule))(np.arange(tc.steps + 1))),
        source=batch_source,
        reference_tables=tables,
        # What the batches are cut from; a checkpoint records it, so a resume on other text or
        # tokenizer is seen.
        identity={"tokenizer": prepared.tokenizer.hash,
                  "sources": None if train_store is None else train_store.text_identity},
        base=base,
        reference=ref,
        reference_identity=named,
        objective=objective,
        policy=policy,
        overlong=overlong,
        step_fn=jax.jit(step, in_shardings=(placed.param_shardings, opt_shardings, batch_sharding, replicated,
                                            replicated, frozen_shardings.base, frozen_shardings.reference),
                        out_shardings=(placed.param_shardings, opt_shardings, replicated), donate_argnums=(0, 1)),
        to_device=to_device,
    )


def restore(checkpoints: Checkpointer, run: Setup) -> Restored | None:
    """Resume from the newest readable checkpoint (None: a new run), and say what the resume
    changed."""
    config = run.config
    try:
        restored = checkpoints.restore_latest(run.params, run.opt_state, run.rng, config, run.identity)
        if restored is not None and restored.step > config.train.steps:
            raise ConfigError(
                f"train.steps: got {config.train.steps}, expected at least {restored.step}, the "
                f"step of the newest checkpoint in {checkpoints.directory} (raise it to continue "
                "the run)"
            )
        # adapters belong to one base: another is refused
        if restored is not None and run.base is not None:
            adapters.check_base(restored.meta.get("lora_base"), run.base,
                                checkpoints.directory / str(restored.step))
        # a named reference model: the one the checkpoint was trained against (its folder may have
        # changed)
        saved_reference = None if restored is None else restored.meta.get("reference")
        if run.reference_identity is not None and saved_reference not in (None, run.reference_identity):
            raise CheckpointMismatchError(
                f"train.reference: {run.reference.path} has xxh3 {run.reference_identity['xxh3']}, "
                f"but checkpoint {checkpoints.directory / str(restored.step)} was trained against "
                f"{saved_reference.get('init_from')} (xxh3 {saved_reference.get('xxh3')}); "
                "expected that reference model")
    except BaseException:
        checkpoints.close()
        raise
    if restored is None:
        return None
    step = restored.step
    if restored.data_state is not None:
        run.source.set_state(restored.data_state, step)
    log.info("resuming from %s (step %d)", checkpoints.directory / str(step), step)
    if restored.changes:
        log.warning("config changes since checkpoint %d: %s", step,
                    "; ".join(map(str, restored.changes)))
    if restored.data_restart is not None:
        log.warning(
            "the data restarts at %s of the new config (train.allow_config_change), not where "
            "checkpoint %d stopped (%s)", restored.data_restart["to"], step,
            restored.data_restart["from"])
    was = (restored.meta.get("processes"), restored.meta.get("devices"))
    if None not in was and was != (jax.process_count(), jax.device_count()):
        log.info(
            "elastic resume: checkpoint %d was written by %d process(es) on %d device(s), now %d "
            "on %d",
            step, *was, jax.process_count(), jax.device_count())
    return restored


def resume_row(restored: Restored) -> dict[str, Any]:
    """The metrics.jsonl row that marks a resume: what changed since the checkpoint, and where the
    data went on."""
    was = restored.meta
    row: dict[str, Any] = {"step": restored.step, "event": "resume",
                           "config_changes": {c.key: [c.old, c.new] for c in restored.changes}}
    for key, now in (("processes", jax.process_count()), ("devices", jax.device_count())):
        if was.get(key, now) != now:
            row[key] = [was[key], now]
    if restored.data_restart is not None:
        row["data_restart"] = restored.data_restart
    return row
