"""Packing image-and-text examples under two budgets, against lmms-engine's first-fit by text length and one
example per row, on the same synthetic image-chat set; and image preprocessing against transformers' processor.

    python scripts/bench_vision.py [--examples 4000] [--seq-len 4096] [--rows 8] [--hf-python PYTHON]

The set: text lengths log-normal (median ``--text-median`` tokens), 0 to 3 images an example of sizes drawn
uniformly in [160, 1600] pixels a side, each resized as Qwen3-VL's processor does (patch 16, merge 2, its pixel
bounds) and taking one token per merged group plus its vision start and end. Every method then needs static
shapes: ``rows`` x ``seq_len`` tokens and a patch budget a batch. The two-budget packer
(seqjax.data.image_rows) keeps every batch within ``--patch-budget`` (``two_budget``), or every row within its
share of it (``two_budget_per_row``: the layout batches are trained in) (default: the set's patches per token
times a batch's tokens, plus 10%); the others pack by tokens alone, so their budget has to be the most patches
any of their batches holds. Reported for each: batches, token padding, the patch budget it needs, patch padding
at that budget, batches over the two-budget packer's budget, and the packer's examples/s.

With ``--hf-python`` (a Python with transformers >= 5 and Pillow), preprocessing is timed on the same decoded
images: seqjax.store.images.pixel_values against transformers' Qwen2VLImageProcessorPil (Qwen3-VL's settings).

With ``--store N``, N image chats (JPEG files, sides in [64, 640]) are written to a temporary folder, prepared
into a token store and read for one epoch of batches: the process's resident memory (VmRSS) after the prepare,
after the first batch and every tenth of the epoch, against the bytes of the images the store holds, to show that
reading stays flat (the images are memory-mapped, each batch reads its rows' own).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SIDE = (160, 1600)
MEAN_STD = [0.5, 0.5, 0.5]


def draw_images(count: int, seed: int) -> list:
    """``count`` RGB images of random sizes (noise over a gradient), the same in any Python with Pillow."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        h, w = rng.integers(*SIDE, 2)
        pixels = 0.5 * rng.integers(0, 256, (h, w, 3)) + 0.5 * 255 * np.linspace(0, 1, w)[None, :, None]
        out.append(Image.fromarray(pixels.astype(np.uint8), "RGB"))
    return out


def hf_worker(count: int, seed: int) -> None:
    """(in the transformers Python) seconds to preprocess the images one at a time, as a collator does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = draw_images(count, seed)
    processor = Qwen2VLImageProcessorPil(patch_size=16, image_mean=MEAN_STD, image_std=MEAN_STD, merge_size=2,
                                         temporal_patch_size=2)
    processor(images=images[:2], return_tensors="np")
    start = time.perf_counter()
    patches = sum(int(processor(images=[image], return_tensors="np")["pixel_values"].shape[0]) for image in images)
    print(json.dumps({"seconds": time.perf_counter() - start, "patches": patches}))


def synthetic(args) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, patches) of each example."""
    from seqjax.store.images import QWEN3_VL, image_tokens, smart_resize

    rng = np.random.default_rng(args.seed)
    text = np.clip(rng.lognormal(np.log(args.text_median), 0.8, args.examples), 8, args.seq_len // 2).astype(int)
    tokens, patches = text.copy(), np.zeros(args.examples, np.int64)
    for i, n in enumerate(rng.choice([0, 1, 1, 1, 2, 3], args.examples)):
        for _ in range(n):
            h, w = smart_resize(*rng.integers(*SIDE, 2), QWEN3_VL)
            grid = (1, h // QWEN3_VL.patch_size, w // QWEN3_VL.patch_size)
            tokens[i] += image_tokens(grid, QWEN3_VL) + 2
            patches[i] += grid[1] * grid[2]
    keep = tokens <= args.seq_len  # (what data.overlong would drop)
    return tokens[keep], patches[keep]


def summary(name: str, tokens, patches, batch, args, budget: int | None, seconds: float) -> dict:
    n = int(batch.max()) + 1
    per_batch = np.bincount(batch, weights=patches, minlength=n)
    need = int(per_batch.max()) if budget is None else budget
    return {"method": name, "batches": n, "examples_per_batch": len(tokens) / n,
            "token_padding": 1 - tokens.sum() / (n * args.rows * args.seq_len), "patch_budget": need,
            "patch_padding": 1 - patches.sum() / (n * need),
            "batches_over_two_budget_patches": int((per_batch > args.patch_budget).sum()),
            "pack_seconds": seconds, "examples_per_s": len(tokens) / seconds if seconds else None}


def packing(args, tokens, patches) -> list[dict]:
    from seqjax.data.document_rows import fit
    from seqjax.data.image_rows import pack_two_budgets

    out = []
    start = time.perf_counter()
    batch, _ = pack_two_budgets(tokens, patches, args.rows, args.seq_len, args.patch_budget)
    out.append(summary("two_budget", tokens, patches, batch, args, args.patch_budget, time.perf_counter() - start))
    # the layout a batch is trained in (seqjax.data.image_rows.image_batch): each row its own patch stream of
    # patch_budget / rows, or the largest example's patches where that is more (a row must hold it); rows are
    # bins of both budgets (as many open as the batches' rows above), and consecutive rows make a batch
    per_row = max(args.patch_budget // args.rows, int(patches.max()))
    start = time.perf_counter()
    row, _ = pack_two_budgets(tokens, patches, 1, args.seq_len, per_row, open_batches=64 * args.rows)
    out.append(summary("two_budget_per_row", tokens, patches, row // args.rows, args, per_row * args.rows,
                       time.perf_counter() - start))
    start = time.perf_counter()
    # lmms-engine's packing: first fit by text length in the data's order, every row left open (its images
    # follow their text); seqjax's own first-fit packer computes exactly that
    batch = fit(tokens, args.seq_len, None, open_rows=len(tokens), best=False, decreasing=False)[0] // args.rows
    out.append(summary("lmms_first_fit", tokens, patches, batch, args, None, time.perf_counter() - start))
    batch = np.arange(len(tokens)) // args.rows
    out.append(summary("one_per_row", tokens, patches, batch, args, None, 0.0))  # (nothing to pack)
    return out


def preprocessing(args) -> dict:
    from seqjax.store.images import QWEN3_VL, pixel_values

    images = draw_images(args.images, args.seed)
    pixel_values(images[0], QWEN3_VL)
    start = time.perf_counter()
    patches = sum(len(pixel_values(image, QWEN3_VL)[0]) for image in images)
    ours = time.perf_counter() - start
    result = {"images": args.images, "seqjax_images_per_s": args.images / ours, "patches": patches}
    if args.hf_python:
        proc = subprocess.run([args.hf_python, __file__, "--hf-worker", "--images", str(args.images), "--seed",
                               str(args.seed)], capture_output=True, text=True, check=True)
        theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        result.update(transformers_images_per_s=args.images / theirs["seconds"], same_patches=theirs["patches"] ==
                      patches)
    return result


def resident_mb() -> dict[str, float]:
    """This process's resident memory, in MB: its own (RssAnon) and the file pages it maps (RssFile: the
    memory-mapped store, which the kernel may drop and read again)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            fields[key] = round(int(line.split()[1]) / 1024, 1)
    return {"anon_mb": fields.get("RssAnon"), "file_mb": fields.get("RssFile")}


def store_memory(args) -> dict:
    """Resident memory while one epoch of batches is read from a store of ``args.store`` image chats."""
    import importlib.util
    import tempfile

    from PIL import Image
    from tokenizers import AddedToken, Tokenizer

    from seqjax.config.load import load_config
    from seqjax.data.pipeline import build_pipeline
    from seqjax.data.plan import EpochPlanner
    from seqjax.store.build import prepare

    repo = Path(__file__).resolve().parents[1]
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "img").mkdir()
        tokenizer = Tokenizer.from_file(str(repo / "tests" / "data" / "chat" / "qwen3" / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in
                                      ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")])
        tokenizer.save(str(root / "tokenizer.json"))
        (root / "preprocessor_config.json").write_text(json.dumps({
            "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": MEAN_STD,
            "image_std": MEAN_STD, "min_pixels": 32 * 32, "max_pixels": 640 * 640}))
        with open(root / "chats.jsonl", "w") as f:
            for i in range(args.store):
                h, w = (int(x) for x in rng.integers(64, 641, 2))
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / f"{i}.jpg")
                f.write(json.dumps({"messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "a picture " * 8}]}],
                    "images": [f"img/{i}.jpg"]}) + "\n")
        template = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "chat_templates"
        specials = [t["content"] for t in json.loads((root / "tokenizer.json").read_text())["added_tokens"]]
        config = load_config(None, [
            "data.corpus=jsonl", "data.format=chat", f"data.train_files=[{root / 'chats.jsonl'}]",
            f"data.cache_dir={root / 'cache'}", f"data.chat_template={template / 'qwen3_vl_training.jinja'}",
            f"tokenizer.path={root / 'tokenizer.json'}", f"tokenizer.special_tokens={json.dumps(specials)}",
            "tokenizer.bos_token=null", f"data.image_processor={root}", "data.seq_len=2048", "data.batch_size=8",
            "data.patches_per_row=8192", "data.validation_split_percentage=0"])
        start = time.perf_counter()
        store = prepare(config, splits=("train",)).stores["train"]
        prepared_s = time.perf_counter() - start
        image_bytes = sum(len(pixels) for pixels in store.images.pixels)  # (each shard's memory map)
        planner = EpochPlanner(config, store)
        batches = sum(planner.window_batches(0, w) for w in range(len(planner.windows(0))))
        data = iter(build_pipeline(config, store))
        rss = [{"after": "prepare", **resident_mb()}]
        start = time.perf_counter()
        for k in range(batches):
            next(data)
            if k == 0 or (k + 1) % max(1, batches // 10) == 0:
                rss.append({"after": f"batch {k + 1}", **resident_mb()})
        seconds = time.perf_counter() - start
    return {"chats": args.store, "images_in_store_mb": image_bytes / 1e6, "batches": batches,
            "prepare_seconds": round(prepared_s, 1), "batches_per_s": round(batches / seconds, 2), "rss": rss}


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--text-median", type=int, default=300)
    p.add_argument("--patch-budget", type=int, default=None)
    p.add_argument("--images", type=int, default=40, help="images for the preprocessing timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-python", default=None)
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", type=int, default=0, help="also read one epoch from a store of this many image chats")
    args = p.parse_args()
    if args.hf_worker:
        hf_worker(args.images, args.seed)
        return {}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    tokens, patches = synthetic(args)
    if args.patch_budget is None:
        args.patch_budget = int(np.ceil(1.1 * patches.sum() / tokens.sum() * args.rows * args.seq_len / 4)) * 4
    out = {"bench": "vision", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "command": " ".join(["python scripts/bench_vision.py", *sys.argv[1:]]),
           "examples": len(tokens), "tokens": int(tokens.sum()), "patches": int(patches.sum()), "rows": args.rows,
           "seq_len": args.seq_len, "patch_budget": args.patch_budget, "packing": packing(args, tokens, patches),
           "preprocessing": preprocessing(args), **({"store": store_memory(args)} if args.store else {})}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
