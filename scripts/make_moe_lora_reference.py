"""Reference outputs of peft's own LoRA on mixture-of-experts models: adapters on the attention and, by peft's
``target_parameters``, on each layer's fused expert tensors (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).

    python scripts/make_moe_lora_reference.py --out tests/data/moe   # needs torch, transformers >= 5.24, peft

For Qwen3-MoE and gpt-oss (scripts/make_moe_references.py's bases, weights drawn from their names): peft's
``LoraConfig(r=2, lora_alpha=4, target_modules=[q_proj, v_proj], target_parameters=[...])`` by
``get_peft_model``; every adapter tensor drawn from its name (so each B is nonzero and matters), written as an
adapter folder and loaded back by ``PeftModel.from_pretrained`` (peft's own reader decides what they compute).
``<family>-lora.json``: the adapter_config.json peft writes, the adapter tensors' names and shapes;
``<family>-lora.safetensors``: peft's float32 logits of ``seq0``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK, ALPHA = 2, 4
FAMILIES = ("qwen3_moe", "gpt_oss")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(family: str, out: Path) -> None:
    import numpy as np
    import peft
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.numpy import save_file

    moe = _script("make_moe_references")
    record = json.loads((out / f"{family}.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, adapter_dir = Path(tmp) / "base", Path(tmp) / "adapter"
        base_dir.mkdir()
        (base_dir / "config.json").write_text(json.dumps(record["config"]))
        save_file(moe.reference_weights(record["tensors"]), str(base_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                                 dtype=torch.float32)
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        peft.get_peft_model(base, config).save_pretrained(adapter_dir)
        with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        save_file(moe.reference_weights(shapes), str(adapter_dir / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                                 dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        with torch.no_grad():
            logits = model(torch.tensor([moe.SEQUENCES["seq0"]])).logits[0].float().numpy()
    (out / f"{family}-lora.json").write_text(json.dumps({
        "family": family, "adapter_config": adapter_config, "tensors": shapes,
        "made_by": {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                    "script": "scripts/make_moe_lora_reference.py"}}, indent=1) + "\n")
    save_file({"seq0.logits": logits, "seq0.ids": np.asarray(moe.SEQUENCES["seq0"], np.int32)},
              str(out / f"{family}-lora.safetensors"))
    (out / f"{family}-lora.safetensors").chmod(0o644)
    print(json.dumps({"family": family, "adapter_tensors": len(shapes)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/moe"))
    args = p.parse_args()
    for family in FAMILIES:
        make(family, args.out)


if __name__ == "__main__":
    main()
