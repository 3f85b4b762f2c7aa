"""seqjax reads peft's LoRA adapters and computes what peft computes, on every family seqjax loads.

The references (tests/data/lora/) were made by peft itself (scripts/make_lora_reference.py): each family's
reference base with adapters on q, k, v, o, gate, up and down, r = 4, lora_alpha = 8, every adapter tensor drawn
from its name (so B is not 0). Here the base and the adapters are rebuilt from the names, read by seqjax as an
HF folder and a PEFT folder (train.init_adapter's reader), and seqjax's logits are compared with peft's. Where
torch and peft import, seqjax's exported adapter is also loaded by peft live.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from seqjax.core.errors import ConfigError
from seqjax.hf import folders as hf
from seqjax.hf import peft
from seqjax.model import build_model, split_params
from seqjax.model.stacking import blocks_layout
from seqjax.train.adapters import read_adapter
from seqjax.train.init_from import locate
from test_families import FAMILIES, SCRIPT, assert_close, hf_folder, logits

REFERENCES = Path(__file__).parent / "data" / "lora"


def peft_folder(family: str, folder: Path) -> Path:
    record = json.loads((REFERENCES / f"{family}.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / peft.ADAPTER_CONFIG).write_text(json.dumps(record["adapter_config"]))
    save_file(SCRIPT.reference_weights(record["tensors"]), str(folder / peft.ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return folder


def lora_model(family: str, tmp_path: Path, *overrides: str):
    """The family's reference base with peft's adapters, as seqjax builds it from the two folders."""
    folder = hf.read_folder(hf_folder(family, tmp_path / family))
    adapter = peft_folder(family, tmp_path / f"{family}_adapter")
    config = hf.run_config(folder, ["model.attention=xla", "model.lora.rank=4", "model.lora.alpha=8", *overrides])
    graphdef, _, _, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    base = blocks_layout(hf.read_params(folder), stacked=config.model.scan_layers)
    return nnx.merge(graphdef, read_adapter(str(adapter), config), base, rest), folder, adapter


@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # the fast loop: Llama; the full suite: every family
def test_seqjax_with_pefts_adapter_computes_pefts_logits(family, tmp_path):
    model, _, _ = lora_model(family, tmp_path)
    ref = load_file(str(REFERENCES / f"{family}.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.slow
def test_scanned_layers_read_the_same_adapter(tmp_path):
    model, _, _ = lora_model("gemma3", tmp_path, "model.scan_layers=true")
    ref = load_file(str(REFERENCES / "gemma3.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


def test_an_adapter_seqjax_cannot_compute_is_refused_naming_the_field(tmp_path):
    from seqjax.core.errors import CheckpointError

    record = json.loads((REFERENCES / "llama.json").read_text())
    for field, value in (("use_dora", True), ("use_rslora", True), ("lora_bias", True)):
        with pytest.raises(CheckpointError, match=f"{field}: got True"):
            peft.lora_from_adapter_config({**record["adapter_config"], field: value}, "adapter_config.json")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_peft_loads_seqjaxs_exported_adapter_onto_the_hf_base_with_equal_logits(family, tmp_path):
    """Live, where torch and peft import."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers >= 5 has these families in PyTorch")
    model, folder, _ = lora_model(family, tmp_path)
    out = tmp_path / "exported"
    out.mkdir()
    tensors = peft.to_peft(nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)), model.cfg)
    save_file(tensors, str(out / peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / peft.ADAPTER_CONFIG).write_text(json.dumps(peft.adapter_config(model.cfg.lora, str(folder.path))))
    base = transformers.AutoModelForCausalLM.from_pretrained(folder.path, attn_implementation="eager")
    theirs = peft_lib.PeftModel.from_pretrained(base, out).eval()
    ids = load_file(str(REFERENCES / f"{family}.safetensors"))["seq0.ids"]
    with torch.no_grad():
        expected = theirs(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert_close(logits(model, ids), expected)


def test_a_peft_folder_given_as_init_from_points_at_init_adapter(tmp_path):
    """A PEFT adapter folder holds no model: train.init_from refuses it in one line naming the key that reads it."""
    peft_folder("llama", tmp_path / "adapter")
    with pytest.raises(ConfigError, match=r"train.init_from: .*adapter is a PEFT adapter folder \(adapter_config.json"
                                          r"\), not a model; set train.init_adapter=.*adapter for its adapters"):
        locate(str(tmp_path / "adapter"))
