"""``train.init_from``: the starting weights of a fine-tune, from a seqjax run or step folder or an
HF Llama folder.

Only the parameters come from there: the optimizer state, the step and the
data position start fresh, as in any new run. The tokenizer comes with the
weights (their ids mean nothing under another), so the run's
``tokenizer.path``, end-of-text and beginning-of-text tokens are the
source's, and ``model.vocab_size`` is the source's when the config leaves it
null.

Everything is checked before any work (no corpus is read, no model built):
the source must be readable, and the parameter shapes of the configured model
must equal the source's one by one, so a vocabulary or shape mismatch is a
ConfigError naming both shapes. Fields that change the function but not the
shapes (``rope_theta``, ``rope_scaling``, ``norm_eps``) may differ on purpose
(stretching a model's context is a fine-tune); each difference is logged.

Example: ``seqjax.train --config runs/llama-tiny/config.yaml run.dir=runs/ft
train.init_from=runs/llama-tiny``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from flax import nnx
from tokenizers import Tokenizer as HFTokenizer

from seqjax.config.load import load_config
from seqjax.config.tree import Config, ConfigError, ModelConfig
from seqjax.hf import folders as hf
from seqjax.hf.carried import CARRIED_FILE, folder_carried, read_carried, write_carried
from seqjax.model import BASE_PARAMS, build_model
from seqjax.model.stacking import blocks_layout
from seqjax.store.build import prepare
from seqjax.weights import inference, sources
from seqjax.weights.saved import TOKENIZER_FILE

log = logging.getLogger(__name__)



@dataclass
class Source:
    """Where the weights are and what comes with them."""

    path: Path
    model: ModelConfig  # the source's, max_seq_len and vocab_size resolved
    tokenizer: dict[str, Any]  # the run's tokenizer section: path, special_tokens, bos_token
    folder: hf.HFFolder | None = None  # for an HF source
    home: Path | None = None  # the folder of its config (config.json or config.yaml), and what came with it


def read_source(path: str, key: str = "train.init_from") -> Source:
    """What the model at ``path`` (a run, step or HF folder that ``key`` names) says about itself: its configs
    and tokenizer (no tensors)."""
    place = sources.locate(path, key)
    where = place.path
    if place.kind == sources.HF:
        folder = hf.read_folder(where)
        tokenizer = {
            "path": str(folder.tokenizer), "special_tokens": [folder.eos_token],
            "bos_token": folder.bos_token, "pad_token": folder.pad_token
        }
        return Source(where, folder.model, tokenizer, folder, home=where)
    config_file = place.config_file
    source = load_config(config_file)
    own = config_file.parent / TOKENIZER_FILE
    tokenizer = dataclasses.asdict(source.tokenizer)
    if own.is_file():
        tokenizer["path"] = str(own)
    elif not tokenizer["path"]:
        # a run from before runs kept their tokenizer: the one its config trains (cached)
        tokenizer["path"] = str(prepare(source, splits=()).tokenizer.path)
    model = dataclasses.replace(source.model, max_seq_len=source.max_seq_len)
    if model.vocab_size is None:
        raise ConfigError(
            f"{key}: {config_file} has model.vocab_size null; expected a trained run's config"
        )
    # The weights only mean something under the tokenizer they were trained with (a step folder of a
    # run whose tokenizer was rebuilt on resume was not): checked as eval, generate and export check
    # it.
    data = Path(tokenizer["path"]).read_bytes()
    vocab = HFTokenizer.from_str(data.decode("utf-8")).get_vocab_size(with_added_tokens=True)
    inference.check_tokenizer(where,
                              hashlib.sha256(data).hexdigest(), tokenizer["path"], model.vocab_size,
                              vocab, key)
    return Source(where, model, tokenizer, home=config_file.parent)


def adopt(config: Config, source: Source, explicit: Collection[str] = ()) -> Config:
    """``config`` with the source's model (:func:`adopt_model`) and tokenizer, the shapes checked.

    ``explicit``: the keys the command line set (``load_config`` records them); a model key among
    them that contradicts the source is refused. A ``tokenizer.path`` set to another file is
    refused: the weights only mean something under their own tokenizer."""
    given = config.tokenizer.path
    if given and Path(given).expanduser().read_bytes() != Path(source.tokenizer["path"]).read_bytes():
        raise ConfigError(
            f"tokenizer.path: got {given!r}, but train.init_from={str(source.path)!r} comes with its own tokenizer "
            f"{source.tokenizer['path']}; leave tokenizer.path null")
    tokenizer = dataclasses.replace(config.tokenizer, **source.tokenizer)
    model = sources.adopt_model(config.model, source.model, explicit, f"train.init_from={source.path}")
    config = dataclasses.replace(config, tokenizer=tokenizer, model=model)
    check_shapes(config, source)
    return config


def _shapes(cfg: Config | ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's path and shape, without allocating it, in the unrolled layout (either
    converts)."""
    model_cfg = dataclasses.replace(cfg.model if isinstance(cfg, Config) else cfg, scan_layers=False)
    if isinstance(cfg, Config):
        cfg = dataclasses.replace(cfg, model=model_cfg)
    else:
        cfg = model_cfg
    model = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    return {
        ".".join(map(str, path)): tuple(v.shape)
        for path, v in nnx.to_flat_state(nnx.state(model, BASE_PARAMS))
    }


def check_shapes(config: Config, source: Source, key: str = "train.init_from") -> None:
    """Refuse a configured model whose parameters do not have the source's shapes, naming both."""
    ours, theirs = _shapes(config), _shapes(source.model)
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise ConfigError(
                f"{key}: {source.path} has {_shape(theirs, name)}, but the run's model has {_shape(ours, name)}; "
                "expected a model of the run's family and shape")


def _shape(shapes: dict, name: str) -> str:
    """``name`` of its shape, or what its absence means (a head tied to the embedding, a family without it)."""
    if name in shapes:
        return f"{name} of shape {shapes[name]}"
    why = "tied embeddings" if name.split(".")[0] in ("lm_head", "head") else "not in its family"
    return f"no {name} ({why})"


def load_params(source: Source, dtype: str, scan_layers: bool = False) -> dict[str, Any]:
    """The source's parameters as a pure dict (``nnx.to_pure_dict`` layout), numpy arrays of
    ``dtype``, with the blocks stacked when the run scans its layers (whatever layout the source
    has)."""
    if source.folder is not None:
        return blocks_layout(hf.read_params(source.folder, dtype), stacked=scan_layers)
    return inference.base_weights(str(source.path), dtype, scan_layers)


def keep_carried(source: Source | None, run_dir: Path) -> None:
    """The tensors the source carries (seqjax.hf.carried: Qwen3.5's mtp.*), copied into ``run_dir``
    once, untrained: an export of the run writes them back."""
    if source is None or (Path(run_dir) / CARRIED_FILE).is_file():
        return
    if source.folder is not None:
        write_carried(run_dir, *folder_carried(source.folder), str(source.path))
    elif source.home is not None:
        write_carried(run_dir, *read_carried(source.home), str(source.home / CARRIED_FILE))
