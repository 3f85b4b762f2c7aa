"""A LoRA adapter of a VL model in peft's format, both ways, for Qwen3-VL and Qwen2.5-VL: peft's own adapter on a
tiny reference model (tests/data/vision/vl_peft/ and vl25_peft/, made by peft and transformers from
scripts/make_vl_references.py) read by seqjax computes peft's logits on image-and-text examples, and seqjax writes
those adapters back as the tensors, names and shapes peft saved (what ``python -m seqjax.export`` writes for a VL
run, tests/test_vision_run.py): adapters on the language model
(``base_model.model.model.language_model.layers.i``), none on the tower. Qwen2.5-VL's tower has gate_proj,
up_proj and down_proj too, so a list of module names would adapt it: peft's adapter there targets a pattern that
leaves the tower out, seqjax writes one, and names that reach the tower are refused.
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
from vision_support import DATA, QWEN2_5, REFERENCES

FAMILIES = sorted(REFERENCES)


def adapter(family: str):
    """(the reference's config with peft's LoRA settings, peft's tensors, and them as seqjax's adapters)."""
    ref = REFERENCES[family]
    folder = DATA / f"{ref.stem}_peft"
    fields = json.loads((folder / peft.ADAPTER_CONFIG).read_text())
    lora = peft.lora_from_adapter_config(fields, str(folder), ref.vl.text)
    cfg = dataclasses.replace(ref.vl.text, lora=lora)
    tensors = load_file(str(folder / peft.ADAPTER_WEIGHTS))
    return cfg, tensors, peft.from_peft(tensors, cfg, str(folder))


# (the fast loop: Qwen3-VL's; Qwen2.5-VL's adapter writes back there)
@pytest.mark.parametrize("family", ["qwen3_vl", pytest.param("qwen2_5_vl", marks=pytest.mark.slow)])
def test_seqjax_with_pefts_vl_adapter_computes_pefts_logits(family):
    ref = REFERENCES[family]
    cfg, _, adapters = adapter(family)
    model = ref.model(lora=cfg.lora)
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, adapters)
    model = nnx.merge(graphdef, state)
    expected = load_file(str(DATA / f"{ref.stem}_peft_logits.safetensors"))
    names = sorted(ref.record["examples"])
    lengths = [len(ref.record["examples"][name]["ids"]) - 1 for name in names]
    rows = ref.logits(model, [[name] for name in names], max(lengths), 64)  # each alone in its padded row
    for name, n, ours in zip(names, lengths, rows):
        theirs = expected[name][:n]
        np.testing.assert_allclose(ours[:n], theirs, rtol=0, atol=1e-5 * np.abs(theirs).max(), err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapters_write_back_as_peft_saved_them(family):
    cfg, tensors, adapters = adapter(family)
    written = peft.to_peft(adapters, cfg)
    assert sorted(written) == sorted(tensors)
    assert all(name.startswith("base_model.model.model.language_model.layers.") for name in written)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)
    fields = peft.adapter_config(cfg, None)
    theirs = json.loads((DATA / f"{REFERENCES[family].stem}_peft" / peft.ADAPTER_CONFIG).read_text())
    assert {k: fields[k] for k in ("r", "lora_alpha", "use_dora", "use_rslora", "peft_type")} == {
        k: theirs[k] for k in ("r", "lora_alpha", "use_dora", "use_rslora", "peft_type")}
    # seqjax's target_modules (a pattern of the language model's layers) selects what peft's did, and no module
    # of the tower (one would be refused)
    assert peft.lora_from_adapter_config(fields, "ours", cfg) == peft.lora_from_adapter_config(theirs, "theirs", cfg)


def test_an_adapter_peft_would_put_on_the_tower_is_refused_in_one_line():
    folder = DATA / "vl_peft"
    fields = {**json.loads((folder / peft.ADAPTER_CONFIG).read_text()), "target_modules": "all-linear"}
    cfg, tensors, _ = adapter("qwen3_vl")
    with pytest.raises(CheckpointError, match="all-linear on a vision-language base, which selects the vision tower"):
        peft.lora_from_adapter_config(fields, str(folder), cfg)
    # Qwen2.5-VL: the module names alone reach the tower's MLP
    names = {**fields, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    with pytest.raises(CheckpointError, match="selects model.visual.blocks.0.mlp.gate_proj; seqjax puts adapters on "
                                              "the language model's"):
        peft.lora_from_adapter_config(names, str(folder), QWEN2_5.vl.text)
    text_only = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, depth=0), mrope_section=[])
    with pytest.raises(CheckpointError, match="tensor base_model.model.model.layers.0.* is missing"):
        peft.from_peft(tensors, text_only, str(folder))
