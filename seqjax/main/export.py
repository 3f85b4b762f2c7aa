"""``python -m seqjax.export --run DIR --out HF_DIR [--dtype bfloat16]``: a seqjax model as a
Hugging Face folder.

The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)``
and ``AutoTokenizer.from_pretrained(HF_DIR)`` (see :mod:`seqjax.hf.folders` for its
files). ``--checkpoint STEP_DIR`` exports one step, ``--hf DIR`` re-exports an
HF folder (to change its dtype or shard size). The last stdout line is one
JSON object: the files, shards, dtype, parameters and bytes written.

A ``model.lora`` run exports its adapters as a PEFT adapter folder (``adapter_config.json``,
``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(base, HF_DIR)`` loads onto
the base model; ``--merge`` folds them into the base and writes the whole model instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from flax import nnx
from safetensors.numpy import save_file

from seqjax.config.tree import LoraConfig
from seqjax.core.errors import UsageError
from seqjax.core.files import check_new_folder, staged_folder, write_text_atomic
from seqjax.hf import folders as hf
from seqjax.hf import peft
from seqjax.hf.carried import folder_carried, read_carried
from seqjax.hf.vision import encoder_of
from seqjax.main import cli, trained
from seqjax.model.assembly import full_weights
from seqjax.model.lora import trained_filter
from seqjax.store.chat import find_chat_template
from seqjax.store.image_chats import image_processor_file
from seqjax.weights import sources
from seqjax.weights.inference import newest_meta

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.export",
                   "Write a trained model as a Hugging Face model folder (safetensors).")
    trained.add_checkpoint_args(p)
    p.add_argument("--out", required=True, metavar="HF_DIR", help="the folder to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder whole")
    p.add_argument("--dtype", choices=tuple(hf.DTYPES), default="float32",
                   help="tensor dtype (default: %(default)s)")
    p.add_argument(
        "--merge", action="store_true",
        help="model.lora runs: fold the adapters into the base and write the whole model (default: a "
        "PEFT adapter folder)")
    p.add_argument(
        "--max-shard-bytes", type=int, default=hf.DEFAULT_SHARD_BYTES, metavar="N",
        help="cut model.safetensors into shards of at most N bytes, with an index (default: 5 GiB)")
    cli.run(p, argv, export)
    return 0


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Refuse a non-empty --out (unless --overwrite), load the checkpoint, write the HF folder,
    print the JSON line.

    The folder is written beside --out and renamed into place: a failure leaves --out as it was.
    """
    check_new_folder(args.out, overwrite=args.overwrite)
    if args.max_shard_bytes < 1:
        raise UsageError(
            f"--max-shard-bytes: got {args.max_shard_bytes}, expected a positive number of bytes")
    config, model = trained.load_checkpoint(args)
    # The run's own tokenizer, refused unless it is the one the checkpoint was trained with (as eval
    # and generate do).
    tokenizer = trained.trained_tokenizer(args, config)
    cfg = model.cfg
    if cfg.lora.rank and not args.merge:
        adapters = nnx.to_pure_dict(nnx.state(model, trained_filter(cfg.lora)))
        return _export_adapter(args, cfg, adapters, _peft_base(args, config), config, tokenizer)
    processor = None
    if cfg.vision.depth:  # a VL folder: its settings checked before any weight is merged or written
        encoder_of(cfg, f"--out {args.out}")
        processor = _processor_file(config.data.image_processor)
    if args.merge and not cfg.lora.rank:
        raise UsageError(
            "--merge: the run has no adapters (model.lora.rank is 0); export it without --merge")
    # a QLoRA base is written (or merged into) as read back: what the run computed with
    params, cfg = full_weights(model), dataclasses.replace(cfg, lora=LoraConfig())
    with staged_folder(args.out, overwrite=args.overwrite) as staging:
        result = hf.write_folder(
            staging,
            cfg,
            params,
            tokenizer_json=tokenizer.path,
            eos_token=tokenizer.eot_token,
            bos_token=config.tokenizer.bos_token,
            pad_token=config.tokenizer.pad_token,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_bytes,
            chat_template=find_chat_template(Path(tokenizer.path), config.data.chat_template),
            image_token=config.data.image_token,
            image_processor=processor,
            carried=_carried(args),
        )
    result["out"] = str(args.out)
    print(json.dumps(result), flush=True)
    return result


def _carried(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, config fields) the model carries untrained (seqjax.hf.carried: Qwen3.5's mtp.*), from
    the --hf folder or the run's carried.safetensors, to be written back beside it."""
    if getattr(args, "hf", None):
        return folder_carried(hf.read_folder(args.hf))
    key = "--run" if args.run else "--checkpoint"
    return read_carried(sources.locate(args.run or args.checkpoint, key).config_file.parent)


def _processor_file(image_processor: str | None) -> Path | None:
    """The preprocessor_config.json a VL run read its images with, to go beside the weights; None,
    said in one line, when the run names none or it is gone."""
    file = image_processor_file(image_processor) if image_processor else None
    if file is None or not file.is_file():
        missing = f"data.image_processor's {file} is not there" if file else "the run names no data.image_processor"
        log.warning("export: %s, so the folder gets no preprocessor_config.json; copy the base model's "
                    "beside it", missing)
        return None
    return file


def _peft_base(args: argparse.Namespace, config) -> str | None:
    """What adapter_config.json's ``base_model_name_or_path`` names: the Hugging Face folder the
    base was read from (``--hf``, ``train.init_from``, or the folder a seqjax run was imported
    from), else the hub id its config.json recorded; None, said in one line, when the base is no HF
    model."""
    if getattr(args, "hf", None):
        return str(Path(args.hf).resolve())
    source = config.train.init_from
    if source and hf.is_hf_folder(Path(source).expanduser()):
        return str(Path(source).expanduser().resolve())
    meta = newest_meta(source) if source else {}
    imported = meta.get("imported_from")
    if imported and hf.is_hf_folder(imported):
        return imported
    name = meta.get("name_or_path")
    if name and (hf.is_hf_folder(name) or
                 not Path(name).is_absolute()):  # a hub id, or a folder that is there
        return name
    log.warning(
        "export: the adapters' base (%s) is no Hugging Face model folder and records none it was "
        "imported from, so adapter_config.json's base_model_name_or_path is null; export the base "
        "as a folder and pass it to PeftModel.from_pretrained", source or
        "run.seed's initialization")
    return None


def _export_adapter(args: argparse.Namespace, cfg, adapters: dict[str, Any],
                    base: str | None, config, tokenizer) -> dict[str, Any]:
    """The run's adapters as a PEFT adapter folder, in ``--dtype``, with the tokenizer and chat template the
    run trained with beside them, as TRL's trainers save them."""
    tensors = {name: t.astype(hf.DTYPES[args.dtype]) for name, t in peft.to_peft(adapters, cfg).items()}
    special = {"bos_token": config.tokenizer.bos_token or tokenizer.eot_token, "eos_token": tokenizer.eot_token,
               **({"pad_token": config.tokenizer.pad_token} if config.tokenizer.pad_token else {})}
    with staged_folder(args.out, overwrite=args.overwrite) as staging:
        save_file(tensors, str(staging / peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_text_atomic(staging / peft.ADAPTER_CONFIG,
                          json.dumps(peft.adapter_config(cfg, base), indent=2))
        files = hf.write_tokenizer(staging, Path(tokenizer.path), special, cfg.max_seq_len,
                                   find_chat_template(Path(tokenizer.path), config.data.chat_template))
    result = {
        "out": str(args.out), "files": [peft.ADAPTER_CONFIG, peft.ADAPTER_WEIGHTS, *files],
        "dtype": args.dtype, "adapter_parameters": int(sum(t.size for t in tensors.values())),
        "bytes": int(sum(t.nbytes for t in tensors.values()))
    }
    print(json.dumps(result), flush=True)
    return result
