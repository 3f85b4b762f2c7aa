"""Reference outputs of peft's own LoRA: each family's reference model with adapters on all seven projections,
and peft's variants (rsLoRA, DoRA, modules_to_save, its A initialisations).

    python scripts/make_lora_reference.py --out tests/data/lora     # needs torch, transformers >= 5 and peft

For each family of scripts/make_family_references.py: the same base (weights drawn from their names), peft's
``LoraConfig(r=4, lora_alpha=8, target_modules=[q, k, v, o, gate, up, down])`` applied by ``get_peft_model``,
every adapter tensor drawn from its name too (so B is not 0 and each adapter matters), and peft's float32 logits
of ``seq0`` (``<family>.safetensors``), plus the adapter_config.json peft writes and the adapter tensors' names
and shapes (``<family>.json``). The variants (``VARIANTS``) are made the same way on one family each, named
``<family>-<variant>``: their adapter folder is written with the drawn tensors and loaded back by
``PeftModel.from_pretrained``, so peft's own reader decides what they compute. ``init.json`` holds the
statistics of the A matrices peft's initialisations draw (init_lora_weights true and "gaussian").
tests/test_lora_peft.py rebuilds the bases and the adapters, loads them as PEFT folders, and compares seqjax's
logits (and A's initialisation) with these.
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
# <family>-<variant>: the LoraConfig settings beside r and lora_alpha. target_modules as peft users give it:
# all-linear (peft saves the full module paths it chose), a regular expression, names.
VARIANTS = {
    "llama-rslora": ("llama", {"use_rslora": True, "target_modules": r".*\.(q_proj|v_proj|down_proj)"}),
    "qwen2-dora": ("qwen2", {"use_dora": True, "target_modules": "all-linear"}),
    "mistral-dora-rslora": ("mistral", {"use_dora": True, "use_rslora": True, "target_modules": TARGETS[:4]}),
    "llama-save": ("llama", {"target_modules": TARGETS, "modules_to_save": ["embed_tokens", "lm_head"]}),
    "gemma3-save": ("gemma3", {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens"],
                               "ensure_weight_tying": True}),
}


def _families():
    path = Path(__file__).resolve().parent / "make_family_references.py"
    spec = importlib.util.spec_from_file_location("make_family_references", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _base(family: str):
    """The family's reference model with its weights, as make_family_references.py builds it."""
    import torch
    import transformers

    refs = _families()
    class_name, settings = refs.FAMILIES[family]
    config = getattr(transformers, class_name)(**refs.COMMON, **settings)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    record = json.loads((Path(__file__).resolve().parents[1] / "tests/data/families" / f"{family}.json").read_text())
    weights = refs.reference_weights(record["tensors"])
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model


def adapter_tensors(shapes: dict[str, list[int]], tied: bool) -> dict[str, np.ndarray]:
    """An adapter's tensors drawn from their names (tests/test_lora_peft.py draws the same); on a tied base the
    head peft saves beside the embeddings is the embeddings."""
    tensors = _families().reference_weights(shapes)
    head, embed = "base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"
    if tied and head in tensors and embed in tensors:
        tensors[head] = tensors[embed]
    return tensors


def make(name: str, out: Path, family: str, settings: dict) -> None:
    """peft's logits of seq0 on ``family``'s base with an adapter of ``settings``, drawn from its names."""
    import peft
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    refs = _families()
    model = _base(family)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM", **settings)
    lora = peft.get_peft_model(model, config)
    with tempfile.TemporaryDirectory() as tmp:  # the names and shapes as peft saves them
        lora.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "adapter_model.safetensors"))
        adapter_config = json.loads((Path(tmp) / "adapter_config.json").read_text())
        shapes = {key: list(t.shape) for key, t in saved.items()}
        save_file(adapter_tensors(shapes, model.config.tie_word_embeddings),
                  str(Path(tmp) / "adapter_model.safetensors"), metadata={"format": "pt"})
        loaded = peft.PeftModel.from_pretrained(_base(family), tmp).eval()  # peft's reader
    with torch.no_grad():
        logits = loaded(torch.tensor([refs.SEQUENCES["seq0"]])).logits[0].float().numpy()
    (out / f"{name}.json").write_text(json.dumps({
        "family": family, "adapter_config": adapter_config, "tensors": shapes,
        "made_by": {"peft": peft.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                    "script": "scripts/make_lora_reference.py"}}, indent=1) + "\n")
    save_file({"seq0.ids": np.asarray(refs.SEQUENCES["seq0"], np.int32), "seq0.logits": logits},
              str(out / f"{name}.safetensors"))
    (out / f"{name}.safetensors").chmod(0o644)
    print(json.dumps({"reference": name, "adapter_tensors": len(shapes)}))


def init_statistics(out: Path) -> None:
    """The spread of the A matrices peft draws (r = 8 on Llama's reference base), per input width."""
    import peft
    import torch

    stats = {}
    for init in (True, "gaussian"):
        torch.manual_seed(0)
        lora = peft.get_peft_model(_base("llama"), peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                                    init_lora_weights=init))
        by_width: dict[int, list[np.ndarray]] = {}
        for module_name, module in lora.named_modules():
            if module_name.endswith("lora_A.default"):
                a = module.weight.detach().numpy()
                by_width.setdefault(a.shape[1], []).append(a.ravel())
        stats[str(init).lower()] = {str(width): {"rank": 8, "n": int(sum(len(v) for v in values)),
                                                 "max_abs": float(np.abs(np.concatenate(values)).max()),
                                                 "std": float(np.concatenate(values).std())}
                                    for width, values in sorted(by_width.items())}
    (out / "init.json").write_text(json.dumps({"init_lora_weights": stats, "made_by": {
        "peft": peft.__version__, "torch": torch.__version__, "script": "scripts/make_lora_reference.py"}},
        indent=1) + "\n")
    print(json.dumps({"reference": "init", "widths": sorted(stats["true"])}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/lora"))
    p.add_argument("--families", nargs="*", default=["llama", "mistral", "qwen2", "qwen3", "gemma3"])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        make(family, args.out, family, {"target_modules": TARGETS})
    for name in args.variants:
        make(name, args.out, *VARIANTS[name])
    init_statistics(args.out)


if __name__ == "__main__":
    main()
