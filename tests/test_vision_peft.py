"""A LoRA adapter of a Qwen3-VL model in peft's format, both ways: peft's own adapter on the tiny reference model
(tests/data/vision/vl_peft/, made by peft and transformers from scripts/make_vl_references.py) read by seqjax
computes peft's logits on image-and-text examples, and seqjax writes those adapters back as the tensors, names and
shapes peft saved (what ``python -m seqjax.export`` writes for a VL run, tests/test_vision_run.py): adapters on the
language model (``base_model.model.model.language_model.layers.i``), none on the tower.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from seqjax.core.errors import CheckpointError
from seqjax.hf import peft
from vision_support import DATA, REFERENCE, VL, logits, vl_model

FOLDER = DATA / "vl_peft"
PEFT_LOGITS = load_file(str(DATA / "vl_peft_logits.safetensors"))


def adapter():
    """(the model's config with peft's LoRA settings, peft's tensors, and them as seqjax's adapters)."""
    fields = json.loads((FOLDER / peft.ADAPTER_CONFIG).read_text())
    lora = peft.lora_from_adapter_config(fields, str(FOLDER), VL.text)
    cfg = dataclasses.replace(VL.text, lora=lora)
    tensors = load_file(str(FOLDER / peft.ADAPTER_WEIGHTS))
    return cfg, tensors, peft.from_peft(tensors, cfg, str(FOLDER))


def test_seqjax_with_pefts_vl_adapter_computes_pefts_logits():
    cfg, _, adapters = adapter()
    model = vl_model(lora=cfg.lora)
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, adapters)
    model = nnx.merge(graphdef, state)
    names = sorted(REFERENCE["examples"])
    lengths = [len(REFERENCE["examples"][name]["ids"]) - 1 for name in names]
    rows = logits(model, [[name] for name in names], max(lengths), 64)  # each alone in its padded row
    for name, n, ours in zip(names, lengths, rows):
        theirs = PEFT_LOGITS[name][:n]
        np.testing.assert_allclose(ours[:n], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max(), err_msg=name)


def test_the_adapters_write_back_as_peft_saved_them():
    cfg, tensors, adapters = adapter()
    written = peft.to_peft(adapters, cfg)
    assert sorted(written) == sorted(tensors)
    assert all(name.startswith("base_model.model.model.language_model.layers.") for name in written)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    fields = peft.adapter_config(cfg.lora, None, cfg.tie_embeddings)
    theirs = json.loads((FOLDER / peft.ADAPTER_CONFIG).read_text())
    assert {k: fields[k] for k in ("r", "lora_alpha", "use_dora", "use_rslora", "peft_type")} == {
        k: theirs[k] for k in ("r", "lora_alpha", "use_dora", "use_rslora", "peft_type")}
    assert sorted(fields["target_modules"]) == sorted(theirs["target_modules"])


def test_an_adapter_peft_would_put_on_the_tower_is_refused_in_one_line():
    fields = {**json.loads((FOLDER / peft.ADAPTER_CONFIG).read_text()), "target_modules": "all-linear"}
    with pytest.raises(CheckpointError, match="all-linear on a vision-language base, which selects the vision tower"):
        peft.lora_from_adapter_config(fields, str(FOLDER), VL.text)
    _, tensors, _ = adapter()
    text_only = dataclasses.replace(VL.text, vision=dataclasses.replace(VL.text.vision, depth=0), mrope_section=[])
    text_only = dataclasses.replace(text_only, lora=adapter()[0].lora)
    with pytest.raises(CheckpointError, match="tensor base_model.model.model.layers.0.* is missing"):
        peft.from_peft(tensors, text_only, str(FOLDER))
