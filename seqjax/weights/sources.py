"""Where a model's weights are: told apart in one place.

==========  ==========================================================  ===========================
kind        a folder that holds                                         read by
==========  ==========================================================  ===========================
``run``     ``checkpoints/`` and ``config.yaml`` (a train ``run.dir``,   :mod:`.inference`
            or what ``seqjax.import`` wrote): its newest readable step
``step``    one step folder, ``<run.dir>/checkpoints/<N>``              :mod:`.inference`
``hf``      a Hugging Face model folder: ``config.json``, safetensors,  :mod:`seqjax.hf.folders`
            ``tokenizer.json``
``adapter`` a PEFT adapter folder: ``adapter_config.json``,              :mod:`.adapters`
            ``adapter_model.safetensors``
==========  ==========================================================  ===========================

Every key that names weights (``train.init_from``, ``train.reference``, ``--run``, ``--checkpoint``,
``--hf``, ``--adapter``, ``train.init_adapter``) goes through :func:`locate`, so a missing folder or
a folder of the wrong kind is one line naming the key, the path and the kinds it takes.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Collection

from seqjax.config.tree import Config, ConfigError, ModelConfig
from seqjax.hf import folders as hf
from seqjax.hf.peft import ADAPTER_CONFIG
from seqjax.store.image_chats import PREPROCESSOR
from seqjax.weights.saved import CHECKPOINTS, CONFIG_FILE

RUN, STEP, HF, ADAPTER = "run", "step", "hf", "adapter"
# Fields that leave every shape alone but change what the model computes.
FUNCTION_FIELDS = ("rope_theta", "rope_scaling", "norm_eps")
# The model keys a run chooses for itself; every other one is its weights' own (config.json, a run's
# config.yaml).
RUN_CHOICES = ("max_seq_len", "param_dtype", "compute_dtype", "matmul_precision", "attention", "remat", "remat_names",
               "scan_layers", "loss_chunk_tokens", "init_std", "dropout", "token_dropout", "attention_dropout", "lora")
MODELS = (RUN, STEP, HF)  # the kinds that hold a whole model
DESCRIBED = {RUN: "a seqjax run folder (checkpoints/)", STEP: f"a step folder (<run.dir>/{CHECKPOINTS}/<N>)",
             HF: "a Hugging Face model folder (config.json)",
             ADAPTER: f"a PEFT adapter folder ({ADAPTER_CONFIG})"}

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Place:
    """A folder of weights and its kind."""

    kind: str
    path: Path

    @property
    def config_file(self) -> Path:
        """A run's or step's ``config.yaml``."""
        return (self.path if self.kind == RUN else self.path.parent.parent) / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS if self.kind == RUN else self.path.parent

    @property
    def step(self) -> int | None:
        """A step folder's step; None for a run (its newest readable one)."""
        return int(self.path.name) if self.kind == STEP else None


def kind_of(path: Path) -> str | None:
    """The kind of weights ``path`` holds, or None."""
    if (path / CHECKPOINTS).is_dir():
        return RUN
    if path.name.isdigit() and path.parent.name == CHECKPOINTS:
        return STEP
    if hf.is_hf_folder(path):
        return HF
    if (path / ADAPTER_CONFIG).is_file():
        return ADAPTER
    return None


def locate(path: str | Path, key: str, kinds: tuple[str, ...] = MODELS) -> Place:
    """The folder ``path`` that ``key`` names, as one of ``kinds``; anything else is one line naming both."""
    where = Path(path).expanduser().absolute()
    expected = ", or ".join(DESCRIBED[k] for k in kinds)
    if not where.exists():
        raise ConfigError(f"{key}: {str(path)!r} not found; expected {expected}")
    kind = kind_of(where)
    if kind == ADAPTER and ADAPTER not in kinds:
        raise ConfigError(
            f"{key}: {path} is a PEFT adapter folder ({ADAPTER_CONFIG}), not a model; set train.init_adapter={path} "
            "for its adapters (--adapter on eval, generate and export) and name its base model here")
    if kind not in kinds:
        raise ConfigError(f"{key}: {path} is none of what it takes; expected {expected}")
    return Place(kind, where)


def adopt_model(model: ModelConfig, theirs: ModelConfig, explicit: Collection[str], where: str) -> ModelConfig:
    """The model a run of ``model``'s settings builds on weights whose own config is ``theirs``: every key but
    :data:`RUN_CHOICES` (and ``model.vision.attention``) is theirs, so a folder's path alone is a
    model.

    A key the command line set (``explicit``) that contradicts them is one line, except the fields
    that change the function but no shape (:data:`FUNCTION_FIELDS`: stretching a model's context is
    a fine-tune), kept with a warning (a null on the command line is no setting: theirs). Keys a
    config file set are theirs, said in one line: a shipped config's 8B shape does not stop its
    recipe from running on a smaller folder of the family."""
    adopted = dataclasses.replace(theirs, **{name: getattr(model, name) for name in RUN_CHOICES},
                                  vision=dataclasses.replace(theirs.vision, attention=model.vision.attention))
    replaced = []
    pairs = [(f"model.{f.name}", getattr(model, f.name), getattr(adopted, f.name))
             for f in dataclasses.fields(ModelConfig) if f.name not in (*RUN_CHOICES, "vision")]
    pairs += [(f"model.vision.{f.name}", getattr(model.vision, f.name), getattr(adopted.vision, f.name))
              for f in dataclasses.fields(model.vision)]
    for key, ours, own in pairs:
        if ours == own:
            continue
        name = key.split(".", 1)[1]
        if ours is None or not any(k == key or k.startswith(key + ".") for k in explicit):  # (null: unset)
            replaced.append(f"{name} {_short(ours)} -> {_short(own)}")
        elif name in FUNCTION_FIELDS:
            adopted = dataclasses.replace(adopted, **{name: ours})
            log.warning("fine-tuning with %s=%s where %s has %s", key, ours, where, own)
        else:
            raise ConfigError(f"{key}: got {_short(ours)} on the command line, but {where} has {_short(own)}; "
                              "leave it out: a model's own config decides its shape")
    if replaced:
        log.info("the model as %s has it: %s", where, "; ".join(replaced))
    return adopted


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def adopt_processor(config: Config, folder: Path, explicit: Collection[str] = ()) -> Config:
    """A vision-language model's own image processor (``folder``'s ``preprocessor_config.json``: an HF folder's,
    or the copy an imported run keeps) for a run that reads chats: the folder carries what it came
    with. As with the model's keys, a ``data.image_processor`` the command line sets (``explicit``)
    wins; one a config file sets yields to the folder's. ``data.patches_per_row``, when 0, four
    patches per token of ``data.seq_len`` (room for a row of image tokens alone)."""
    data = config.data
    if not config.model.vision.depth or data.format != "chat":
        return config
    processor = data.image_processor
    if "data.image_processor" not in explicit and (Path(folder) / PREPROCESSOR).is_file():
        processor = str(Path(folder) / PREPROCESSOR)
        log.info("data.image_processor: %s (the model's own)", processor)
    if processor is None:
        return config
    patches = data.patches_per_row or 4 * data.seq_len
    return dataclasses.replace(config, data=dataclasses.replace(data, image_processor=processor,
                                                                patches_per_row=patches))
