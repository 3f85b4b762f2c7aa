"""``python -m seqjax.import HF_DIR --out DIR [key=value ...]``: a Hugging Face model folder as a
seqjax run folder.

``DIR`` then holds what a training run leaves for inference: ``config.yaml``
(the model's fields, its tokenizer, raw WikiText-2 as the data), its own
``tokenizer.json`` and ``checkpoints/0`` (orbax, parameters only), so
``seqjax.eval --run DIR``, ``seqjax.generate --run DIR``, ``seqjax.export --run
DIR`` and ``train.init_from=DIR`` all read it. Nothing is downloaded; a field
or tensor seqjax cannot compute is refused before anything is written
(:mod:`seqjax.hf.families` lists them). The last stdout line is one JSON object.

(The module is ``import_hf`` because ``import`` is a Python keyword;
``python -m seqjax.import`` runs it through ``seqjax/import.py``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from typing import Any, Sequence

from seqjax.config.load import announce
from seqjax.core.errors import UsageError
from seqjax.core.files import check_new_folder, staged_folder, write_text_atomic
from seqjax.hf import folders as hf
from seqjax.hf.carried import folder_carried, write_carried
from seqjax.main import cli
from seqjax.model.stacking import blocks_layout
from seqjax.store.chat import find_chat_template
from seqjax.store.image_chats import PREPROCESSOR
from seqjax.store.spec import CHAT_TEMPLATE_FILE
from seqjax.train.checkpoint import save_params
from seqjax.weights.saved import TOKENIZER_FILE


def main(argv: Sequence[str] | None = None) -> int:
    p = cli.parser("python -m seqjax.import",
                   "Turn a Hugging Face model folder into a seqjax run folder.")
    # HF_DIR shares the positional slot with the key=value overrides (cli.parser's): the one word
    # without '='
    p.usage = "%(prog)s HF_DIR --out DIR [key=value ...]"
    p.add_argument("--out", required=True, metavar="DIR", help="the run folder to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder whole")
    words = list(sys.argv[1:] if argv is None else argv)
    if words and not words[0].startswith("-"):
        # argparse cannot split one positional slot by flags: HF_DIR joins the overrides
        words.append(words.pop(0))
    cli.run(p, words, import_folder)
    return 0


def import_folder(args: argparse.Namespace) -> dict[str, Any]:
    """Check everything (folder, fields, tensors, overrides) before writing, then tokenizer,
    checkpoint, config."""
    if args.config:
        raise UsageError(
            "--config: the configuration comes from HF_DIR/config.json; pass key=value overrides")
    folders = [word for word in args.overrides if "=" not in word]
    if len(folders) != 1:
        raise UsageError(f"expected one HF_DIR (a Hugging Face model folder), got {folders or 'none'}")
    overrides = [word for word in args.overrides if "=" in word]
    out = check_new_folder(args.out, overwrite=args.overwrite)
    start = time.perf_counter()
    folder = hf.read_folder(folders[0])
    # The config names the final folder; the files are written beside it and renamed into place at
    # the end.
    config = hf.run_config(folder, overrides, tokenizer_path=out / TOKENIZER_FILE, run_dir=out)
    params = blocks_layout(hf.read_params(folder, config.model.param_dtype),
                           stacked=config.model.scan_layers)
    with staged_folder(out, overwrite=args.overwrite) as staging:
        shutil.copyfile(folder.tokenizer, staging / TOKENIZER_FILE)
        template = find_chat_template(folder.tokenizer)
        if template is not None:  # beside the run's tokenizer, where data.format=chat finds it
            write_text_atomic(staging / CHAT_TEMPLATE_FILE, template)
        if (folder.path / PREPROCESSOR).is_file():  # a VL model's image processor: the run carries it
            shutil.copyfile(folder.path / PREPROCESSOR, staging / PREPROCESSOR)
        # where the weights came from: what a LoRA run on this base names as its base on export
        name = folder.config_json.get("_name_or_path")
        save_params(staging, 0, params, {"tokens_seen": 0, "imported_from": str(folder.path.resolve()),
                                         "name_or_path": name if isinstance(name, str) and name else None})
        write_carried(staging, *folder_carried(folder), str(folder.path))  # (Qwen3.5's mtp.*, kept as they are)
        # (named where it will be: the staging folder is renamed)
        announce(config, staging, final=out, given=(str(folder.path / "config.json"), overrides))
    result = {
        "out": str(out),
        "source": str(folder.path),
        "model": dataclasses.asdict(config.model) | {"rope_scaling": config.model.rope_scaling.type},
        "tensors": len(folder.weight_map),
        "shards": len(set(folder.weight_map.values())),
        "seconds": round(time.perf_counter() - start, 3),
    }
    print(json.dumps(result), flush=True)
    return result
