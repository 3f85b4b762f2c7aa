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
from safetensors.numpy import load_file

from seqjax.config.tree import Config, ConfigError
from seqjax.core.errors import CheckpointError, CheckpointMismatchError
from seqjax.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, from_peft, lora_from_adapter_config
from seqjax.model.stacking import blocks_layout


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


def read_adapter(folder: str, config: Config) -> dict[str, Any]:
    """A PEFT adapter folder's weights as this run's adapters (layout of model.scan_layers), after
    checking that its rank, alpha and targets are the run's ``model.lora``."""
    path = Path(folder).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(
            f"train.init_adapter: {folder} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; expected a "
            "PEFT LoRA adapter folder")
    try:
        theirs = lora_from_adapter_config(json.loads((path / ADAPTER_CONFIG).read_text()),
                                          str(path / ADAPTER_CONFIG))
    except ValueError as err:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: not valid JSON ({err})") from None
    ours = config.model.lora
    for key in ("rank", "alpha", "targets"):
        if getattr(theirs, key) != getattr(ours, key):
            raise ConfigError(
                f"model.lora.{key}: got {getattr(ours, key)!r}, but the adapter {folder} has "
                f"{getattr(theirs, key)!r}; set model.lora.{key} to match it")
    adapters = from_peft(load_file(str(path / ADAPTER_WEIGHTS)), config.model,
                         str(path / ADAPTER_WEIGHTS))
    return blocks_layout(jax.tree.map(lambda a: a.astype(config.model.param_dtype), adapters),
                         stacked=config.model.scan_layers)
