"""transformers' greedy generation and peft's own LoRA on a tiny VL model of tests/data/vision (Qwen3-VL's, ``vl``, or
Qwen2.5-VL's, ``vl25``): what the model generates after a prompt with images, what a LoRA adapter of a
vision-language model is in peft's format, and what peft computes with it.

    python scripts/make_vl_references.py --out tests/data/vision               # needs torch, transformers >= 5, peft
    python scripts/make_vl_references.py --out tests/data/vision --stem vl25   # the same for the tiny Qwen2.5-VL

The files below are named for ``--stem`` (``vl``: vl_greedy.json, ...).

``vl_greedy.json``: the tokens ``generate(do_sample=False)`` gives after each reference example (vl.json) as the
prompt (:data:`NEW_TOKENS` of them), and ``vl_greedy_logits.safetensors`` the logits each was picked from
(tests/test_vision_generate.py).

The base is ``vl.safetensors`` (made by scripts/make_image_references.py) loaded into transformers'
Qwen3VLForConditionalGeneration; ``get_peft_model`` puts ``LoraConfig(r=4, lora_alpha=8, target_modules=[q, k, v,
o, gate, up, down])`` on it (peft matches those names in the language model only: the tower's layers are named
qkv, proj and linear_fc*), every adapter tensor is drawn (so B is not 0), and ``save_pretrained`` writes the folder
``vl_peft/`` (adapter_config.json, adapter_model.safetensors). For Qwen2.5-VL, whose tower has gate_proj, up_proj
and down_proj too, target_modules is a pattern that leaves the tower out. ``vl_peft_logits.safetensors``: peft's float32
logits of each reference example (vl.json) with the adapter on. tests/test_vision_peft.py reads the folder as
seqjax's adapters, compares seqjax's logits with these, and writes the adapters back as peft wrote them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

RANK, ALPHA = 4, 8
NEW_TOKENS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def image_references():
    """scripts/make_image_references.py as a module (its images, processor settings and examples)."""
    path = Path(__file__).with_name("make_image_references.py")
    spec = importlib.util.spec_from_file_location("make_image_references", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data/vision"))
    parser.add_argument("--stem", choices=["vl", "vl25"], default="vl")
    args = parser.parse_args()
    out, stem = args.out, args.stem
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    refs = image_references()
    vl = json.loads((out / f"{stem}.json").read_text())
    family = vl["config"]["model_type"]
    config_class, model_class = {
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)}[family]
    config = config_class(text_config=vl["text_config"], vision_config=vl["vision_config"], **vl["tokens"])
    model = model_class._from_config(config, attn_implementation="eager").eval()
    model.load_state_dict(load_file(str(out / f"{stem}.safetensors")))
    processor = Qwen2VLImageProcessorPil(**refs.SETTINGS[family], **vl["bounds"])
    drawn = refs.images()

    def inputs_of(example):
        ids = example["ids"]
        inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([[
            int(i == vl["tokens"]["image_token_id"]) for i in ids]])}
        if example["images"]:
            batch = processor(images=[drawn[n] for n in example["images"]], return_tensors="pt")
            inputs.update(pixel_values=batch["pixel_values"].float(), image_grid_thw=batch["image_grid_thw"])
        return inputs

    greedy, step_logits = {}, {}
    with torch.no_grad():
        for name, example in vl["examples"].items():
            made = model.generate(**inputs_of(example), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)
            greedy[name] = made.sequences[0, len(example["ids"]):].tolist()
            step_logits[name] = torch.cat(made.logits).float().contiguous()  # [NEW_TOKENS, V]
    save_file(step_logits, str(out / f"{stem}_greedy_logits.safetensors"))
    (out / f"{stem}_greedy.json").write_text(json.dumps({
        "new_tokens": greedy, "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                                          "script": "scripts/make_vl_references.py"}}) + "\n")
    # Qwen2.5-VL's tower has gate_proj, up_proj and down_proj too: the names would adapt it, so its adapter
    # targets the language model with a pattern that leaves the tower out (as LLaMA-Factory writes one)
    targets = TARGETS if family == "qwen3_vl" else rf"^(?!.*visual).*\.({'|'.join(TARGETS)})"
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    torch.manual_seed(2)
    adapted = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0.0, 0.2)
                adapted.append(name)
    assert not [n for n in adapted if "visual" in n], "peft put an adapter on the vision tower"
    logits = {}
    for name, example in vl["examples"].items():
        with torch.no_grad():
            logits[name] = model(**inputs_of(example)).logits[0].contiguous()
    target = out / f"{stem}_peft"
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        target.mkdir(exist_ok=True)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(Path(tmp) / file, target / file)
    save_file(logits, str(out / f"{stem}_peft_logits.safetensors"))
    (out / f"{stem}_peft.json").write_text(json.dumps({
        "adapted": len(adapted), "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                                             "peft": peft.__version__, "script": "scripts/make_vl_references.py"}
    }) + "\n")
    print(json.dumps({"adapter_tensors": len(adapted), "examples": sorted(logits), "greedy": greedy}))


if __name__ == "__main__":
    main()
