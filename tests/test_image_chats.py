"""Chats with images into the token store, equal to transformers' Qwen3-VL processor: for each chat the store
holds exactly the ids ``processor.apply_chat_template(chat, tokenize=True)`` gives (one image-pad token per merged
patch group), its images give the processor's pixel values and grids, and what is scored is the processor's
assistant mask without the image tokens. Images come as paths relative to the data file (TRL's ``images`` column
or a part's own ``image``), or as bytes in parquet; a missing or broken image is one line naming the record.

The reference is transformers itself (4.57, the test environment's: its Qwen3VLProcessor and the numpy image
processor), with TRL 1.16's Qwen3-VL templates, run live.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from tokenizers import AddedToken, Tokenizer

from seqjax.config.load import load_config
from seqjax.core.errors import ConfigError, CorpusError
from seqjax.data.pipeline import build_pipeline
from seqjax.data.plan import EpochPlanner
from seqjax.data.strategies import check_config
from seqjax.main import data as data_cli
from seqjax.store.build import prepare
from seqjax.store.image_chats import read_image_spec
from seqjax.store.images import rope_index
from seqjax.train.setup import objective_of
from vision_support import trl_template

CHAT = Path(__file__).parent / "data" / "chat" / "qwen3"
VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "min_pixels": 32 * 32 * 2, "max_pixels": 32 * 32 * 24,
             "image_processor_type": "Qwen2VLImageProcessor"}
# (an RGBA image is composited on white by transformers 5's processor, whose numbers seqjax's are (test_images.py);
# 4.57's, run here, drops the alpha instead: a grey one is the same in both)
SIZES = {"wide.png": (70, 130), "tall.png": (190, 45), "odd.png": (33, 47), "grey.png": (64, 64)}


def chats() -> list[dict]:
    """Four chats: TRL's images column, a part naming its own image, two images in one turn, text only."""
    def user(*parts):
        return {"role": "user", "content": list(parts)}

    def answer(text):
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    image, text = {"type": "image"}, lambda t: {"type": "text", "text": t}
    return [
        {"messages": [user(image, text("what is this")), answer("a wide picture")], "images": ["img/wide.png"]},
        {"messages": [user(text("and this"), {"type": "image", "image": "img/tall.png"}), answer("tall")]},
        {"messages": [user(image, image, text("compare")), answer("one is odd"), user(text("sure?")),
                      answer("yes")], "images": ["img/odd.png", "img/grey.png"]},
        {"messages": [user(text("no picture")), answer("fine")]},
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A data folder (chats.jsonl, img/), a tokenizer with Qwen-VL's special tokens and a preprocessor config."""
    root = tmp_path_factory.mktemp("image_chats")
    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in SIZES.items():
        shape = (h, w) if name.startswith("grey") else (h, w, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / "img" / name)
    tokenizer = Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in VISION])
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats()))
    return root


def config(folder: Path, tmp_path: Path, template: str = "qwen3_vl_training", *extra: str, files=None):
    specials = [t["content"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]]
    return load_config(None, [
        "data.corpus=jsonl", "data.format=chat", f"data.train_files=[{files or folder / 'chats.jsonl'}]",
        f"data.cache_dir={tmp_path / 'cache'}", f"data.chat_template={trl_template(template)}",
        f"tokenizer.path={folder / 'tokenizer.json'}", f"tokenizer.special_tokens={json.dumps(specials)}",
        "tokenizer.bos_token=null", f"data.image_processor={folder}", "data.seq_len=1024", "data.batch_size=2",
        "data.patches_per_row=256",
        *extra])


def transformers_processor(folder: Path, template: str):
    # (transformers takes seconds to import: only the tests that compare with it pay for it)
    from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor

    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    settings = {k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}

    class ImagesOnly(Qwen3VLProcessor):  # its video processor needs torchvision; no chat here has a video
        def check_argument_for_proper_class(self, name, argument):
            return None

    return ImagesOnly(image_processor=Qwen2VLImageProcessor(**settings), tokenizer=tokenizer,
                      video_processor=None, chat_template=trl_template(template).read_text())


def with_images(chat: dict, folder: Path) -> list[dict]:
    """The chat as transformers' processor takes it: each image part holding its PIL image."""
    given = iter(chat.get("images", []))
    messages = json.loads(json.dumps(chat["messages"]))
    for m in messages:
        for part in m["content"]:
            if part["type"] == "image":
                part["image"] = Image.open(folder / (part.get("image") or next(given)))
    return messages


def test_the_store_holds_each_chat_as_transformers_processor_gives_it(folder, tmp_path):
    store = prepare(config(folder, tmp_path), splits=("train",)).stores["train"]
    spec = read_image_spec(str(folder))
    processor = transformers_processor(folder, "qwen3_vl_training")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert store.num_docs == len(chats()) and store.images is not None
    for i, chat in enumerate(chats()):
        theirs = processor.apply_chat_template(with_images(chat, folder), tokenize=True, return_dict=True,
                                               return_tensors="np", return_assistant_tokens_mask=True)
        ids = store.doc_sequence(i)
        assert ids.tolist() == theirs["input_ids"][0].tolist(), f"chat {i}"
        pixels, grids = store.images.patches(i, spec)
        assert len(grids) == len(chat.get("images", [])) + sum(
            "image" in p for m in chat["messages"] for p in m["content"])
        if grids:
            assert [list(g) for g in grids] == theirs["image_grid_thw"].tolist()
            np.testing.assert_allclose(pixels, theirs["pixel_values"], rtol=0, atol=1e-6)
        # what is scored: the tokenizer's assistant mask (4.57's processor returns zeros for it with images),
        # each image token repeated as the processor repeats it, and never scored
        text = processor.tokenizer.apply_chat_template(chat["messages"], tokenize=True, return_dict=True,
                                                       return_assistant_tokens_mask=True,
                                                       chat_template=processor.chat_template)
        short = np.asarray(text["input_ids"])
        repeats = np.ones(len(short), np.int64)
        repeats[short == image_id] = [g[0] * g[1] * g[2] // 4 for g in theirs.get("image_grid_thw", [])]
        assert np.repeat(short, repeats).tolist() == ids.tolist()
        wanted = np.repeat(np.asarray(text["assistant_masks"], bool) & (short != image_id), repeats)
        wanted[0] = False  # the first token is never a target
        start = int(store.doc_offsets[i])
        np.testing.assert_array_equal(np.asarray(store.mask[start:start + len(ids)]) > 0, wanted)
        assert wanted.sum() > 0


def test_images_as_bytes_in_parquet_give_the_same_store(folder, tmp_path):
    """A Hugging Face dataset's layout: messages as nested structs (every part gets every key, null where it has
    none), images as {bytes, path} structs, in the column or in a part."""
    rows = []
    for chat in chats():
        messages = json.loads(json.dumps(chat["messages"]))
        for m in messages:
            for part in m["content"]:
                if "image" in part:
                    part["image"] = {"bytes": (folder / part["image"]).read_bytes(), "path": None}
        given = [{"bytes": (folder / path).read_bytes(), "path": None} for path in chat.get("images", [])]
        rows.append({"messages": messages, "images": given})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    ours = prepare(config(folder, tmp_path, "qwen3_vl_training", "data.corpus=parquet",
                          files=tmp_path / "chats.parquet"), splits=("train",)).stores["train"]
    jsonl = prepare(config(folder, tmp_path / "jsonl"), splits=("train",)).stores["train"]
    np.testing.assert_array_equal(np.asarray(ours.tokens), np.asarray(jsonl.tokens))
    np.testing.assert_array_equal(np.asarray(ours.mask), np.asarray(jsonl.mask))
    for i in range(len(rows)):
        for a, b in zip(ours.images.of(i), jsonl.images.of(i), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change, message", [
    (lambda c: c[0].update(images=["img/missing.png"]), r"chats.jsonl:1: image .*missing.png not found"),
    (lambda c: c[0].update(images=["img/wide.png", "img/tall.png"]), r"chats.jsonl:1: 2 images in 'images' for 1"),
    (lambda c: c[2].update(images=["img/odd.png"]), r"chats.jsonl:3: 2 image parts but 1 images"),
    (lambda c: c[3]["messages"][0]["content"].append({"type": "video"}), r"chats.jsonl:4: a video part"),
    (lambda c: c[0].update(images=["http://x/y.png"]), r"chats.jsonl:1: image 'http://x/y.png' is a URL"),
])
def test_a_bad_image_or_count_is_one_line_naming_the_record(folder, tmp_path, change, message):
    records = chats()
    change(records)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in records))
    (tmp_path / "img").symlink_to(folder / "img")
    with pytest.raises(CorpusError, match=message):
        prepare(config(folder, tmp_path, files=tmp_path / "chats.jsonl"), splits=("train",))
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("manifest.json"))


def test_a_truncated_image_and_a_chat_with_images_but_no_processor_are_one_line(folder, tmp_path):
    (tmp_path / "img").mkdir()
    for name in SIZES:
        (tmp_path / "img" / name).write_bytes((folder / "img" / name).read_bytes())
    broken = (folder / "img" / "wide.png").read_bytes()
    (tmp_path / "img" / "wide.png").write_bytes(broken[:len(broken) // 2])
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats()))
    with pytest.raises(CorpusError, match=r"chats.jsonl:1: image .*wide.png is unreadable or truncated"):
        prepare(config(folder, tmp_path, files=tmp_path / "chats.jsonl"), splits=("train",))
    with pytest.raises(CorpusError, match=r"chats.jsonl:1: a chat with 1 image parts, but data.image_processor is"):
        prepare(config(folder, tmp_path, "qwen3_vl_training", "data.image_processor=null",
                       files=tmp_path / "chats.jsonl"), splits=("train",))


def test_the_processor_settings_are_read_or_refused(folder, tmp_path):
    spec = read_image_spec(str(folder / "preprocessor_config.json"))
    assert (spec.patch_size, spec.merge_size, spec.max_pixels) == (16, 2, 32 * 32 * 24)
    (tmp_path / "p.json").write_text(json.dumps({**PROCESSOR, "do_normalize": False}))
    with pytest.raises(CorpusError, match="p.json: do_normalize is False; seqjax preprocesses images with "
                                          "do_normalize=True only"):
        read_image_spec(str(tmp_path / "p.json"))
    with pytest.raises(ConfigError, match="data.image_processor: .*nothing.json is not a readable JSON file"):
        read_image_spec(str(tmp_path / "nothing.json"))
    with pytest.raises(ConfigError, match="data.image_processor: got .* with data.format=text"):
        load_config(None, ["data.corpus=jsonl", "data.format=text", f"data.image_processor={folder}"])
    with pytest.raises(ConfigError, match="data.overlong: got 'truncate' with images; expected drop"):
        config(folder, tmp_path, "qwen3_vl_training", "data.overlong=truncate")
    with pytest.raises(ConfigError, match="data.patches_per_row: got 0 with data.image_processor set"):
        config(folder, tmp_path, "qwen3_vl_training", "data.patches_per_row=0")
    with pytest.raises(ConfigError, match="data.strategy: got pack/first_fit with images, expected pack with packer "
                                          "best_fit"):
        check_config(config(folder, tmp_path, "qwen3_vl_training", "data.packer=first_fit"))


def test_batches_from_the_store_hold_both_budgets_every_example_once_and_resume_exactly(folder, tmp_path):
    """Packed rows of a store of image chats: each row within data.seq_len tokens and data.patches_per_row
    patches; every example once an epoch with its own 3-D positions (counted from 0), its own patches in its
    row's stream, its image tokens pointing at them and never scored; a resumed iterator gives the same next
    batch."""
    records = [dict(chat, messages=chat["messages"] + [{"role": "user", "content": [{"type": "text", "text": t}]},
                                                        {"role": "assistant", "content": [{"type": "text",
                                                                                          "text": t[::-1]}]}])
               for t in ("one", "two", "three") for chat in chats()]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in records))
    (tmp_path / "img").symlink_to(folder / "img")
    cfg = config(folder, tmp_path, "qwen3_vl_training", "data.seq_len=128", "data.patches_per_row=128",
                 "data.batch_size=2", files=tmp_path / "chats.jsonl")
    store = prepare(cfg, splits=("train",)).stores["train"]
    spec = read_image_spec(str(folder))
    image_id = store.images.image_token_id
    sequences = {i: store.doc_sequence(i) for i in range(store.num_docs)}
    iterator = iter(build_pipeline(cfg, store))
    seen, states, batches = [], [], []
    for _ in range(EpochPlanner(cfg, store).plan(0).num_batches):  # one epoch
        states.append(iterator.get_state())
        batch = next(iterator)
        batches.append(batch)
        for r in range(batch["inputs"].shape[0]):
            assert (batch["patch_segment_ids"][r] > 0).sum() <= 128
            for s in sorted(set(batch["segment_ids"][r][batch["segment_ids"][r] > 0].tolist())):
                where = np.flatnonzero(batch["segment_ids"][r] == s)
                ids = np.r_[batch["inputs"][r, where], batch["targets"][r, where[-1]]]
                doc = next(i for i, seq in sequences.items() if np.array_equal(seq, ids))
                seen.append(doc)
                pixels, grids = store.images.patches(doc, spec)
                np.testing.assert_array_equal(batch["positions_3d"][r, where],
                                              rope_index(ids == image_id, list(grids), 2).T[:-1])
                index = batch["image_index"][r, where][ids[:-1] == image_id]
                assert (batch["weights"][r, where][ids[1:] == image_id] == 0).all()
                if len(index):  # consecutive merged groups of the row's stream: this example's patches
                    assert index.tolist() == list(range(index[0], index[0] + len(index)))
                    np.testing.assert_array_equal(batch["patches"][r, 4 * index[0]:4 * (index[-1] + 1)], pixels)
    assert sorted(seen) == list(range(store.num_docs))
    resumed = iter(build_pipeline(cfg, store))
    resumed.set_state(states[2])
    for key, value in next(resumed).items():
        np.testing.assert_array_equal(value, batches[2][key])


def test_max_segments_per_row_holds_for_chats_with_images_too(folder, tmp_path):
    """data.max_segments_per_row is a third budget of the two-budget fit: 1 gives one example a row (it gave 2)."""
    from seqjax.data.stats import epoch_stats

    (tmp_path / "img").symlink_to(folder / "img")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats() * 3))
    for cap in (None, 1, 2):
        cfg = config(folder, tmp_path, "qwen3_vl_training", "data.seq_len=256", "data.patches_per_row=512",
                     "data.batch_size=2", f"data.max_segments_per_row={'null' if cap is None else cap}",
                     files=tmp_path / "chats.jsonl")
        store = prepare(cfg, splits=("train",)).stores["train"]
        stats = epoch_stats(cfg, store)
        if cap is None:
            assert stats["segments_per_row_max"] > 2  # (room for more: the cap is what holds them back)
        else:
            assert stats["segments_per_row_max"] == cap


def test_a_batch_of_image_chats_reads_its_own_rows_images_only(folder, tmp_path, monkeypatch):
    """Reading batch k builds batch k's image fields alone (its rows' patches), never a group of batches at once:
    a batch's patches weigh far more than its tokens (scripts/bench_vision.py --store: resident memory stays flat as
    the corpus of images grows)."""
    from seqjax.data import epochs, image_rows

    records = [chat for _ in range(6) for chat in chats()]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in records))
    (tmp_path / "img").symlink_to(folder / "img")
    cfg = config(folder, tmp_path, "qwen3_vl_training", "data.seq_len=128", "data.patches_per_row=128",
                 "data.batch_size=2", files=tmp_path / "chats.jsonl")
    store = prepare(cfg, splits=("train",)).stores["train"]
    built, real = [], image_rows.stored_image_fields

    def counted(*args, **kwargs):
        built.append(args[5])  # n_rows
        return real(*args, **kwargs)

    monkeypatch.setattr(image_rows, "stored_image_fields", counted)
    planner = EpochPlanner(cfg, store)
    dataset = epochs.window_dataset(planner, 0, 0, 0, 1)
    assert len(dataset) > 2
    for k in (0, 1, len(dataset) - 1):
        assert dataset[k]["patches"].shape[0] == 2
    assert built == [2, 2, 2]  # one batch's rows each time


def test_an_image_changed_after_prepare_rebuilds_the_store_not_reuses_it(folder, tmp_path):
    """The data file names its images, so its own size and time do not cover them: a store records each image
    file it read and a reuse compares them; a changed one sets the shard aside (kept, in damaged/) and rebuilds."""
    (tmp_path / "img").mkdir()
    for name in SIZES:
        (tmp_path / "img" / name).write_bytes((folder / "img" / name).read_bytes())
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats()))
    cfg = config(folder, tmp_path, files=tmp_path / "chats.jsonl")
    spec = read_image_spec(str(folder))
    before = prepare(cfg, splits=("train",)).stores["train"].images.patches(0, spec)[0]
    again = prepare(cfg, splits=("train",)).stores["train"]  # unchanged: reused
    np.testing.assert_array_equal(again.images.patches(0, spec)[0], before)
    assert not list((tmp_path / "cache").rglob("damaged"))
    Image.fromarray(np.zeros((80, 120, 3), np.uint8)).save(tmp_path / "img" / "wide.png")  # other pixels, size
    after = prepare(cfg, splits=("train",)).stores["train"].images.patches(0, spec)[0]
    assert after.shape != before.shape or not np.array_equal(after, before)
    np.testing.assert_allclose(after, -1.0)  # black, normalized by mean 0.5 and std 0.5
    assert list((tmp_path / "cache").rglob("damaged"))  # the old shard is kept aside, not deleted


def test_the_data_report_dump_and_plot_show_both_budgets_and_the_model_commands_refuse_in_one_line(folder,
                                                                                               tmp_path, capsys):
    """``python -m seqjax.data``: the epoch's patch use beside its token padding, a dump with every image field,
    a plot whose title gives the patch budget's use; train and eval say in one line that they do not take
    images yet (no traceback mid-run)."""
    overrides = ["data.corpus=jsonl", "data.format=chat", f"data.train_files=[{folder / 'chats.jsonl'}]",
                 f"data.cache_dir={tmp_path / 'cache'}", f"data.chat_template={trl_template('qwen3_vl_training')}",
                 f"tokenizer.path={folder / 'tokenizer.json'}", "tokenizer.bos_token=null",
                 f"data.image_processor={folder}", "data.seq_len=128", "data.batch_size=2",
                 "data.patches_per_row=160"]
    cfg = config(folder, tmp_path, "qwen3_vl_training", "data.seq_len=128", "data.patches_per_row=160")
    specials = [f"tokenizer.special_tokens={json.dumps(cfg.tokenizer.special_tokens)}"]
    dump, plot = tmp_path / "batches.npz", tmp_path / "layout.png"
    data_cli.main([*overrides, *specials, "--dump", str(dump), "--plot", str(plot)])
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = read_image_spec(str(folder))
    store = prepare(cfg, splits=("train",)).stores["train"]
    total = int(store.images.patch_counts(spec.patch_size).sum())
    assert stats["real_patches"] == total and stats["patches_per_row"] == 160
    assert stats["patch_padding_fraction"] == pytest.approx(1 - total / (stats["rows"] * 160))
    arrays = np.load(dump)
    assert arrays["patches"].shape[2:] == (160, 3 * 2 * 16 * 16) and arrays["positions_3d"].shape[-1] == 3
    assert plot.stat().st_size > 0
    with pytest.raises(ConfigError, match="data.image_processor: got .* for a model without a vision tower"):
        objective_of(cfg)


def test_a_carved_validation_split_of_image_chats_is_the_same_wherever_the_folder_is(folder, tmp_path):
    """The carve hashes each record as read: moving the data folder (its images' base) moves no record between
    train and valid."""
    valid = []
    for where in ("a", "b/c"):
        root = tmp_path / where
        root.mkdir(parents=True)
        (root / "img").symlink_to(folder / "img")
        turn = [{"role": "user", "content": [{"type": "text", "text": "{i}"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
        records = [dict(c, messages=c["messages"] + json.loads(json.dumps(turn).replace("{i}", str(i))))
                   for i in range(10) for c in chats()]
        (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        cfg = config(folder, root, "qwen3_vl_training", "data.validation_split_percentage=40",
                     files=root / "chats.jsonl")
        stores = prepare(cfg, splits=("train", "valid")).stores
        valid.append([stores["valid"].doc_sequence(i).tolist() for i in range(stores["valid"].num_docs)])
        assert 0 < stores["valid"].num_docs < 40
    assert valid[0] == valid[1]
