"""Hugging Face model folders: read one as a seqjax model, write a seqjax model as one (the
libraries behind ``python -m seqjax.import`` / ``python -m seqjax.export``, ``--hf`` on eval and
generate, and ``train.init_from``).

A folder holds what ``transformers`` writes and reads:

    config.json                      LlamaConfig's fields (seqjax.hf.families maps them, and refuses the rest)
    model.safetensors                the tensors, or shards model-0000i-of-0000n.safetensors with
    model.safetensors.index.json       their weight_map (tensor name -> shard file)
    tokenizer.json                   the fast tokenizer (HF ``tokenizers``), which seqjax loads as it is
    tokenizer_config.json            tokenizer class, bos/eos tokens, model_max_length
    special_tokens_map.json          bos/eos tokens
    generation_config.json           bos/eos ids for transformers' generate()

Tensors go through the ``safetensors`` library in both directions; reading
opens each shard lazily, so only one tensor at a time is held in its stored
dtype. Nothing is downloaded: the folder must be on disk.

Example::

    hf = read_folder("llama-tiny")           # config.json checked, shards located, tokenizer found
    params = read_params(hf)                 # {"embed": {"embedding": [V, D]}, "blocks": {0: ...}, ...}
    write_folder("out", hf.model, params, tokenizer_json=hf.tokenizer, eos_token=hf.eos_token,
                 bos_token=hf.bos_token, dtype="bfloat16")
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from seqjax.config.load import load_config
from seqjax.config.tree import Config, ModelConfig
from seqjax.core.errors import CheckpointError
from seqjax.core.files import read_utf8, write_text_atomic
from seqjax.core.progress import log_once, progress_bar
from seqjax.hf import mxfp4
from seqjax.hf.carried import carried_names, described
from seqjax.hf.families import hf_config, model_config_from_hf
from seqjax.hf.qwen3_5 import conditional_text, text_tensors
from seqjax.hf.tensors import from_hf as params_from_hf
from seqjax.hf.tensors import to_hf
from seqjax.hf.vision import (
    TEXT_PREFIX,
    encoder_of,
    is_vision_language,
    vision_language_config,
    vision_language_folder,
    vision_language_params,
)
from seqjax.model import build_model
from seqjax.model.stacking import blocks_layout
from seqjax.model.transformer import TransformerLM
from seqjax.model.weights import check_finite
from seqjax.store.image_chats import PREPROCESSOR

CONFIG_JSON = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(jnp.bfloat16)}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default shard size (5 GB)

log = logging.getLogger(__name__)


@dataclass
class HFFolder:
    """A checked HF folder: its config, where each tensor lives, and its tokenizer."""

    path: Path
    config_json: dict[str, Any]
    model: ModelConfig
    weight_map: dict[str, Path]
    tokenizer: Path
    eos_token: str
    bos_token: str | None
    pad_token: str | None = None
    carried: tuple[str, ...] = ()  # tensors kept as they are, not computed (seqjax.hf.carried)


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with a config.json and no seqjax checkpoints/ (a seqjax run has config.yaml
    instead)."""
    path = Path(path)
    return (path / CONFIG_JSON).is_file() and not (path / "checkpoints").is_dir()


def read_json(path: Path) -> dict[str, Any]:
    text = read_utf8(path, CheckpointError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: the single file when there is one, else the
    index.

    A folder with both is read as transformers reads it (4.x's ``from_pretrained`` looks for the
    single file first), so seqjax and transformers load the same weights.
    """
    index, single = path / INDEX, path / WEIGHTS
    if single.is_file() and index.is_file():
        log.warning("%s holds both %s and %s: reading %s, as transformers does", path, WEIGHTS,
                    INDEX, WEIGHTS)
    if not single.is_file() and index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(
                f"{index}: expected a non-empty weight_map of tensor name -> shard file")
        files = {}
        inside = path.resolve()
        for name, file in weight_map.items():
            shard = path / str(file)
            # (a shard is a file of the folder: a path that leaves it, by .. or a link, is never read)
            if not shard.resolve().is_relative_to(inside) or Path(str(file)).is_absolute():
                raise CheckpointError(
                    f"{index}: weight_map puts {name} in {file}, outside {path}; expected a shard file of the folder")
            if not shard.is_file():
                raise CheckpointError(
                    f"{index}: weight_map puts {name} in {file}, which is missing from {path}")
            files[name] = shard
        return files
    if not single.is_file():
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(others)}: save the model with safe_serialization=True)" if others else ""
        raise CheckpointError(f"{path}: expected {WEIGHTS} or {INDEX} with its shards{hint}")
    try:
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{single}: not a readable safetensors file ({err})") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its
    content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(path: Path, config_json: dict[str, Any],
                    tokenizer: HFTokenizer) -> tuple[str, str | None, str | None]:
    """(eos, bos, pad) from tokenizer_config.json / special_tokens_map.json, else config.json's
    ids."""
    found: dict[str, str | None] = {"eos": None, "bos": None, "pad": None}
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (path / name).is_file():
            data = read_json(path / name)
            for kind in found:
                found[kind] = found[kind] or _token_text(data.get(f"{kind}_token"))
    for kind in found:
        token_id = config_json.get(f"{kind}_token_id")
        # Llama 3.1 instruct lists several end tokens; the first ends text
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if found[kind] is None and isinstance(token_id, int):
            found[kind] = tokenizer.id_to_token(token_id)
    for kind, token in found.items():
        if token is not None and tokenizer.token_to_id(token) is None:
            raise CheckpointError(
                f"{path / TOKENIZER}: has no token {token!r}, the folder's {kind}_token")
    if found["eos"] is None:
        raise CheckpointError(
            f"{path}: no eos_token in {TOKENIZER_CONFIG} or {SPECIAL_TOKENS_MAP} and no eos_token_id in "
            f"{CONFIG_JSON}; seqjax needs the end-of-text token")
    return found["eos"], found["bos"], found["pad"]


def read_folder(path: str | os.PathLike) -> HFFolder:
    """Check an HF folder without reading its tensors: config.json, the shards, the tokenizer and
    its special tokens.

    Every problem is a CheckpointError naming the file and the field.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: no such folder (expected a Hugging Face model folder holding {CONFIG_JSON})")
    if not (path / CONFIG_JSON).is_file():
        raise CheckpointError(f"{path}: no {CONFIG_JSON}; expected a Hugging Face model folder")
    config_json = read_json(path / CONFIG_JSON)
    # Qwen3-VL or Qwen2.5-VL: a Qwen3 or Qwen2 with model.vision set
    if is_vision_language(config_json):
        model = vision_language_config(config_json, str(path / CONFIG_JSON)).text
    elif (text := conditional_text(config_json)) is not None:  # (Qwen3.5 with its tower)
        model = model_config_from_hf(text, f"{path / CONFIG_JSON} text_config")
        log.info("%s: a Qwen3.5 folder with a vision tower: seqjax reads its text model (%s*); "
                 "the tower (model.visual.*) is left out, and images are refused", path, TEXT_PREFIX)
    else:
        model = model_config_from_hf(config_json, str(path / CONFIG_JSON))
    weight_map = tensor_files(path)
    tokenizer = path / TOKENIZER
    if not tokenizer.is_file():
        slow = " (it has tokenizer.model: save a fast tokenizer, e.g. LlamaTokenizerFast)" if (
            path / "tokenizer.model").is_file() else ""
        raise CheckpointError(
            f"{path}: no {TOKENIZER}{slow}; seqjax reads the fast tokenizer's tokenizer.json")
    try:
        hf_tokenizer = HFTokenizer.from_file(str(tokenizer))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"{tokenizer}: not a valid tokenizer.json ({err})") from None
    eos, bos, pad = _special_tokens(path, config_json, hf_tokenizer)
    model = _own_head(path, model, weight_map)
    carried = tuple(carried_names(model.family, weight_map))
    if carried:
        # (once a process: an export with --hf reads the folder twice, for the model and for these)
        log_once(log, logging.INFO, "%s: %d tensors seqjax keeps as they are but does not compute or train (%s), "
                 "written back on export", path, len(carried), described(carried))
    vocab = hf_tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > model.vocab_size:
        raise CheckpointError(
            f"{tokenizer}: {vocab} tokens, but {CONFIG_JSON} vocab_size is {model.vocab_size} (too few embedding rows)"
        )
    return HFFolder(path, config_json, model, weight_map, tokenizer, eos, bos, pad, carried)


def _own_head(path: Path, model: ModelConfig, weight_map: dict[str, Path]) -> ModelConfig:
    """``model`` untied when config.json ties the head to the embeddings but the folder holds its
    own, different ``lm_head.weight``: transformers (5.x) then keeps the file's head, and so does
    seqjax."""
    head = "lm_head.weight"
    embed = next((n for n in ("model.embed_tokens.weight", f"{TEXT_PREFIX}embed_tokens.weight") if n in weight_map),
                 None)  # (a text model's, or a VL model's in transformers 5's names)
    if not model.tie_embeddings or head not in weight_map or embed is None:
        return model
    try:
        tensors = []
        for name in (head, embed):
            with safe_open(weight_map[name], framework="numpy") as f:
                tensors.append(f.get_tensor(name))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: cannot read {head} or {embed} ({err})") from None
    if tensors[0].shape == tensors[1].shape and np.array_equal(tensors[0], tensors[1]):
        return model
    log.warning("%s: config.json ties the head to the embeddings (tie_word_embeddings), but the folder holds its "
                "own, different %s: reading it as transformers does, untied (model.tie_embeddings=false)", path,
                head)
    return dataclasses.replace(model, tie_embeddings=False)


def tensor_reader(weight_map: dict[str, Path]) -> Callable[[str], np.ndarray]:
    """``read(name)``: one tensor of a folder (:func:`tensor_files`), each file opened once; an
    unreadable or non-finite tensor is one line naming the file and the tensor."""
    handles: dict[Path, Any] = {}

    def read(name: str) -> np.ndarray:
        file = weight_map[name]
        try:
            if file not in handles:
                handles[file] = safe_open(file, framework="numpy")
            tensor = handles[file].get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read tensor {name} ({err})") from None
        check_finite(tensor, name, str(file))
        return tensor

    return read


def read_params(hf: HFFolder, dtype: str = "float32") -> dict[str, Any]:
    """The folder's tensors as seqjax parameters (``nnx.to_pure_dict`` layout), cast to
    ``dtype``."""
    tensor = tensor_reader(hf.weight_map)
    bar = progress_bar(total=len(hf.weight_map), desc=f"read {hf.path.name}", unit="tensor")

    def read(name: str) -> np.ndarray:
        out = tensor(name)
        bar.update()
        return out

    source = str(hf.path / (WEIGHTS if (hf.path / WEIGHTS).is_file() else INDEX))
    names = hf.weight_map
    if (hf.config_json.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        read, names = mxfp4.dequantizing(read, names)  # (gpt-oss's experts, dequantized as transformers does)
    if conditional_text(hf.config_json) is not None:
        read, names = text_tensors(read, names)
    names = [n for n in names if n not in hf.carried]
    with bar:
        if hf.model.vision.depth:
            return vision_language_params(read, names, hf.model, source, DTYPES[dtype])
        return params_from_hf(read, names, hf.model, source, DTYPES[dtype])


def run_config(hf: HFFolder, overrides: Sequence[str] = (), tokenizer_path: Path | None = None,
               run_dir: Path | None = None) -> Config:
    """A seqjax Config for the folder's model: its model section, its tokenizer, raw WikiText-2 as
    the data.

    ``data.seq_len`` is capped at the model's limit; the overrides apply on top.
    """
    model = dataclasses.asdict(hf.model)  # (its sections, rope_scaling and lora, as dicts too)
    base = {
        "model": model,
        "tokenizer": {
            "path": str(tokenizer_path or hf.tokenizer),
            "special_tokens": [hf.eos_token],
            "bos_token": hf.bos_token,
            "pad_token": hf.pad_token,
            # the tokenizer's real size (not the default of a tokenizer seqjax would train)
            "vocab_size": HFTokenizer.from_file(str(
                hf.tokenizer)).get_vocab_size(with_added_tokens=True),
        },
        "data": {"variant": "raw", "seq_len": min(Config().data.seq_len, hf.model.max_seq_len)},
    }
    if run_dir is not None:
        base["run"] = {"dir": str(run_dir)}
    return load_config(None, list(overrides), base=base)


def model_with_params(config: Config, params: dict[str, Any]) -> TransformerLM:
    """The model ``config`` describes, holding ``params`` (a pure dict): built abstractly, so
    nothing random is initialized and then thrown away."""
    abstract = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(config.run.seed)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    params = blocks_layout(params, stacked=config.model.scan_layers)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state, rest)


def load(path: str | os.PathLike, overrides: Sequence[str] = ()) -> tuple[Config, TransformerLM]:
    """(config, model with the folder's weights): what ``--hf DIR`` on eval and generate reads."""
    hf = read_folder(path)
    config = run_config(hf, overrides)
    return config, model_with_params(config, read_params(hf, config.model.param_dtype))


# ---------------------------------------------------------------------------
# Writing


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Tensors in name order, cut into groups of at most ``max_bytes`` (a larger single tensor gets
    its own)."""
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += nbytes
    return groups


def _tokenizer_with_opening_token(tokenizer_json: Path, bos: str) -> str:
    """The tokenizer.json text, with a post-processor that opens encodings with ``bos`` when it has
    none.

    seqjax trains every sequence as ``[EOT] + text``, so transformers' default
    ``tokenizer(text)`` (add_special_tokens=True) should give that too; a
    tokenizer that already adds its own tokens (Llama's) is left as it is.
    """
    hf = HFTokenizer.from_file(str(tokenizer_json))
    if hf.post_processor is None:
        bos_id = hf.token_to_id(bos)
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return hf.to_str()


def _write_weights(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int,
                   dtype: str) -> tuple[list[str], int]:
    """model.safetensors, or shards of at most ``max_shard_bytes`` with their index; (files,
    shards)."""
    groups = _shards(tensors, max_shard_bytes)
    log.info("writing %d tensors (%s, %.1f MB) to %s in %d file(s)", len(tensors), dtype,
             sum(t.nbytes for t in tensors.values()) / 1e6, out, len(groups))
    if len(groups) == 1:
        save_file(groups[0], str(out / WEIGHTS), metadata={"format": "pt"})
        return [WEIGHTS], 1
    files, weight_map = [], {}
    for i, group in enumerate(progress_bar(iterable=groups, desc="write shards", unit="shard"), start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / name), metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in group})
        files.append(name)
    total = sum(t.nbytes for t in tensors.values())
    write_text_atomic(out / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
    return files + [INDEX], len(groups)


def write_tokenizer(out: Path, tokenizer_json: Path, special: dict[str, str], max_length: int,
                    chat_template: str | None) -> list[str]:
    """The tokenizer's files as transformers' ``save_pretrained`` writes them (tokenizer.json with the opening
    token, special_tokens_map.json, tokenizer_config.json with the chat template): an HF folder's,
    and beside an exported adapter, as TRL saves them. ``special``: bos_token, eos_token (and
    pad_token)."""
    special = dict(special)
    write_text_atomic(out / TOKENIZER, _tokenizer_with_opening_token(tokenizer_json, special["bos_token"]))
    if HFTokenizer.from_file(str(tokenizer_json)).token_to_id("<unk>") is not None:
        special["unk_token"] = "<unk>"
    write_text_atomic(out / SPECIAL_TOKENS_MAP, json.dumps(special, indent=2))
    write_text_atomic(out / TOKENIZER_CONFIG, json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        **({"chat_template": chat_template} if chat_template is not None else {}),
    }, indent=2))
    return [TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP]


def write_folder(out: str | os.PathLike, cfg: ModelConfig, params: dict[str, Any], *,
                 tokenizer_json: Path, eos_token: str, bos_token: str | None,
                 pad_token: str | None = None, dtype: str = "float32",
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 chat_template: str | None = None, image_token: str = "<|image_pad|>",
                 image_processor: Path | None = None,
                 carried: tuple[dict[str, np.ndarray], dict[str, Any]] = ({}, {})) -> dict[str, Any]:
    """Write an HF folder for ``cfg`` and ``params`` (its family's, or Qwen3-VL's or Qwen2.5-VL's
    with a tower, and then ``image_processor``'s preprocessor_config.json); returns what was
    written. ``carried``: (tensors, config.json fields) the model kept untrained
    (seqjax.hf.carried), written beside its own.

    Tensors are cast to ``dtype`` and written by ``safetensors`` with the
    ``{"format": "pt"}`` metadata transformers expects, in one file or in
    shards of at most ``max_shard_bytes`` with an index.
    """
    out = Path(out)
    # Qwen3-VL or Qwen2.5-VL; a tower no Hugging Face model computes is refused before anything
    model_type = encoder_of(cfg, str(out)) if cfg.vision.depth else None
    bos = bos_token or eos_token
    hf_tok = HFTokenizer.from_file(str(tokenizer_json))
    bos_id, eos_id = hf_tok.token_to_id(bos), hf_tok.token_to_id(eos_token)
    special = {"bos_token": bos, "eos_token": eos_token}
    pad_id = None
    if pad_token is not None:
        pad_id = hf_tok.token_to_id(pad_token)
        if pad_id is None:
            raise CheckpointError(f"{tokenizer_json}: has no token {pad_token!r} (tokenizer.pad_token)")
        special["pad_token"] = pad_token
    tensors = to_hf(params, cfg)
    config_json = hf_config(cfg, bos_token_id=bos_id, eos_token_id=eos_id, dtype=dtype) | (
        {"pad_token_id": pad_id} if pad_id is not None else {})
    # Qwen3-VL or Qwen2.5-VL: the text model under its VL names, the tower, their config
    if model_type is not None:
        tensors, config_json = vision_language_folder(model_type, tensors, params["vision"], cfg,
                                                      config_json, hf_tok.token_to_id, image_token,
                                                      str(out))
    tensors, config_json = {**tensors, **carried[0]}, {**config_json, **carried[1]}
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.astype(DTYPES[dtype]) for name, t in tensors.items()}
    files, shards = _write_weights(out, tensors, max_shard_bytes, dtype)
    write_text_atomic(out / CONFIG_JSON, json.dumps(config_json, indent=2))
    if image_processor is not None:  # the processor the run's images were read with, as it was
        write_text_atomic(out / PREPROCESSOR, image_processor.read_text(encoding="utf-8"))
        files.append(PREPROCESSOR)
    files += write_tokenizer(out, tokenizer_json, special, cfg.max_seq_len, chat_template)
    write_text_atomic(
        out / GENERATION_CONFIG,
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id} |
                   ({"pad_token_id": pad_id} if pad_id is not None else {}), indent=2))
    files += [CONFIG_JSON, GENERATION_CONFIG]
    return {
        "out": str(out),
        "files": files,
        "shards": shards,
        "dtype": dtype,
        "parameters": int(sum(math.prod(t.shape) for t in tensors.values())),
        "bytes": int(sum(t.nbytes for t in tensors.values())),
    }
