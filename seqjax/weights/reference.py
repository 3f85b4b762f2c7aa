"""A preference objective's reference model (TRL's ``ref_model``): which one a run compares with, decided
here and only here, for training, for its validation and for ``seqjax.eval``.

==========================  =================================================================================
``train.reference``         the reference
==========================  =================================================================================
``auto``, under model.lora  the base with the adapters off: the same state through a graph whose adapters
                            compute nothing (no second copy of any weight)
``auto``, full fine-tune    a frozen copy of the starting weights (``train.init_from``, or ``run.seed``'s)
``copy``                    a frozen copy of the starting weights, adapters included under model.lora
a folder                    the model there (a Hugging Face folder, a seqjax run or step folder), frozen; under
                            model.lora it sits where the base does, with the adapters off
==========================  =================================================================================

``train.precompute_reference`` computes that model's log-probabilities once, before the first step
(:mod:`seqjax.train.precompute`), and the step reads them from the batch.

A reference with the policy's weights gives the policy's own log-probabilities
(:func:`same_weights_rule`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.config.tree import Config, ConfigError
from seqjax.model import build_model, split_params
from seqjax.model.assembly import assemble
from seqjax.model.lora import adapters_off
from seqjax.weights import sources

BASE, COPY, MODEL = "base", "copy", "model"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reference:
    """The decision: ``kind`` (``base``, ``copy`` or ``model``; None: the objective has no reference), the
    folder of a ``model`` reference, and whether its log-probabilities are computed once beforehand."""

    kind: str | None
    path: str | None = None
    precompute: bool = False

    @property
    def in_step(self) -> bool:
        """A reference model the train step runs (not one precomputed, not none)."""
        return self.kind is not None and not self.precompute


def decide(config: Config, wanted: bool) -> Reference:
    """The reference of a run whose objective ``wanted`` one (``Objective.reference``); a folder that is not a
    model, or adapters' modules_to_save under the base, is one line."""
    tc, lora = config.train, config.model.lora
    if not wanted:
        return Reference(None)
    if tc.reference not in ("auto", "copy"):
        place = sources.locate(tc.reference, "train.reference")
        return Reference(MODEL, str(place.path), tc.precompute_reference)
    if lora.rank and tc.reference == "auto":
        if lora.modules_to_save:
            raise ConfigError(
                f"train.reference: got auto with model.lora.modules_to_save {lora.modules_to_save}: the base with "
                "its adapters off still has the trained modules; expected train.reference=copy")
        return Reference(BASE, precompute=tc.precompute_reference)
    if lora.rank and tc.precompute_reference:  # (the starting adapters are not kept with the run)
        raise ConfigError("train.precompute_reference: got true with train.reference=copy under model.lora; "
                          "expected train.reference=auto (the base) or a model folder")
    return Reference(COPY, precompute=tc.precompute_reference)


def same_weights_rule(reference: Reference, config: Config) -> Callable[[Any, Any, Any], jax.Array] | None:
    """``(params, reference, step) -> bool scalar``: whether the step's reference has the policy's weights
    (the step then takes the policy's log-probabilities as the reference's, bit for bit:
    :meth:`seqjax.objectives.base.Inputs.reference_logprobs`); None where it never can.

    The base with the adapters off is the policy while every LoRA B is 0 (DoRA rescales even then:
    never); a frozen copy is the policy while every trained weight equals its copy; a precomputed
    copy of a full fine-tune's starting weights only at step 1. A policy with dropout is never its
    reference (the reference runs without it), nor is a model named by its folder."""
    model, lora = config.model, config.model.lora
    if reference.kind in (None, MODEL) or model.dropout or model.token_dropout or model.attention_dropout:
        return None
    if reference.kind == BASE:
        if lora.dora:
            return None
        return lambda params, _, step: _all(
            jnp.all(leaf == 0) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
            if "lora_b" in jax.tree_util.keystr(path))
    if reference.precompute:
        return None if lora.rank else (lambda params, _, step: jnp.asarray(step) == 1)
    return lambda params, copy, step: _all(
        jnp.all(a == b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)))


def _all(flags) -> jax.Array:
    out = jnp.asarray(True)
    for flag in flags:
        out = out & flag
    return out


def named_weights(reference: Reference, config: Config) -> dict[str, Any]:
    """A ``model`` reference's weights as a pure dict in the run's layout (``model.scan_layers``), after its
    shapes were checked against the run's model (without adapters)."""
    from seqjax.weights import init_from  # (init_from reads inference, which reads this module)

    source = init_from.read_source(reference.path, "train.reference")
    ours = dataclasses.replace(config, model=dataclasses.replace(
        config.model, lora=dataclasses.replace(config.model.lora, rank=0)))
    init_from.check_shapes(ours, source, key="train.reference")
    return init_from.load_params(source, config.model.param_dtype, config.model.scan_layers)


def reference_for(config: Config, model: Any, *, own: bool = False, trained: bool = True) -> Any:
    """A model's reference as ``seqjax.eval`` scores pairs with it: its run's, as the run trained against it.

    ``own``: the model never trained here (an HF folder, an imported run): unless
    ``train.reference`` names a model, it is its own reference (TRL's default, the policy's starting
    weights). ``trained``: its run trained an objective with a reference; when it did not, its
    starting weights are no reference (a random initialization, or whatever it was fine-tuned from),
    and one must be named. The adapters' base, a full fine-tune's starting weights
    (``train.init_from``, or ``run.seed``'s initialization again), or the model the run's
    ``train.reference`` names; starting adapters that are not kept with the run are one line."""
    from seqjax.weights.inference import base_weights  # (inference reads this module's decision)

    reference = decide(config, True)
    if reference.kind != MODEL and own:
        log.info("the reference model: the model itself (it has not been trained here; train.reference=FOLDER "
                 "names another)")
        return model
    if reference.kind == BASE:
        graphdef, state = nnx.split(model)
        return nnx.merge(adapters_off(graphdef, state), state)
    if reference.kind == COPY and not trained:
        raise ConfigError(
            "train.reference: the run was trained without a reference model (its train.objective has none), so "
            "its starting weights are no reference; expected train.reference=FOLDER naming one")
    if config.model.lora.rank and reference.kind == COPY:
        raise ConfigError(
            "train.reference: got copy with model.lora: the starting adapters are not kept with the "
            "run; evaluate with train.reference=auto (the base) instead")
    plain = dataclasses.replace(config, model=dataclasses.replace(
        config.model, lora=dataclasses.replace(config.model.lora, rank=0)))
    graphdef, params, _, rest = split_params(build_model(plain, rngs=nnx.Rngs(config.run.seed)))
    if reference.kind == MODEL:
        params = named_weights(reference, plain)
    elif config.train.init_from:
        params = base_weights(config.train.init_from, config.model.param_dtype, config.model.scan_layers)
    return assemble(graphdef, params, None, rest)
