"""Tensors a checkpoint holds that seqjax keeps as they are but does not compute: Qwen3.5's
multi-token-prediction layers (``mtp.*``, which vLLM and SGLang read for speculative decoding).

A family row names them (``Family.carried``: ``"mtp"`` means the tensors ``mtp.*`` and the
config.json fields ``mtp_*``). They travel beside the model and come back on export, unchanged:

    HF folder --import / train.init_from--> RUN/carried.safetensors --export--> HF folder

``carried.safetensors`` holds the tensors in their stored dtype under their own names, and the
config fields as JSON in its metadata (``config``). Training never reads them, so they are not
trained; an export writes them (cast to its ``--dtype``) and the fields beside the model's own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from seqjax.core.errors import CheckpointError
from seqjax.core.files import write_bytes_atomic
from seqjax.hf.families import FAMILIES
from seqjax.hf.qwen3_5 import conditional_text

CARRIED_FILE = "carried.safetensors"

log = logging.getLogger(__name__)


def carried_names(family: str, names) -> list[str]:
    """The tensors among ``names`` that ``family``'s row carries (none for most families)."""
    prefix = FAMILIES[family].carried
    return sorted(n for n in names if prefix and n.startswith(prefix + "."))


def described(names) -> str:
    """The carried tensors as their name prefixes (``mtp.*``), for a log line."""
    return ", ".join(sorted({n.split(".")[0] + ".*" for n in names}))


def carried_fields(family: str, config_json: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields that describe the carried tensors (``mtp_num_hidden_layers``, ...)."""
    prefix = FAMILIES[family].carried
    return {k: v for k, v in config_json.items() if prefix and k.startswith(prefix + "_")}


def folder_carried(folder) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, config fields) an HF folder (seqjax.hf.folders.HFFolder) carries, as stored."""
    tensors = {}
    for file in sorted({folder.weight_map[name] for name in folder.carried}):
        try:
            with safe_open(str(file), framework="numpy") as f:
                tensors.update({n: f.get_tensor(n) for n in folder.carried if folder.weight_map[n] == file})
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read the carried tensors ({err})") from None
    return tensors, carried_fields(folder.model.family, conditional_text(folder.config_json) or folder.config_json)


def write_carried(out: Path, tensors: dict[str, np.ndarray], fields: dict[str, Any], source: str) -> None:
    """``out``/carried.safetensors (nothing when there are no tensors)."""
    if not tensors:
        return
    path = write_bytes_atomic(Path(out) / CARRIED_FILE, save(tensors, metadata={
        "format": "pt", "config": json.dumps(fields), "source": source}))
    log.info("%s: %d tensors seqjax keeps but does not train (%s), from %s; an export writes them back",
             path, len(tensors), described(tensors), source)


def read_carried(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, config fields) of ``folder``/carried.safetensors; both empty when it has none."""
    path = Path(folder) / CARRIED_FILE
    if not path.is_file():
        return {}, {}
    try:
        with safe_open(str(path), framework="numpy") as f:
            fields = json.loads((f.metadata() or {}).get("config", "{}"))
            return {name: f.get_tensor(name) for name in f.keys()}, fields
    except (SafetensorError, OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read the carried tensors ({err})") from None
