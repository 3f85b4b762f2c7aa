"""Reading a trained model for inference: a run folder or one step folder -> (config, model with its
weights).

Used by the eval, generate and export CLIs and by ``train.init_from``; only the
parameters are read, on the default device.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from seqjax.config.diff import resume_changes
from seqjax.config.load import load_config, parse_override
from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import CheckpointError, CheckpointMismatchError
from seqjax.hf import folders as hf
from seqjax.hf.peft import ADAPTER_WEIGHTS
from seqjax.model import build_model, split_params
from seqjax.model.assembly import assemble, full_weights, stored_base
from seqjax.model.lora import frozen_part
from seqjax.model.stacking import blocks_layout, saved_stacked
from seqjax.model.weights import check_finite
from seqjax.weights import sources
from seqjax.weights.adapters import adapter_params, base_identity, check_base, peft_folder
from seqjax.weights.orbax_quiet import quiet_orphaned_reads
from seqjax.weights.saved import (
    TOKENIZER_FILE,
    abstract,
    array_differences,
    array_table,
    first_line,
    like_target,
    likely_causes_first,
    newest_readable,
    params_only,
    read_meta,
    read_saved,
)

log = logging.getLogger(__name__)


def newest_meta(path: str | Path) -> dict[str, Any]:
    """The meta item of a run's newest readable checkpoint (or of a step folder); {} when the folder
    is not a run or none is readable."""
    kind = sources.kind_of(Path(path).expanduser())
    if kind not in (sources.RUN, sources.STEP):
        return {}
    place = sources.Place(kind, Path(path).expanduser())
    checkpoints, step = place.checkpoints, place.step
    steps = [step] if step is not None else sorted(
        (int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()), reverse=True)
    for candidate in steps:
        try:
            return read_meta(checkpoints / str(candidate))
        except (OSError, ValueError):
            continue
    return {}


def trained_tokenizer_hash(path: str | Path) -> str | None:
    """The sha256 of the tokenizer a run (or step folder) was trained with, as its newest checkpoint
    records it; None when the folder is not a run or its checkpoints predate the record."""
    return (newest_meta(path).get("data_identity") or {}).get("tokenizer")


def check_tokenizer(where: str | Path, tokenizer_hash: str, tokenizer_path: str | Path,
                    vocab_size: int | None, tokenizer_vocab: int, key: str) -> None:
    """Refuse a tokenizer a checkpoint's weights cannot be read with: the one place every reader
    checks it.

    Too many tokens for the model's embedding, or not the tokenizer the checkpoint records it was
    trained with (a run whose tokenizer was rebuilt on resume keeps older steps trained with the old
    one). ``key`` names what chose the tokenizer, for the message (``tokenizer.path``,
    ``train.init_from``, ...).
    """
    if vocab_size is not None and tokenizer_vocab > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_path}: {tokenizer_vocab} tokens, more than the model.vocab_size={vocab_size} of "
            f"{where}; expected the tokenizer it was trained with ({key})")
    trained = trained_tokenizer_hash(where)
    if trained is not None and trained != tokenizer_hash:
        raise ConfigError(
            f"tokenizer {tokenizer_path} (sha256 {tokenizer_hash[:12]}) is not the one {where} was trained with "
            f"(sha256 {trained[:12]}); expected that tokenizer ({key})")


def base_weights(path: str, dtype: str, scan_layers: bool) -> dict[str, Any]:
    """The weights at ``path`` as a pure dict of numpy arrays of ``dtype`` (blocks stacked for
    scan_layers): an HF folder's, or a seqjax run's or step folder's (a LoRA run's with its adapters
    folded in). What ``train.init_from`` starts from, and the base a LoRA run's adapters are read
    onto."""
    if hf.is_hf_folder(Path(path).expanduser()):
        return blocks_layout(hf.read_params(hf.read_folder(path), dtype), stacked=scan_layers)
    # a LoRA run's weights are its base with the adapters folded in
    _, model = load_for_inference(path)
    return blocks_layout(full_weights(model, dtype), stacked=scan_layers)


def load_folder(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, Any]:
    """(config, model with the folder's weights) from a Hugging Face folder, as ``--hf`` reads it: its own
    config.json decides the model; a model override on the command line that contradicts it is one
    line (:func:`seqjax.weights.sources.adopt_model`)."""
    place = sources.locate(path, "--hf", (sources.HF,))
    folder = hf.read_folder(place.path)
    config = hf.run_config(folder, overrides)
    explicit = [hf_key for hf_key, _ in map(parse_override, overrides)]
    model = sources.adopt_model(config.model, folder.model, explicit, f"--hf {path}")
    config = sources.adopt_processor(dataclasses.replace(config, model=model), folder.path, explicit)
    return config, hf.model_with_params(config, hf.read_params(folder, model.param_dtype))


def load_for_inference(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                       key: str = "--run") -> tuple[Config, Any]:
    """(config, model with trained weights) from a run dir (its newest readable checkpoint) or a
    step folder.

    The config is the run's saved ``config.yaml`` (plus ``overrides``, e.g. a
    different ``model.attention`` backend for inference), with ``tokenizer.path``
    pointing at the run folder's own ``tokenizer.json`` when it has one; only the
    parameters are read, on the default device. Overrides that change the
    parameters' shapes (``model.vocab_size=1000``) are refused with the differing
    keys before any array is read. Under ``model.lora`` a checkpoint holds the adapters only: their
    base is read again (``train.init_from``, or ``run.seed``'s initialization) and checked.
    """
    place = sources.locate(path, key, (sources.RUN, sources.STEP))
    config_file, checkpoints, step = place.config_file, place.checkpoints, place.step
    config = sources.adopt_processor(load_config(config_file, list(overrides)), config_file.parent,
                                     [parse_override(o)[0] for o in overrides])
    own_tokenizer = config_file.parent / TOKENIZER_FILE
    if own_tokenizer.is_file() and not any(o.startswith("tokenizer.path=") for o in overrides):
        config.tokenizer.path = str(own_tokenizer)  # the run's copy, wherever the run folder now is
    graphdef, params, frozen, rest = split_params(build_model(config, rngs=nnx.Rngs(config.run.seed)))
    step, restored = _newest_params(config, config_file, checkpoints, step,
                                    abstract(nnx.to_pure_dict(params)))
    step_dir = checkpoints / str(step)
    if frozen is None:
        model = assemble(graphdef, restored, None, rest)
    else:  # the adapters' base, checked against the record of it the checkpoint holds
        base = nnx.to_pure_dict(frozen)
        if config.train.init_from:
            base = frozen_part(_lora_base(config, config_file), config.model.lora)
        check_base(
            read_meta(step_dir).get("lora_base"), base_identity(base, config.train.init_from),
            step_dir)
        # QLoRA: as trained
        model = assemble(graphdef, restored, stored_base(base, config.model), rest)
    model.checkpoint_step = step  # which step was read (an older one when the newest is unreadable)
    model.params_only = params_only(step_dir)  # parameters alone: what seqjax.import wrote, never trained here
    return config, model


def with_adapter(config: Config, model: Any, folder: str) -> tuple[Config, Any]:
    """``config`` and ``model`` (a base without adapters) with a PEFT adapter folder's adapters on
    it, as ``--adapter`` gives eval, generate and export: the adapter's own settings become
    ``model.lora``, and no step is trained."""
    if config.model.lora.rank:
        raise ConfigError(
            f"--adapter: the model already has model.lora adapters (rank {config.model.lora.rank}); "
            "expected a base model without adapters")
    lora, tensors = peft_folder(folder, "--adapter", config.model)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, lora=lora))
    config.model.check()
    graphdef, _, _, rest = split_params(build_model(config, rngs=nnx.Rngs(config.run.seed)))
    weights = blocks_layout(full_weights(model), stacked=config.model.scan_layers)
    # the adapters, and the adapter's own copies of modules_to_save
    trained = adapter_params(tensors, config.model, str(Path(folder) / ADAPTER_WEIGHTS))
    model = assemble(graphdef, trained, stored_base(frozen_part(weights, lora), config.model), rest)
    return config, model


def _lora_base(config: Config, config_file: Path) -> dict[str, Any]:
    """The weights a LoRA run's adapters sit on (its ``train.init_from``), or one line saying the
    base is gone from where the run found it."""
    where = config.train.init_from
    if not Path(where).expanduser().exists():
        raise ConfigError(
            f"train.init_from: {where}, the base the LoRA run {config_file.parent} trained its adapters on, is "
            "missing (moved or deleted); expected that folder, or train.init_from=NEW_PATH where it now is"
        )
    return base_weights(where, config.model.param_dtype, config.model.scan_layers)


def _newest_params(config: Config, config_file: Path, checkpoints: Path, step: int | None,
                   target: Any) -> tuple[int, Any]:
    """(step, parameters) of ``step`` or, when None, the newest readable checkpoint, in the layout
    of ``model.scan_layers``; finite, and shaped as ``target``."""
    errors = []

    def restore(candidate: int) -> Any:
        saved = read_saved(checkpoints / str(candidate), config_file, items=("params",))
        # read in the layout it was saved in (model.scan_layers), then converted to the one asked
        # for
        as_saved = blocks_layout(target, stacked=saved_stacked(saved.arrays["params"]))
        wrong = array_differences(saved.arrays["params"], array_table(as_saved))
        if wrong:
            changes = resume_changes(saved.config, config) if saved.config is not None else []
            keys = "; ".join(map(str, likely_causes_first(changes))) or "no config key"
            raise CheckpointMismatchError(
                f"checkpoint {checkpoints / str(candidate)} does not fit the model asked for ({keys}): its "
                f"parameters differ: {'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''}")
        # Only the params item is read, so no CheckpointManager (which also wants to manage the
        # folder).
        with ocp.StandardCheckpointer() as reader:
            restored = like_target(
                as_saved, reader.restore(checkpoints / str(candidate) / "params", as_saved))
        return blocks_layout(restored, stacked=config.model.scan_layers)

    def unreadable(candidate: int, err: Exception) -> None:
        errors.append(f"step {candidate}: {first_line(err)}")
        log.warning("checkpoint %s is unreadable; trying an older one", checkpoints / str(candidate))

    # A step folder is named by its number only once orbax has committed it (in-progress writes have
    # a suffix).
    steps = [step] if step is not None else [
        int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()
    ]
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {checkpoints}")
    quiet_orphaned_reads()  # a damaged step's orphaned reads would each print a traceback
    found = newest_readable(steps, restore, unreadable)
    if found is None:
        raise CheckpointError(f"no readable checkpoint in {checkpoints}: " + "; ".join(errors))
    restored = like_target(target, found[1])
    for key, value in jax.tree_util.tree_leaves_with_path(restored):
        check_finite(value, "/".join(str(getattr(k, "key", k)) for k in key),
                     str(checkpoints / str(found[0]) / "params"))
    return found[0], restored
