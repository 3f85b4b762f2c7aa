"""Greedy generation after a prompt with images equals transformers': the tiny reference Qwen3-VL
and Qwen2.5-VL (tests/data/vision) continue each reference example with the tokens
``generate(do_sample=False)`` gave (tests/data/vision/vl_greedy.json and vl25_greedy.json, made by
transformers from scripts/make_vl_references.py). The prompt's images go through the tower in the
prefill, DeepStack's features into the first layers, and every new token turns one position past the
largest of the prompt's 3-D positions on all three axes, through the KV cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from seqjax.data.image_rows import ImageExample, prompt_image_fields
from seqjax.engine import Engine, generate
from seqjax.model.sampling import SamplingConfig
from vision_support import DATA, REFERENCES

FAMILIES = sorted(REFERENCES)


def greedy(family: str) -> tuple[dict, dict]:
    """(transformers' new tokens, and the logits each was picked from) for the reference's
    examples."""
    stem = REFERENCES[family].stem
    return (json.loads((DATA / f"{stem}_greedy.json").read_text())["new_tokens"],
            load_file(str(DATA / f"{stem}_greedy_logits.safetensors")))


def prompt_batch(family: str, names: list[str]) -> tuple[list, dict]:
    """(the examples as prompts, their image fields, right-padded one a row)."""
    ref = REFERENCES[family]
    prompts = [ref.example(name) for name in names]
    rows = [ImageExample(np.append(p.ids, 0), np.zeros(len(p.ids) + 1, np.float32), p.pixels, p.grids)
            for p in prompts]
    return prompts, prompt_image_fields(rows, ref.layout)


# (the fast loop: the logits test below, which a wrong position fails and greedy tokens may not)
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("names", [["one_image"], ["two_images", "text_only"]], ids=["one", "two_rows"])
def test_greedy_tokens_after_a_prompt_with_images_equal_transformers(family, names):
    prompts, images = prompt_batch(family, names)
    out = generate(REFERENCES[family].model(), [p.ids.tolist() for p in prompts], eot_id=None, max_new_tokens=8,
                   images=images)
    assert [g.tokens for g in out] == [greedy(family)[0][name] for name in names]


@pytest.mark.slow  # (the fast loop keeps the VL models' logits against transformers: test_vision_language.py)
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_each_new_tokens_log_probability_equals_transformers_through_the_cache(family):
    """Every generation step's pick and its log-probability, the prefill's and the cached steps', are
    transformers' (its logits' log-softmax at its greedy token, to 1e-5 of the logits' scale): a new token
    at the wrong position would change them."""
    names = ["two_images", "one_image"]
    prompts, images = prompt_batch(family, names)
    tokens, step_logits = greedy(family)
    done = Engine(REFERENCES[family].model()).run(
        [p.ids.tolist() for p in prompts], max_new_tokens=8, stop_ids=[], sampling=SamplingConfig(temperature=0.0),
        key=jax.random.key(0), images=images)
    for row, name in enumerate(names):
        assert done[row].tokens == tokens[name]
        for step in range(8):
            theirs = np.asarray(step_logits[name][step], np.float64)
            logp = theirs - np.log(np.sum(np.exp(theirs - theirs.max()))) - theirs.max()
            assert abs(done[row].logprobs[step] - logp[tokens[name][step]]) <= 1e-5 * np.abs(theirs).max(), \
                (name, step)
