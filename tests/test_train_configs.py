"""Every shipped config loads, the GPT-2-small config really is GPT-2-small sized, and the quality recipe starts."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.model import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads(path):
    config = load_config(path)
    assert config.run.dir.startswith("runs/")


def test_gpt2_small_has_about_124m_parameters_at_seq_len_1024():
    config = load_config(CONFIGS[0].parent / "gpt2_small.yaml")
    assert config.data.seq_len == 1024
    shapes = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    assert 120e6 < params < 128e6


@pytest.mark.parametrize("name, published", [("qwen3_30b_a3b_lora", 30.5e9), ("gpt_oss_20b_lora", 20.9e9)])
def test_the_moe_configs_have_their_models_published_sizes(name, published):
    """Qwen3-30B-A3B's 30.5 B parameters and gpt-oss-20b's 20.9 B (their model cards), adapters left out."""
    config = load_config(CONFIGS[0].parent / f"{name}.yaml", ["model.lora.rank=0"])
    shapes = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    assert abs(params - published) < 0.01 * published, params


@pytest.mark.slow  # (fast loop: a few seconds of compiling; the full suite runs it)
def test_the_quality_recipe_starts_scaled_down_with_its_regularization_and_strategy(tiny_root, tmp_path):
    """Two steps of configs/wikitext2_quality.yaml on the tiny corpus: only the model and rows shrink."""
    from seqjax.train.loop import train
    from test_train_support import tiny_overrides

    recipe = CONFIGS[0].parent / "wikitext2_quality.yaml"
    keep = ("run.dir", "data.corpus", "data.train_files", "data.valid_files", "data.cache_dir", "tokenizer.vocab_size",
            "data.seq_len", "model.d_model", "model.n_layers", "model.n_heads", "model.d_ff")
    tiny = [o for o in tiny_overrides(tiny_root, tmp_path / "run") if o.split("=")[0] in keep]
    shrink = ["model.max_seq_len=32", "eval.context=32", "eval.stride=16", "eval.batch_size=8", "data.batch_size=8",
              "train.steps=2", "train.warmup_steps=1", "train.checkpoint_every=2", "train.eval_every=0"]
    config = load_config(recipe, tiny + shrink)
    assert (config.data.strategy, config.model.attention) == ("random_offset", "xla")
    assert min(config.model.dropout, config.model.token_dropout, config.model.attention_dropout) > 0
    summary = train(config)
    assert summary["steps"] == 2 and math.isfinite(summary["final_train_loss"])
    assert summary["val_word_perplexity"] > 1 and summary["eval"]["mode"] == "sliding"
