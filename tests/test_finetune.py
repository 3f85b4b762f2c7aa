"""train.init_from and the self-contained run folder: a fine-tune starts from the given weights, with their tokenizer.

The runs are subprocesses on the tiny JSONL corpus (test_train_support), so
they share its compiled-step cache with the other training tests.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from hf_support import write_llama_folder
from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from seqjax.data.pipeline import build_pipeline
from seqjax.hf import folders as hf
from seqjax.model.loss import lm_loss
from seqjax.store.build import prepare
from seqjax.train.loop import train
from seqjax.weights import init_from
from seqjax.weights.inference import load_for_inference
from test_train_support import REPO, assert_ok, cli_env, run_cli, tiny_overrides, train_losses

# The CLI in subprocesses, on a trained tiny run: the full suite runs these, the fast loop does not.
pytestmark = pytest.mark.slow

# The tiny HF Llama's shape, as model.* overrides (tiny_overrides' own model is also 32 wide, 2 layers, 4 heads).
LLAMA_MODEL = {"model.n_kv_heads": 2, "model.norm_eps": 1e-5, "model.max_seq_len": 128, "model.tie_embeddings": False}


@pytest.fixture(scope="module")
def llama(tiny_root, tmp_path_factory):
    return write_llama_folder(tmp_path_factory.mktemp("hf") / "llama")


def test_step_zero_loss_of_an_init_from_run_equals_the_imported_models_loss_on_that_batch(llama, tiny_root, tmp_path):
    run_dir = tmp_path / "ft"
    overrides = tiny_overrides(tiny_root, run_dir, **LLAMA_MODEL, **{"train.steps": 2, "train.warmup_steps": 0,
                                                                    "train.init_from": llama})
    assert_ok(run_cli(overrides))
    first_loss = train_losses(run_dir)[1]

    saved = load_config(run_dir / "config.yaml")
    assert saved.tokenizer.path == str(run_dir / "tokenizer.json")  # the source's tokenizer, kept by the run
    assert (run_dir / "tokenizer.json").read_bytes() == (llama / "tokenizer.json").read_bytes()
    assert saved.model.vocab_size == 300 and saved.train.init_from == str(llama)
    store = prepare(saved, splits=("train",)).stores["train"]
    batch = next(iter(build_pipeline(saved, store)))
    _, model = hf.load(llama, ["model.attention=xla"])
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    loss, _ = lm_loss(logits, batch["targets"], batch["weights"])
    assert first_loss == pytest.approx(float(loss), rel=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 0 and sorted(train_losses(run_dir)) == [1, 2]  # step and optimizer fresh


def test_the_folder_decides_the_model_and_a_command_line_key_that_contradicts_it_is_refused_before_any_work(
        llama, tiny_root, tmp_path):
    """train.init_from=<HF folder>: its config.json is the model, whatever shape a config file carries; a model key
    the command line sets that contradicts it is one line, before any tokenizing or run folder."""
    from seqjax.train.loop import _init_source

    cache = tmp_path / "cache"
    base = tiny_overrides(tiny_root, tmp_path / "run", **LLAMA_MODEL, **{"train.init_from": llama,
                                                                         "data.cache_dir": cache})
    file = tmp_path / "other_shape.yaml"  # a recipe written for another size of the family
    file.write_text("model:\n  d_model: 64\n  n_layers: 5\n  n_kv_heads: 4\n  vocab_size: 4096\n")
    config, _ = _init_source(load_config(file, [o for o in base if not o.startswith(("model.", "tokenizer."))]))
    assert (config.model.d_model, config.model.n_layers, config.model.n_kv_heads, config.model.vocab_size) == (
        32, 2, 2, 300)
    for override, folder_value in (("model.vocab_size=512", 300), ("model.n_kv_heads=4", 2),
                                   ("model.tie_embeddings=true", False)):
        with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: got .* on the command line, but "
                                              rf"train.init_from=.*llama has {folder_value}; leave it out"):
            train(load_config(None, base + [override]))
    with pytest.raises(ConfigError, match="tokenizer.path: got .* comes with its own tokenizer"):
        other = tmp_path / "other.json"
        other.write_text((llama / "tokenizer.json").read_text().replace("mat", "rug", 1))
        train(load_config(None, base + [f"tokenizer.path={other}"]))
    assert not cache.exists() and not (tmp_path / "run").exists()  # no tokenizing, no run folder


def test_init_from_a_seqjax_run_takes_its_weights_and_tokenizer(reference, tiny_root):
    source = init_from.read_source(str(tiny_root / "reference"))
    assert source.tokenizer["path"] == str(tiny_root / "reference" / "tokenizer.json")
    config = init_from.adopt(load_config(None, tiny_overrides(tiny_root, tiny_root / "unused")), source)
    params = init_from.load_params(source, "float32")
    _, trained = load_for_inference(tiny_root / "reference")
    assert config.model.vocab_size == trained.cfg.vocab_size
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(nnx.to_pure_dict(nnx.state(trained, nnx.Param)))):
        np.testing.assert_array_equal(got, want)
    wider = dataclasses.replace(config, model=dataclasses.replace(config.model, d_ff=96))
    assert init_from.adopt(wider, source).model.d_ff == 64  # the run's own config.yaml decides
    with pytest.raises(ConfigError, match=r"model.d_ff: got 96 on the command line, but train.init_from=.* has 64"):
        init_from.adopt(wider, source, {"model.d_ff"})


def test_a_copied_run_folder_evaluates_and_generates_without_the_corpus_or_cache(reference, tiny_root, tmp_path):
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(tiny_root / "reference", copy)
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    assert saved["tokenizer"]["path"].endswith("reference/tokenizer.json")  # the run's own copy
    gone = tmp_path / "no-cache"
    proc = subprocess.run(
        [sys.executable, "-m", "seqjax.generate", "--run", str(copy), "--prompt", "the cat", "--max-new-tokens", "4",
         f"data.cache_dir={gone}", "data.train_files=[/nonexistent/train.jsonl]"],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["samples"][0]["new_tokens"] > 0
    assert not gone.exists()


def test_init_from_on_a_run_dir_with_checkpoints_says_before_any_work_that_the_resume_wins(llama, tiny_root, tmp_path):
    run_dir = tmp_path / "ft"
    overrides = {**LLAMA_MODEL, "train.warmup_steps": 0, "train.init_from": llama, "train.checkpoint_every": 2}
    assert_ok(run_cli(tiny_overrides(tiny_root, run_dir, **overrides, **{"train.steps": 2})))
    again = run_cli(tiny_overrides(tiny_root, run_dir, **overrides, **{"train.steps": 4}))
    assert_ok(again)
    said = [line for line in again.stderr.splitlines() if "holds checkpoints" in line]
    assert said and "resumes from them and train.init_from=" in said[0] and "is not read" in said[0]
    assert "start fresh" not in again.stderr  # the contradiction of earlier releases
    assert json.loads(again.stdout.strip().splitlines()[-1])["resumed_from"] == 2
