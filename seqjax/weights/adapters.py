"""``model.lora`` in training: the base the adapters belong to, and adapters read from a PEFT
folder.

A LoRA run's checkpoints hold the adapters and their optimizer state only (megabytes for an 8B
base). The base is not saved: it is ``train.init_from`` (or, without one, the random initialization
``run.seed`` draws), loaded again on every start, so each checkpoint records which base it was
trained on, its path and an xxh3 of its weights, and a resume on another base is refused before
anything is touched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xxhash
from safetensors import SafetensorError
from safetensors.numpy import load_file

from seqjax.config.model import LoraConfig, ModelConfig
from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import CheckpointError, CheckpointMismatchError
from seqjax.core.files import read_utf8
from seqjax.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, from_peft, lora_from_adapter_config
from seqjax.model.stacking import blocks_layout
from seqjax.model.weights import check_finite
from seqjax.weights.saved import first_line


def base_identity(base: Any, path: str | None) -> dict[str, Any]:
    """What a checkpoint records of its base: ``train.init_from`` and an xxh3 over every weight, in
    name order (the layout of ``model.scan_layers`` does not change it)."""
    digest = xxhash.xxh3_64()
    flat = jax.tree_util.tree_flatten_with_path(blocks_layout(base, stacked=False))[0]
    for key, value in sorted(flat, key=lambda item: jax.tree_util.keystr(item[0])):
        digest.update(jax.tree_util.keystr(key).encode())
        digest.update(np.ascontiguousarray(np.asarray(jax.device_get(value))).tobytes())
    return {"init_from": path, "xxh3": digest.hexdigest()}


def check_base(saved: dict[str, Any] | None, now: dict[str, Any], where: Path) -> None:
    """Refuse a resume whose base is not the one the checkpoint's adapters were trained on (one
    line)."""
    if saved is None:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds no record of a LoRA base (it was not written by a "
            "model.lora run); start a new run.dir for adapters")
    if saved.get("xxh3") != now["xxh3"]:
        raise CheckpointMismatchError(
            f"checkpoint {where} holds adapters trained on the base {saved.get('init_from')} (xxh3 "
            f"{saved.get('xxh3')}), but this run's base {now['init_from']} has xxh3 {now['xxh3']}: adapters only "
            "mean something on their own base. Nothing was moved: set train.init_from to that base")


def peft_folder(folder: str, key: str, cfg: ModelConfig) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """A PEFT adapter folder's ``model.lora`` for a base of ``cfg``'s shape and its tensors; every
    problem with it (a missing or unreadable file, a field seqjax cannot compute) is one line
    naming ``key``'s value and the file."""
    path = Path(folder).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            f"{key}: {folder} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; expected a "
            "PEFT LoRA adapter folder")
    text = read_utf8(path / ADAPTER_CONFIG, CheckpointError)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: not valid JSON ({err})") from None
    lora = lora_from_adapter_config(config, str(path / ADAPTER_CONFIG), cfg)
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path / ADAPTER_WEIGHTS}: unreadable as safetensors ({first_line(err)}); "
            "expected the adapter_model.safetensors PEFT saved") from None
    for name, tensor in tensors.items():  # a NaN would only show as a null loss, or a "divergence"
        check_finite(tensor, name, str(path / ADAPTER_WEIGHTS))
    return lora, tensors


def read_adapter(folder: str, config: Config) -> dict[str, Any]:
    """A PEFT adapter folder's weights as this run's adapters (layout of model.scan_layers), after
    checking that what it computes (rank, alpha, targets, rsLoRA, DoRA, modules_to_save) is the
    run's ``model.lora``."""
    theirs, tensors = peft_folder(folder, "train.init_adapter", config.model)
    ours = config.model.lora
    for key in ("rank", "alpha", "targets", "rslora", "dora", "modules_to_save"):
        if getattr(theirs, key) != getattr(ours, key):
            raise ConfigError(
                f"model.lora.{key}: got {getattr(ours, key)!r}, but the adapter {folder} has "
                f"{getattr(theirs, key)!r}; set model.lora.{key} to match it")
    return adapter_params(tensors, config.model, str(Path(folder).expanduser() / ADAPTER_WEIGHTS))


def adapter_params(tensors: dict[str, np.ndarray], cfg: ModelConfig, source: str) -> dict[str, Any]:
    """PEFT tensors as what a run of ``cfg`` trains: its dtype, its layout (model.scan_layers)."""
    trained = from_peft(tensors, cfg, source)
    return blocks_layout(jax.tree.map(lambda a: a.astype(cfg.param_dtype), trained),
                         stacked=cfg.scan_layers)
