"""Reference outputs of peft's own LoRA: each family's reference model with adapters on all seven projections.

    python scripts/make_lora_reference.py --out tests/data/lora     # needs torch, transformers >= 5 and peft

For each family of scripts/make_family_references.py: the same base (weights drawn from their names), peft's
``LoraConfig(r=4, lora_alpha=8, target_modules=[q, k, v, o, gate, up, down])`` applied by ``get_peft_model``,
every adapter tensor drawn from its name too (so B is not 0 and each adapter matters), and peft's float32 logits
of ``seq0`` (``<family>.safetensors``), plus the adapter_config.json peft writes and the adapter tensors' names
and shapes (``<family>.json``). tests/test_lora_peft.py rebuilds the base and the adapters, loads them as a
PEFT folder, and compares seqjax's logits with these.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

import numpy as np

RANK, ALPHA = 4, 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _families():
    path = Path(__file__).resolve().parent / "make_family_references.py"
    spec = importlib.util.spec_from_file_location("make_family_references", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(family: str, out: Path) -> None:
    import peft
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    refs = _families()
    class_name, settings = refs.FAMILIES[family]
    config = getattr(transformers, class_name)(**refs.COMMON, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    record = json.loads((Path(__file__).resolve().parents[1] / "tests/data/families" / f"{family}.json").read_text())
    weights = refs.reference_weights(record["tensors"])
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    with tempfile.TemporaryDirectory() as tmp:  # the names and shapes as peft saves them
        lora.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "adapter_model.safetensors"))
        adapter_config = json.loads((Path(tmp) / "adapter_config.json").read_text())
    shapes = {name: list(t.shape) for name, t in saved.items()}
    adapters = refs.reference_weights(shapes)
    state = {name.replace(".weight", ".default.weight"): torch.from_numpy(t) for name, t in adapters.items()}
    missing = set(state) - set(lora.state_dict())
    assert not missing, sorted(missing)[:3]
    lora.load_state_dict(state, strict=False)
    with torch.no_grad():
        ids = torch.tensor([refs.SEQUENCES["seq0"]])
        logits = lora(ids).logits[0].float().numpy()
    (out / f"{family}.json").write_text(json.dumps({
        "family": family, "adapter_config": adapter_config, "tensors": shapes,
        "made_by": {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                    "script": "scripts/make_lora_reference.py"}}, indent=1) + "\n")
    save_file({"seq0.ids": np.asarray(refs.SEQUENCES["seq0"], np.int32), "seq0.logits": logits},
              str(out / f"{family}.safetensors"))
    (out / f"{family}.safetensors").chmod(0o644)
    print(json.dumps({"family": family, "adapter_tensors": len(shapes)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/lora"))
    p.add_argument("--families", nargs="*", default=["llama", "mistral", "qwen2", "qwen3", "gemma3"])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        make(family, args.out)


if __name__ == "__main__":
    main()
