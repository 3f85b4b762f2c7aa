"""Shared helpers for the image tests: the tiny Qwen3-VL and Qwen2.5-VL reference checkpoints (tests/data/vision/,
made by transformers from scripts/make_image_references.py) as a seqjax model, its examples as batches read them."""

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
SCRIPT = script_module("make_image_references")


class Reference:
    """One tiny reference checkpoint of tests/data/vision (``stem``.json, .safetensors, _logits.safetensors: a
    random VL model transformers built and ran on its examples) as seqjax reads it."""

    def __init__(self, stem: str, image_spec: ImageSpec):
        self.stem = stem
        self.record = json.loads((DATA / f"{stem}.json").read_text())
        self.logits_of = load_file(str(DATA / f"{stem}_logits.safetensors"))
        self.vl = vision_language_config(self.record["config"])
        b = self.record["bounds"]
        self.spec = dataclasses.replace(image_spec, merge_size=b["merge_size"], min_pixels=b["min_pixels"],
                                        max_pixels=b["max_pixels"])
        vision = self.vl.text.vision
        self.layout = ImageLayout(self.vl.image_token_id, vision.spatial_merge_size, vision.patch_dim)

    def tensors(self) -> dict[str, np.ndarray]:
        return load_file(str(DATA / f"{self.stem}.safetensors"))

    def model(self, **text) -> TransformerLM:
        """The checkpoint as a seqjax model; ``text``: language-model settings (lora, scan_layers, ...). Adapters
        start as build_model draws them (B = 0: the base's function)."""
        cfg = dataclasses.replace(self.vl.text, attention="xla", **text)
        graphdef, state = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)))
        tensors = self.tensors()
        params = vision_language_params(tensors.__getitem__, tensors, cfg, f"{self.stem}.safetensors")
        nnx.replace_by_pure_dict(state, blocks_layout(params, cfg.scan_layers))
        return nnx.merge(graphdef, state)

    def example(self, name: str) -> ImageExample:
        """An example as a batch reads it: its ids, every non-image target scored, its images' patches."""
        drawn, record = SCRIPT.images(), self.record["examples"][name]
        ids = np.asarray(record["ids"])
        pixels, grids = [], []
        for image in record["images"]:
            values, grid = pixel_values(drawn[image], self.spec)
            pixels.append(values)
            grids.append(tuple(grid))
        pixels = np.concatenate(pixels) if pixels else np.zeros((0, self.vl.text.vision.patch_dim), np.float32)
        return ImageExample(ids, (ids != self.vl.image_token_id).astype(np.float32), pixels, tuple(grids))

    def batch(self, rows: list[list[str]], width: int, patches_per_row: int) -> dict[str, np.ndarray]:
        """``rows``' examples packed in order, each row's images in its own patch stream."""
        examples = [self.example(name) for row in rows for name in row]
        row_of = np.asarray([r for r, row in enumerate(rows) for _ in row])
        return image_batch(examples, row_of, len(rows), width, patches_per_row, self.layout)

    def logits(self, model, rows: list[list[str]], width: int, patches_per_row: int) -> np.ndarray:
        """[B, width, V]: ``rows``' examples packed in order, each row's images in its own patch stream."""
        fields = {k: jnp.asarray(v) for k, v in self.batch(rows, width, patches_per_row).items()
                  if k not in ("targets", "weights")}
        return np.asarray(jax.jit(lambda m, f: m(f.pop("inputs"), **f))(model, fields))


QWEN3 = Reference("vl", QWEN3_VL)
QWEN2_5 = Reference("vl25", ImageSpec())  # (ImageSpec's defaults are Qwen2.5-VL's processor's)
REFERENCES = {"qwen3_vl": QWEN3, "qwen2_5_vl": QWEN2_5}
# the Qwen3-VL reference, which most image tests use
REFERENCE, LOGITS, VL, LAYOUT = QWEN3.record, QWEN3.logits_of, QWEN3.vl, QWEN3.layout
vl_model, example, batch, logits = QWEN3.model, QWEN3.example, QWEN3.batch, QWEN3.logits


def hub_name(name: str) -> str:
    """A transformers 5 tensor name as the Hub's Qwen2.5-VL checkpoints keep it."""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new):]
    return name


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


def write_hf_folder(out: Path, shards: int = 1, ref: Reference | None = None, hub_layout: bool = False) -> Path:
    """A reference checkpoint (Qwen3-VL's by default) as a Hugging Face folder a user would have: config.json, the
    weights (in ``shards`` files, with an index when more than one), tokenizer.json with the vision tokens and its
    tokenizer_config.json. The embedding and the head get rows for the tokenizer's ids beyond the reference's 128
    (drawn from a fixed seed), and config.json's token ids are the tokenizer's. ``hub_layout``: as the Hub's
    Qwen2.5-VL checkpoints are, the tensors under the older names (``visual.*``, ``model.layers.*``: what
    save_pretrained writes for it, vl25_saved.json) and the text model's fields flat in config.json, M-RoPE as
    ``rope_scaling`` of type mrope."""
    ref = ref or QWEN3
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = chat_tokenizer(out / "tokenizer.json")
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
    tensors = ref.tensors()
    rng = np.random.default_rng(0)
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        have = tensors[name]
        extra = (0.02 * rng.standard_normal((vocab - len(have), have.shape[1]))).astype(have.dtype)
        tensors[name] = np.concatenate([have, extra])
    config = json.loads(json.dumps(ref.record["config"]))
    config["text_config"]["vocab_size"] = vocab
    ids = Tokenizer.from_file(str(tokenizer))
    for key, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>")):
        config[key] = ids.token_to_id(token)
    config["architectures"] = [{"qwen3_vl": "Qwen3VLForConditionalGeneration",
                                "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[config["model_type"]]]
    if hub_layout:
        tensors = {hub_name(name): value for name, value in tensors.items()}
        text = config.pop("text_config")
        rope = text.pop("rope_parameters")
        config = {**text, **config, "rope_theta": rope.pop("rope_theta"), "rope_scaling": {**rope, "type": "mrope"}}
        config["rope_scaling"].pop("rope_type")
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


def tiny_overrides(ref: Reference | None = None) -> list[str]:
    """configs/qwen3_vl_lora.yaml's model section at the reference checkpoint's size (or
    configs/qwen2_5_vl_lora.yaml's at ``ref``'s)."""
    text = (ref or QWEN3).vl.text
    vision = text.vision
    model = {"d_model": text.d_model, "n_layers": text.n_layers, "n_heads": text.n_heads,
             "n_kv_heads": text.n_kv_heads, "head_dim": text.head_dim, "d_ff": text.d_ff, "vocab_size": "null",
             "rope_theta": text.rope_theta, "norm_eps": text.norm_eps, "mrope_section": json.dumps(text.mrope_section)}
    tower = {f.name: getattr(vision, f.name) for f in dataclasses.fields(vision)}
    for key in ("deepstack_visual_indexes", "fullatt_block_indexes"):
        tower[key] = json.dumps(tower[key])
    return [f"model.{k}={v}" for k, v in model.items()] + [f"model.vision.{k}={v}" for k, v in tower.items()]
