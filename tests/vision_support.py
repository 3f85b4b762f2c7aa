"""Shared helpers for the image tests: the tiny Qwen3-VL reference checkpoint (tests/data/vision/, made by
transformers from scripts/make_image_references.py) as a seqjax model, its examples as batches read them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from hf_support import script_module
from seqjax.data.image_rows import ImageExample, ImageLayout, image_batch
from seqjax.hf.vision import vision_language_config, vision_language_params
from seqjax.model.stacking import blocks_layout
from seqjax.model.transformer import TransformerLM, build_model
from seqjax.store.images import QWEN3_VL, ImageSpec, pixel_values

DATA = Path(__file__).parent / "data" / "vision"
REFERENCE = json.loads((DATA / "vl.json").read_text())
LOGITS = load_file(str(DATA / "vl_logits.safetensors"))
SCRIPT = script_module("make_image_references")
VL = vision_language_config(REFERENCE["config"])


def vl_model(**text) -> TransformerLM:
    """The reference checkpoint as a seqjax model; ``text``: language-model settings (lora, scan_layers, ...).
    Adapters start as build_model draws them (B = 0: the base's function)."""
    cfg = dataclasses.replace(VL.text, attention="xla", **text)
    graphdef, state = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)))
    tensors = load_file(str(DATA / "vl.safetensors"))
    params = vision_language_params(tensors.__getitem__, tensors, cfg, "vl.safetensors")
    nnx.replace_by_pure_dict(state, blocks_layout(params, cfg.scan_layers))
    return nnx.merge(graphdef, state)


def spec() -> ImageSpec:
    b = REFERENCE["bounds"]
    return ImageSpec(patch_size=QWEN3_VL.patch_size, merge_size=b["merge_size"], temporal_patch_size=2,
                     min_pixels=b["min_pixels"], max_pixels=b["max_pixels"], image_mean=QWEN3_VL.image_mean,
                     image_std=QWEN3_VL.image_std)


def example(name: str) -> ImageExample:
    """A reference example as a batch reads it: its ids, every non-image target scored, its images' patches."""
    drawn, record = SCRIPT.images(), REFERENCE["examples"][name]
    ids = np.asarray(record["ids"])
    pixels, grids = [], []
    for image in record["images"]:
        values, grid = pixel_values(drawn[image], spec())
        pixels.append(values)
        grids.append(tuple(grid))
    pixels = np.concatenate(pixels) if pixels else np.zeros((0, VL.text.vision.patch_dim), np.float32)
    return ImageExample(ids, (ids != VL.image_token_id).astype(np.float32), pixels, tuple(grids))


LAYOUT = ImageLayout(VL.image_token_id, VL.text.vision.spatial_merge_size, VL.text.vision.patch_dim)


def logits(model, rows: list[list[str]], width: int, patches_per_row: int) -> np.ndarray:
    """[B, width, V]: ``rows``' examples packed in order, each row's images in its own patch stream."""
    fields = {k: jnp.asarray(v) for k, v in batch(rows, width, patches_per_row).items()
              if k not in ("targets", "weights")}
    return np.asarray(jax.jit(lambda m, f: m(f.pop("inputs"), **f))(model, fields))


def batch(rows: list[list[str]], width: int, patches_per_row: int) -> dict[str, np.ndarray]:
    """``rows``' examples packed in order, each row's images in its own patch stream."""
    examples = [example(name) for row in rows for name in row]
    row_of = np.asarray([r for r, row in enumerate(rows) for _ in row])
    return image_batch(examples, row_of, len(rows), width, patches_per_row, LAYOUT)


CHAT = Path(__file__).parent / "data" / "chat" / "qwen3"


def trl_template(name: str) -> Path:
    found = importlib.util.find_spec("trl")  # the package's templates, without importing it
    path = Path(found.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja" if found else None
    if path is None or not path.is_file():
        pytest.skip("TRL's chat templates come with its package: scripts/setup.sh installs trl==1.16.0")
    return path
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def chat_tokenizer(path: Path) -> Path:
    """The chat tests' Qwen3 tokenizer with Qwen-VL's four vision tokens added, saved at ``path``."""
    tokenizer = Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    tokenizer.save(str(path))
    return path


def write_hf_folder(out: Path, shards: int = 1) -> Path:
    """The reference checkpoint as a Hugging Face Qwen3-VL folder a user would have: config.json, the weights (in
    ``shards`` files, with an index when more than one), tokenizer.json with the vision tokens and its
    tokenizer_config.json. The embedding and the head get rows for the tokenizer's ids beyond the reference's 128
    (drawn from a fixed seed), and config.json's token ids are the tokenizer's."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = chat_tokenizer(out / "tokenizer.json")
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    tensors = load_file(str(DATA / "vl.safetensors"))
    rng = np.random.default_rng(0)
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        have = tensors[name]
        extra = (0.02 * rng.standard_normal((vocab - len(have), have.shape[1]))).astype(have.dtype)
        tensors[name] = np.concatenate([have, extra])
    config = json.loads(json.dumps(REFERENCE["config"]))
    config["text_config"]["vocab_size"] = vocab
    ids = Tokenizer.from_file(str(tokenizer))
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>")):
        config[key] = ids.token_to_id(token)
    config["architectures"] = ["Qwen3VLForConditionalGeneration"]
    (out / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards] for i in range(shards)}
        for file, part in files.items():
            save_file({name: tensors[name] for name in part}, str(out / file))
        index = {"weight_map": {name: file for file, part in files.items() for name in part}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return out


PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "min_pixels": REFERENCE["bounds"]["min_pixels"],
             "max_pixels": REFERENCE["bounds"]["max_pixels"], "image_processor_type": "Qwen2VLImageProcessor"}
WORDS = "red blue green cat dog tree house sky sun moon big small round square".split()


def image_chats(root: Path, n: int, seed: int = 0) -> Path:
    """``n`` chats in ``root``/chats.jsonl as TRL writes them (image parts, an ``images`` column of paths relative
    to the file), one to two images of random sizes each (one in four text only), short random answers."""
    rng = np.random.default_rng(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        count = 0 if i % 4 == 3 else 1 + i % 2
        images = []
        for j in range(count):
            h, w = (int(x) for x in rng.integers(24, 130, 2))
            name = f"img/{i}_{j}.png"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
            images.append(name)
        words = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
        user = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"what is {words(2)}"}]
        answer = [{"type": "text", "text": words(int(rng.integers(3, 9)))}]
        records.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                        **({"images": images} if images else {})})
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "chats.jsonl"


def tiny_overrides() -> list[str]:
    """configs/qwen3_vl_lora.yaml's model section at the reference checkpoint's size."""
    text, vision = VL.text, VL.text.vision
    model = {"d_model": text.d_model, "n_layers": text.n_layers, "n_heads": text.n_heads,
             "n_kv_heads": text.n_kv_heads, "head_dim": text.head_dim, "d_ff": text.d_ff, "vocab_size": "null",
             "rope_theta": text.rope_theta, "norm_eps": text.norm_eps, "mrope_section": json.dumps(text.mrope_section)}
    tower = {f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)}
    tower["deepstack_visual_indexes"] = json.dumps(tower["deepstack_visual_indexes"])
    return [f"model.{k}={v}" for k, v in model.items()] + [f"model.vision.{k}={v}" for k, v in tower.items()]
