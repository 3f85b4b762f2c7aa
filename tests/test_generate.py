"""Generation: the KV-cache decode continues prompts exactly as full forward passes would, and stops at end-of-text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from seqjax.config.load import load_config
from seqjax.engine import generate
from seqjax.main.generate import read_prompts
from seqjax.model.sampling import SamplingConfig

VOCAB = 48
START = 0  # the token each prompt opens with (the end-of-text of a real tokenizer)


def tiny_model(vocab: int = VOCAB, seed: int = 5):
    from seqjax.model import build_model

    cfg = load_config(None, ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
                             "model.d_ff=32", "model.max_seq_len=32", "data.seq_len=16", "model.attention=xla",
                             "model.init_std=0.5"])
    return cfg, build_model(cfg, vocab_size=vocab, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model()[1]


PROMPTS = [[START, 5, 9, 2], [START], [START, 7, 7, 3, 11, 30, 4, 8]]


WIDTH = 16
forward = nnx.jit(lambda m, ids, pos, seg: m(ids, positions=pos, segment_ids=seg))


def greedy_by_full_forward(model, prompt: list[int], eot_id: int | None, max_new_tokens: int) -> list[int]:
    """The reference: re-run the whole sequence (no cache) for every new token and take the argmax."""
    width = WIDTH  # one padded shape for every prompt and step, so the forward pass compiles once
    seq = list(prompt)
    for _ in range(max_new_tokens):
        ids, seg = np.zeros((1, width), np.int32), np.zeros((1, width), np.int32)
        ids[0, : len(seq)], seg[0, : len(seq)] = seq, 1
        logits = forward(model, ids, np.arange(width, dtype=np.int32)[None], seg)
        token = int(np.argmax(np.asarray(logits)[0, len(seq) - 1]))
        if token == eot_id:
            break
        seq.append(token)
    return seq[len(prompt):]


@pytest.mark.slow  # (the full suite; the fast loop keeps test_engine's greedy test)
def test_kv_cache_greedy_equals_full_forward_passes_for_ragged_prompts(model):
    outputs = generate(model, PROMPTS, eot_id=None, max_new_tokens=8)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.tokens == greedy_by_full_forward(model, prompt, None, 8)


def test_stops_at_end_of_text_per_row(model):
    free = generate(model, PROMPTS, eot_id=None, max_new_tokens=8)
    eot = free[0].tokens[3]  # pretend the token row 0 generates fourth is end-of-text
    stopped = generate(model, PROMPTS, eot_id=eot, max_new_tokens=8)
    for before, after in zip(free, stopped):
        cut = before.tokens.index(eot) if eot in before.tokens else len(before.tokens)
        assert after.tokens == before.tokens[:cut]
        assert after.stopped == (eot in before.tokens)
    assert len(stopped[0].tokens) <= 3 and stopped[0].stopped


def test_top_p_towards_zero_is_greedy_and_sampling_is_seeded(model):
    greedy = generate(model, PROMPTS, eot_id=None, max_new_tokens=6)
    nucleus = generate(model, PROMPTS, eot_id=None, max_new_tokens=6,
                       sampling=SamplingConfig(temperature=1.0, top_p=1e-6), seed=3)
    assert [g.tokens for g in nucleus] == [g.tokens for g in greedy]
    hot = SamplingConfig(temperature=5.0)
    a = generate(model, PROMPTS, eot_id=None, max_new_tokens=6, sampling=hot, seed=1)
    b = generate(model, PROMPTS, eot_id=None, max_new_tokens=6, sampling=hot, seed=1)
    c = generate(model, PROMPTS, eot_id=None, max_new_tokens=6, sampling=hot, seed=2)
    assert [x.tokens for x in a] == [x.tokens for x in b] != [x.tokens for x in c]


def test_bad_requests_are_refused_before_decoding(model, tmp_path):
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, PROMPTS, eot_id=None, max_new_tokens=30)
    with pytest.raises(ValueError, match="--prompt"):
        read_prompts(None, None)
    with pytest.raises(ValueError, match="no such file"):
        read_prompts(None, str(tmp_path / "missing.txt"))
    path = tmp_path / "prompts.txt"
    path.write_text("The tower\n\n = Valkyria = \n")
    assert read_prompts("first", str(path)) == ["first", "The tower", " = Valkyria = "]


@pytest.mark.slow
def test_generate_cli_prints_json_last(wikitext_prepared, wikitext_config, tmp_path, monkeypatch, capsys):
    """The CLI wiring (checkpoint, the run's tokenizer, a batch from a file); the checkpoint loader is stood in for.
    --stream prints each continuation as one JSON line as it ends, before the summary."""
    from seqjax.main import generate as generate_cli

    vocab = wikitext_prepared.tokenizer.vocab_size
    _, lm = tiny_model(vocab)
    monkeypatch.setattr("seqjax.main.trained.load_for_inference", lambda path, overrides: (wikitext_config, lm))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The game\nIn 1998 ,\n")
    generate_cli.main(["--run", str(tmp_path), "--prompt", "", "--prompts", str(prompts), "--max-new-tokens", "5",
                       "--temperature", "0", "--num-return-sequences", "2", "--stream"])
    *streamed, result = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [s["prompt"] for s in result["samples"]] == ["", "", "The game", "The game", "In 1998 ,", "In 1998 ,"]
    assert all(s["new_tokens"] == 5 or s["stopped_at_eot"] for s in result["samples"])
    assert sorted(s["index"] for s in streamed) == list(range(6))
    for line in streamed:
        assert {k: line[k] for k in ("prompt", "completion", "new_tokens")} == {
            k: result["samples"][line["index"]][k] for k in ("prompt", "completion", "new_tokens")}


def test_a_prompt_too_long_is_blamed_on_the_prompt_and_too_many_new_tokens_on_that_flag(model):
    from seqjax.core.errors import UsageError

    with pytest.raises(UsageError, match=r"^prompt 0: 32 tokens .* model.max_seq_len=32 .* expected at most 31"):
        generate(model, [[START] * 32], eot_id=None, max_new_tokens=1)
    with pytest.raises(UsageError, match=r"^--max-new-tokens: got 30, expected at most 24: prompt \d takes 8 of "
                                         r"model.max_seq_len=32"):
        generate(model, PROMPTS, eot_id=None, max_new_tokens=30)


def test_the_generate_flags_take_dashes_and_their_old_underscore_spellings():
    from seqjax.main.generate import build_parser

    dashed = build_parser().parse_args(["--run", "r", "--max-new-tokens", "7", "--top-p", "0.5", "--top-k", "3"])
    old = build_parser().parse_args(["--run", "r", "--max_new_tokens", "7", "--top_p", "0.5", "--top_k", "3"])
    assert (dashed.max_new_tokens, dashed.top_p, dashed.top_k) == (old.max_new_tokens, old.top_p, old.top_k) \
        == (7, 0.5, 3)
