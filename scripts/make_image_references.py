"""Reference pixel values of transformers' own Qwen2-VL image processor (its PIL backend), on images of odd sizes.

    python scripts/make_image_references.py --out tests/data/vision     # needs transformers >= 5 and Pillow

The images are not stored: :func:`images` draws each from its name (noise with a few gradients, in the modes
a corpus holds: RGB, grayscale, RGBA with transparency, palette), so the test rebuilds them without transformers.
For each image and each processor setting (Qwen2.5-VL's: CLIP's mean and std, patch 14; Qwen3-VL's: 0.5 and
0.5, patch 16; both with small pixel bounds so the references stay small) ``images.json`` holds the grid
(image_grid_thw), the pixel values' shape, their sum and sum of squares, and the values at 512 positions drawn
from the image's name: enough to tell any difference in resizing, normalization or patch order.

``tower.safetensors`` and ``tower.json``: a tiny Qwen3-VL vision encoder (:data:`TOWER`, random weights, built by
transformers with a fixed seed) and what it computes on :data:`TOWER_IMAGES` preprocessed at :data:`TOWER_BOUNDS`
and given to it together (transformers packs them with ``cu_seqlens``): the image tokens (``pooler_output``) and
the DeepStack features.

``vl25.safetensors``, ``vl25.json`` and ``vl25_logits.safetensors``: the same for a tiny Qwen2.5-VL (:data:`VL25_TEXT`,
:data:`VL25_TOWER`: windowed blocks with one full block, a gated MLP, RMSNorm, patch 14; bounds :data:`VL25_BOUNDS`
so the images span several windows), and ``vl25_saved.json`` the tensor names ``save_pretrained`` writes for it
(Hugging Face's Qwen2.5-VL checkpoints keep the older ``visual.*`` and ``model.layers.*`` names).

``rope.json``: the 3-D rope index transformers' ``get_rope_index`` gives (Qwen2.5-VL's and Qwen3-VL's, tiny models
built here) for sequences of text and images of several grids (:data:`SEQUENCES`), each alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

SIZES = {"wide": (37, 251, "RGB"), "tall": (300, 45, "RGB"), "odd": (101, 67, "L"), "alpha": (90, 130, "RGBA"),
         "palette": (64, 64, "P"), "small": (20, 30, "RGB"), "large": (480, 640, "RGB")}
SETTINGS = {"qwen2_5_vl": {"patch_size": 14, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                           "image_std": [0.26862954, 0.26130258, 0.27577711]},
            "qwen3_vl": {"patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}
BOUNDS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "merge_size": 2, "temporal_patch_size": 2}
SAMPLES = 512
TOWER = {"depth": 3, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32, "out_hidden_size": 24,
         "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 16,
         "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh"}
TOWER_BOUNDS = {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 12, "merge_size": 2, "temporal_patch_size": 2}
TOWER_IMAGES = ("wide", "odd", "small", "alpha")
# A tiny Qwen3-VL (the tower above under a 3-layer Qwen3 text model with interleaved M-RoPE) and three examples:
# text runs (ints: that many ids drawn from the example's name) and images (by name), in order.
VL_TEXT = {"hidden_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 48, "vocab_size": 128, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                               "mrope_interleaved": True}}
VL_TOKENS = {"image_token_id": 120, "vision_start_token_id": 121, "vision_end_token_id": 122}
VL_EXAMPLES = {"one_image": [5, "wide", 4], "two_images": [3, "odd", 2, "small", 3], "text_only": [6]}
# A tiny Qwen2.5-VL: a Qwen2 text model (biases on q, k, v; M-RoPE in three runs), a tower with 56-pixel windows
# (2 x 2 merged groups) in blocks 0 and 2 and full attention in block 1.
VL25_TEXT = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
             "intermediate_size": 48, "vocab_size": 128, "rms_norm_eps": 1e-6,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
VL25_TOWER = {"depth": 3, "hidden_size": 16, "num_heads": 2, "intermediate_size": 24, "out_hidden_size": 32,
              "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 56,
              "fullatt_block_indexes": [1], "hidden_act": "silu"}
VL25_BOUNDS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 30, "merge_size": 2, "temporal_patch_size": 2}
# text runs (ints: their lengths) and images (grids t, h, w in patches), in order; merge size 2
SEQUENCES = {"one_image": [3, (1, 4, 6), 5], "two_images": [2, (1, 8, 4), 3, (1, 2, 2), 1],
             "image_first": [(1, 6, 6), 4], "tall": [1, (1, 12, 2), 2], "text_only": [7]}


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))


def images() -> dict:
    """Each test image, drawn from its name (Pillow)."""
    from PIL import Image

    out = {}
    for name, (h, w, mode) in SIZES.items():
        rng = _rng(name)
        rgb = rng.integers(0, 256, (h, w, 3)).astype(np.float64)
        rgb = 0.5 * rgb + 0.5 * 255 * np.linspace(0, 1, w)[None, :, None]  # a gradient: resizing shows
        image = Image.fromarray(rgb.astype(np.uint8), "RGB")
        if mode == "RGBA":
            alpha = rng.integers(0, 256, (h, w)).astype(np.uint8)
            image = Image.fromarray(np.dstack([np.asarray(image), alpha]), "RGBA")
        elif mode in ("L", "P"):
            image = image.convert(mode)
        out[name] = image
    return out


def sample_positions(name: str, shape: tuple[int, int]) -> np.ndarray:
    return _rng("positions/" + name).integers(0, shape[0] * shape[1], SAMPLES)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/vision"))
    p.add_argument("--only", choices=["vl25"], help="make only these references (the others are left as they are)")
    args = p.parse_args()
    import transformers

    if args.only == "vl25":
        print(json.dumps({"vl25": vl25_references(transformers, args.out)}))
        return
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    args.out.mkdir(parents=True, exist_ok=True)
    record = {"bounds": BOUNDS, "settings": SETTINGS, "images": {},
              "made_by": {"transformers": transformers.__version__, "script": "scripts/make_image_references.py"}}
    for setting, values in SETTINGS.items():
        processor = Qwen2VLImageProcessorPil(**values, **BOUNDS)
        for name, image in images().items():
            out = processor(images=[image], return_tensors="np")
            pixels, grid = np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"])[0]
            where = sample_positions(f"{setting}/{name}", pixels.shape)
            record["images"][f"{setting}/{name}"] = {
                "grid": grid.tolist(), "shape": list(pixels.shape), "sum": float(pixels.astype(np.float64).sum()),
                "sum_squares": float((pixels.astype(np.float64) ** 2).sum()),
                "samples": pixels.reshape(-1)[where].tolist()}
    (args.out / "images.json").write_text(json.dumps(record) + "\n")
    (args.out / "rope.json").write_text(json.dumps(rope_references(transformers)) + "\n")
    tower = tower_references(transformers, args.out)
    vl = vl_references(transformers, args.out)
    vl25 = vl25_references(transformers, args.out)
    print(json.dumps({"images": len(record["images"]), "rope": len(SEQUENCES), "tower": tower, "vl": vl,
                      "vl25": vl25}))


def vl25_references(transformers, out: Path) -> dict:
    """The tiny Qwen2.5-VL's weights (vl25.safetensors), each example's logits alone (vl25_logits.safetensors) and
    the names save_pretrained gives its tensors (vl25_saved.json)."""
    import tempfile

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(3)
    config = transformers.Qwen2_5_VLConfig(text_config=VL25_TEXT, vision_config=VL25_TOWER, **VL_TOKENS)
    model = scaled(transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="eager"))
    processor = Qwen2VLImageProcessorPil(**SETTINGS["qwen2_5_vl"], **VL25_BOUNDS)
    logits, examples = examples_logits(model, processor)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            saved = sorted(f.keys())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "vl25.safetensors"))
    save_file(logits, str(out / "vl25_logits.safetensors"))
    made_by = {"transformers": transformers.__version__, "torch": torch.__version__,
               "script": "scripts/make_image_references.py"}
    (out / "vl25_saved.json").write_text(json.dumps({"names": saved, "made_by": made_by}) + "\n")
    (out / "vl25.json").write_text(json.dumps({
        "text_config": VL25_TEXT, "vision_config": VL25_TOWER, "tokens": VL_TOKENS, "bounds": VL25_BOUNDS,
        "examples": examples, "config": config.to_dict(), "made_by": made_by}) + "\n")
    return {name: e["grids"] for name, e in examples.items()}


def scaled(model):
    """``model`` in eval mode with every parameter drawn from N(0, 0.3): a trained-looking scale (the defaults'
    0.02 leave every output near zero)."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    return model.eval()


def examples_logits(model, processor) -> tuple[dict, dict]:
    """(each of VL_EXAMPLES' logits alone under ``model``, and the example: its ids, images and grids)."""
    import torch

    drawn = images()
    grids = {name: processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
             for name, image in drawn.items()}
    logits, examples = {}, {}
    for name in VL_EXAMPLES:
        ids, names = vl_example(name, grids)
        inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([[
            int(i == VL_TOKENS["image_token_id"]) for i in ids]])}
        if names:
            batch = processor(images=[drawn[n] for n in names], return_tensors="pt")
            inputs.update(pixel_values=batch["pixel_values"].float(), image_grid_thw=batch["image_grid_thw"])
        with torch.no_grad():
            logits[name] = model(**inputs).logits[0].contiguous()
        examples[name] = {"ids": ids, "images": names, "grids": [grids[n] for n in names]}
    return logits, examples


def vl_example(name: str, grids: dict) -> tuple[list[int], list[str]]:
    """An example's ids (vision start, one image token per merged patch group, vision end around each image)
    and its images' names."""
    ids, names = [], []
    rng = _rng("vl/" + name)
    for part in VL_EXAMPLES[name]:
        if isinstance(part, int):
            ids += rng.integers(0, 100, part).tolist()
        else:
            t, h, w = grids[part]
            ids += [VL_TOKENS["vision_start_token_id"], *[VL_TOKENS["image_token_id"]] * (t * h * w // 4),
                    VL_TOKENS["vision_end_token_id"]]
            names.append(part)
    return ids, names


def vl_references(transformers, out: Path) -> dict:
    """The tiny Qwen3-VL's weights (vl.safetensors) and each example's logits alone (vl_logits.safetensors)."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(1)
    config = transformers.Qwen3VLConfig(text_config=VL_TEXT, vision_config={**TOWER, "out_hidden_size": 24},
                                        **VL_TOKENS)
    model = scaled(transformers.Qwen3VLForConditionalGeneration._from_config(config, attn_implementation="eager"))
    processor = Qwen2VLImageProcessorPil(**SETTINGS["qwen3_vl"], **TOWER_BOUNDS)
    logits, examples = examples_logits(model, processor)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "vl.safetensors"))
    save_file(logits, str(out / "vl_logits.safetensors"))
    (out / "vl.json").write_text(json.dumps({
        "text_config": VL_TEXT, "vision_config": {**TOWER, "out_hidden_size": 24}, "tokens": VL_TOKENS,
        "bounds": TOWER_BOUNDS, "examples": examples, "config": config.to_dict(),
        "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                    "script": "scripts/make_image_references.py"}}) + "\n")
    return {name: len(e["ids"]) for name, e in examples.items()}


def tower_references(transformers, out: Path) -> dict:
    """The tiny vision encoder's weights (tower.safetensors) and its outputs on TOWER_IMAGES (tower.json)."""
    import torch
    from safetensors.torch import save_file
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    config = transformers.Qwen3VLConfig(vision_config=TOWER).vision_config
    model = scaled(Qwen3VLVisionModel._from_config(config, attn_implementation="eager"))
    processor = Qwen2VLImageProcessorPil(**SETTINGS["qwen3_vl"], **TOWER_BOUNDS)
    drawn = images()
    batch = processor(images=[drawn[name] for name in TOWER_IMAGES], return_tensors="pt")
    with torch.no_grad():
        result = model(batch["pixel_values"].float(), grid_thw=batch["image_grid_thw"])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "tower.safetensors"))
    record = {"config": TOWER, "bounds": TOWER_BOUNDS, "images": list(TOWER_IMAGES),
              "grids": batch["image_grid_thw"].tolist(), "tokens": result.pooler_output.tolist(),
              "deepstack": [f.tolist() for f in result.deepstack_features],
              "made_by": {"transformers": transformers.__version__, "torch": torch.__version__,
                          "script": "scripts/make_image_references.py"}}
    (out / "tower.json").write_text(json.dumps(record) + "\n")
    return {"grids": record["grids"], "tokens": len(record["tokens"])}


def rope_references(transformers) -> dict:
    """get_rope_index's positions [3, n] for each of SEQUENCES, from Qwen2.5-VL's and Qwen3-VL's models."""
    import torch

    out = {"sequences": {k: [list(x) if isinstance(x, tuple) else x for x in v] for k, v in SEQUENCES.items()},
           "positions": {}, "made_by": {"transformers": transformers.__version__,
                                        "script": "scripts/make_image_references.py"}}
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16, "vocab_size": 64}
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 32,
              "spatial_merge_size": 2}
    models = {"qwen2_5_vl": transformers.Qwen2_5_VLModel(transformers.Qwen2_5_VLConfig(
                  text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
                  vision_config={**vision, "out_hidden_size": 32})),
              "qwen3_vl": transformers.Qwen3VLModel(transformers.Qwen3VLConfig(
                  text_config={**text, "head_dim": 16}, vision_config={**vision, "out_hidden_size": 32}))}
    for family, model in models.items():
        for name, parts in SEQUENCES.items():
            types, grids = [], []
            for part in parts:
                if isinstance(part, int):
                    types += [0] * part
                else:
                    grids.append(part)
                    types += [1] * (part[0] * part[1] * part[2] // 4)
            ids = torch.zeros((1, len(types)), dtype=torch.long)
            positions, _ = model.get_rope_index(ids, torch.tensor([types]),
                                                image_grid_thw=torch.tensor(grids) if grids else None)
            out["positions"][f"{family}/{name}"] = positions[:, 0].tolist()
    return out


if __name__ == "__main__":
    main()
