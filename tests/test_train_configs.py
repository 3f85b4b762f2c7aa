"""Every shipped config loads, and the GPT-2-small config really is GPT-2-small sized."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from flax import nnx

from seqjax.config import load_config
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
