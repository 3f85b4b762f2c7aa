"""configs/qwen3_vl_lora.yaml at reduced size, as a user runs it: a Hugging Face Qwen3-VL folder (the tiny reference
checkpoint whose logits test_vision_language.py checks against transformers, with a tokenizer and an image processor)
LoRA-fine-tuned on packed image-and-text chats from a JSONL file with image paths, with scan, remat, the chunked
loss, two micro-batches and validation on image chats. A run stopped by SIGTERM and resumed gives the uninterrupted
run's losses and adapters bit for bit; the adapters export as a PEFT folder for the VL model (the tensor names peft
gives Qwen3VLForConditionalGeneration's language model, test_vision_peft.py) or merged as a Qwen3-VL folder that
computes what the LoRA model does, and the eval command scores the split as training's validation does.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from seqjax.config.load import load_config
from seqjax.hf import folders, peft
from seqjax.weights.inference import load_for_inference
from test_train_support import train_losses
from vision_support import PROCESSOR, QWEN3, image_chats, trl_template, write_hf_folder

pytestmark = pytest.mark.slow  # (three short runs of a tiny VL model: about a minute of compiling)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3_vl_lora.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_run")
    folder = write_hf_folder(root / "Qwen3-VL-tiny")
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    # the model's own template, where Qwen3-VL's Hub folder keeps it: no generation blocks, so the run scores
    # the answers as its twin, seqjax's qwen3_vl template, marks them
    official = trl_template("qwen3_vl").read_text()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": official}))
    return root, folder, image_chats(root / "data", 24)


def config(world, run: str):
    root, folder, chats = world
    # (the config file and the folder's path alone: the folder's config.json decides the model, its own
    # preprocessor_config.json the image processor)
    return load_config(CONFIG, [
        f"run.dir={root / run}", f"train.init_from={folder}", f"data.train_files=[{chats}]",
        f"data.cache_dir={root / 'cache'}", "data.validation_split_percentage=25", "data.seq_len=160",
        "data.patches_per_row=128", "data.batch_size=4", "train.steps=4", "train.checkpoint_every=2",
        "train.eval_every=2", "train.eval_batches=1", "train.warmup_steps=1", "train.lr=1e-2",
        "model.lora.rank=4", "model.lora.alpha=8", "model.param_dtype=float32", "model.compute_dtype=float32",
        "model.attention=xla", "model.loss_chunk_tokens=64"])


def test_a_qwen3_vl_folder_fine_tunes_on_image_chats_resumes_exactly_exports_and_evaluates(world, tmp_path, capsys):
    from seqjax.main import eval as eval_cli
    from seqjax.main import export
    from seqjax.main import generate as generate_cli
    from seqjax.train.hooks import Hook
    from seqjax.train.loop import train
    from seqjax.train.signals import Interrupted

    root, folder, _ = world
    whole = train(config(world, "whole"))
    # SIGTERM after step 2 (a preemption): the run saves the step it is on and stops; the same command resumes it
    interrupt = Hook("preempt", lambda s: os.kill(os.getpid(), signal.SIGTERM), at_last=False,
                     when=lambda s: s.step == 2)
    with pytest.raises(Interrupted):
        train(config(world, "resumed"), hooks=[interrupt])
    assert max(train_losses(root / "resumed")) < 4
    resumed = train(config(world, "resumed"))
    losses = train_losses(root / "whole")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert train_losses(root / "resumed") == losses
    assert whole["val_loss"] == resumed["val_loss"] and math.isfinite(whole["val_loss"])

    exported = {}
    for run in ("whole", "resumed"):
        export.main(["--run", str(root / run), "--out", str(tmp_path / run)])
        exported[run] = load_file(str(tmp_path / run / peft.ADAPTER_WEIGHTS))
    assert exported["whole"].keys() == exported["resumed"].keys()
    for name, tensor in exported["whole"].items():
        np.testing.assert_array_equal(tensor, exported["resumed"][name], err_msg=name)
    n_layers = load_config(root / "whole" / "config.yaml").model.n_layers  # (the folder's, as the run saved it)
    assert len(exported["whole"]) == n_layers * 7 * 2
    assert all(n.startswith("base_model.model.model.language_model.layers.") for n in exported["whole"])
    assert max(np.abs(t).max() for n, t in exported["whole"].items() if "lora_B" in n) > 0  # trained off B = 0
    # --merge: the base with the adapters folded in, as a Qwen3-VL folder (its processor beside it) that reads back
    # as a model computing what the LoRA run's does
    export.main(["--run", str(root / "whole"), "--out", str(tmp_path / "merged"), "--merge"])
    assert (tmp_path / "merged" / "preprocessor_config.json").read_text() == (
        folder / "preprocessor_config.json").read_text()
    _, merged = folders.load(tmp_path / "merged", ["model.attention=xla"])
    _, lora = load_for_inference(root / "whole")
    rows = [["two_images", "text_only"], ["one_image"]]
    ours, theirs = QWEN3.logits(merged, rows, 40, 96), QWEN3.logits(lora, rows, 40, 96)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())
    base = QWEN3.logits(folders.load(folder, ["model.attention=xla"])[1], rows, 40, 96)
    assert np.abs(base - theirs).max() > 1e-3 * np.abs(theirs).max()  # (the adapters moved them)
    adapter = json.loads((tmp_path / "whole" / peft.ADAPTER_CONFIG).read_text())
    assert adapter["base_model_name_or_path"] == str(folder) and adapter["r"] == 4
    capsys.readouterr()

    assert eval_cli.main(["--run", str(root / "whole")]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["complete"] and scored["loss"] == pytest.approx(whole["val_loss"], rel=1e-6)

    # generate takes a chat with an image, as the data file gives it (its path relative to the file)
    chats = root / "data" / "chats.jsonl"
    first = json.loads(chats.read_text().splitlines()[0])
    prompt = tmp_path / "data" / "ask.jsonl"
    prompt.parent.mkdir()
    (prompt.parent / "img").symlink_to(root / "data" / "img")
    prompt.write_text(json.dumps({"messages": first["messages"][:1], "images": first["images"]}) + "\n")
    assert generate_cli.main(["--run", str(root / "whole"), "--chat", str(prompt), "--max-new-tokens", "4",
                              "--temperature", "0"]) == 0
    sample = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"][0]
    assert 0 < sample["new_tokens"] <= 4 and len(sample["token_ids"]) == sample["new_tokens"]
    with pytest.raises(SystemExit):
        generate_cli.main(["--run", str(root / "whole"), "--prompt", "a cat"])
    assert "expected --chat FILE.jsonl" in capsys.readouterr().err
