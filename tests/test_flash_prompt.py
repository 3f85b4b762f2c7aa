"""The flash kernel under a shared prompt (contract 2's extension, ``prefix_ids``): rows laid out as GRPO's
``prompt_once`` and DPO's ``data.shared_prompt`` lay them, a prompt then the completions that continue it.

Each query block visits its own range and a second range over its prompt's key blocks, so the completions between a
prompt and a later completion of its group are never loaded. Checked here: the ranges cover every allowed pair once
and run unmasked only where every pair is allowed (hypothesis over drawn groups), the kernel's output and gradients
equal the dense mask's (which compares positions, as the contract says), and what it cannot honour is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.model.attention import masked_attention
from seqjax.model.kernels.block_ranges import BlockSizes, block_metadata
from seqjax.model.kernels.flash import flash_attention
from seqjax.model.mask import segment_mask
from test_flash import assert_close, between, lowered_for_h100, random_qkv

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
UNEVEN = BlockSizes(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)


def lay_out(groups, length: int):
    """(segment ids, prefix ids, positions) [length] of ``groups`` = [(prompt length, [completion lengths])]: each
    prompt then its completions, whose positions continue the prompt's; what does not fit is cut, the rest padding."""
    ids, prefix, positions = (np.zeros(length, np.int32) for _ in range(3))
    at, segment = 0, 1
    for prompt, completions in groups:
        for n, count in enumerate([prompt, *completions]):
            count = min(count, length - at)
            ids[at:at + count] = segment + n
            prefix[at:at + count] = segment if n else 0
            positions[at:at + count] = (prompt if n else 0) + np.arange(count)
            at += count
        segment += 1 + len(completions)
    return ids, prefix, positions


@st.composite
def prompt_rows(draw, batch: int, length: int):
    """Rows of drawn groups: short and long prompts, one to five completions, and a padding tail or none."""
    rows = []
    for _ in range(batch):
        groups = draw(st.lists(st.tuples(st.integers(1, 24), st.lists(st.integers(1, 40), min_size=1, max_size=5)),
                               min_size=1, max_size=4))
        rows.append(lay_out(groups, draw(st.sampled_from([length, length - draw(st.integers(1, length // 2))]))))
    return tuple(np.stack([np.pad(r[k], (0, length - len(r[k]))) for r in rows]) for k in range(3))


def dense_mask(ids, prefix, positions):
    return np.asarray(segment_mask(jnp.asarray(ids), q_index=jnp.asarray(positions), kv_index=jnp.asarray(positions),
                                   q_prefix_ids=jnp.asarray(prefix)))


def blocked(mask, rows: int, cols: int):
    b, t, _ = mask.shape
    tiles = mask.reshape(b, t // rows, rows, t // cols, cols)
    return tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))


@pytest.mark.slow  # (40 draws of the kernel's tile walk: the full suite)
@settings(max_examples=40, deadline=None)
@given(rows=prompt_rows(2, 96), blocks=st.sampled_from([SMALL, UNEVEN]))
def test_each_allowed_pair_is_visited_once_and_unmasked_tiles_are_full(rows, blocks):
    """Forward and dQ: the prompt range and the own range never share a tile, together they hold every tile with an
    allowed pair, and a tile run without a mask has every pair allowed; a block whose queries continue one prompt
    visits no tile of the prompt range without an allowed pair (the completions between are skipped). dK/dV: a
    prompt's key blocks reach the last query continuing it."""
    ids, prefix, positions = rows
    metadata = block_metadata(jnp.asarray(ids), blocks, prefix_ids=jnp.asarray(prefix))
    mask = dense_mask(ids, prefix, positions)
    for own, prompt, bq, bk in ((metadata.fwd_kv, metadata.fwd_prefix, blocks.block_q, blocks.block_k),
                                (metadata.dq_kv, metadata.dq_prefix, blocks.block_q_dq, blocks.block_k_dq)):
        own, prompt = np.asarray(own), np.asarray(prompt)
        needed, full = blocked(mask, bq, bk)
        n = needed.shape[-1]
        for ranges in (own, prompt):
            assert (np.diff(ranges, axis=-1) >= 0).all()
            assert not (between(ranges, 1, 2, n) & ~full).any(), "an unmasked tile has a masked pair"
        assert not (between(own, 0, 3, n) & between(prompt, 0, 3, n)).any(), "a tile visited twice"
        assert not (needed & ~(between(own, 0, 3, n) | between(prompt, 0, 3, n))).any(), "an allowed pair skipped"
        continued = prefix.reshape(len(prefix), -1, bq)
        one_prompt = np.array([[len(set(block[block != 0])) <= 1 for block in row] for row in continued])
        wasted = between(prompt, 0, 3, n) & ~needed
        assert not (wasted & one_prompt[..., None]).any(), "a completion between a prompt and its query was visited"
    needed, full = blocked(mask.transpose(0, 2, 1), blocks.block_k_bwd, blocks.block_q_bwd)
    dkv = np.asarray(metadata.dkv_q)
    assert not (needed & ~between(dkv, 0, 3, needed.shape[-1])).any(), "dK/dV skips an allowed pair"
    assert not (between(dkv, 1, 2, needed.shape[-1]) & ~full).any()


def test_a_later_completion_skips_the_completions_before_it():
    """A group of one prompt of 16 and four completions of 64, blocks of 16: the last completion's query blocks visit
    the prompt's one block and their own, not the 12 blocks of the three completions between (a single range from
    the prompt would visit them, masked)."""
    ids, prefix, _ = lay_out([(16, [64, 64, 64, 64])], 272)
    metadata = block_metadata(jnp.asarray(ids[None]), SMALL, prefix_ids=jnp.asarray(prefix[None]))
    own, prompt = np.asarray(metadata.fwd_kv)[0], np.asarray(metadata.fwd_prefix)[0]
    last = slice(13, 17)  # the query blocks of the fourth completion
    np.testing.assert_array_equal(prompt[last], [[0, 0, 1, 1]] * 4)  # the prompt's block, in full
    assert (own[last, 0] == 13).all()
    visited = (own[:, 3] - own[:, 0]) + (prompt[:, 3] - prompt[:, 0])
    # the prompt's own block; each completion's 4 query blocks: the prompt's block each, and their own triangle
    assert visited.sum() == 1 + 4 * (4 + (1 + 2 + 3 + 4)) == 57
    # one range from the prompt to each block's diagonal would visit the causal triangle
    start = np.where(prompt[:, 3] > prompt[:, 0], np.minimum(prompt[:, 0], own[:, 0]), own[:, 0])
    assert (own[:, 3] - start).sum() == 153


PROMPT_QKV = random_qkv((2, 96, 4, 16), kv_heads=2, dtype=jnp.float32, seed=11)


def _grads(attend, q, k, v, cotangent):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(cotangent)


@jax.jit
def _flash(q, k, v, ids, prefix, cotangent):
    return _grads(lambda q, k, v: flash_attention(q, k, v, ids, block_sizes=SMALL, prefix_ids=prefix), q, k, v,
                  cotangent)


@jax.jit
def _dense(q, k, v, ids, prefix, positions, cotangent):
    mask = segment_mask(ids, q_index=positions, kv_index=positions, q_prefix_ids=prefix)
    with jax.default_matmul_precision("highest"):
        return _grads(lambda q, k, v: masked_attention(q, k, v, mask), q, k, v, cotangent)


@settings(max_examples=8, deadline=None)
@given(rows=prompt_rows(2, 96))
def test_the_kernel_equals_the_dense_shared_prompt_mask(rows):
    """Output and dQ, dK, dV against the dense mask on the tokens' positions, float32 (exact in the interpreter), GQA;
    padding gets zeros."""
    ids, prefix, positions = (jnp.asarray(a) for a in rows)
    q, k, v, cotangent = PROMPT_QKV
    out, grads = _flash(q, k, v, ids, prefix, cotangent)
    ref_out, ref_grads = _dense(q, k, v, ids, prefix, positions, cotangent)
    for name, got, want in zip(("output", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert_close(got, want, 2e-5, name)
    assert not np.asarray(out)[np.asarray(ids) == 0].any()


def test_what_the_kernel_cannot_honour_is_refused():
    ids, prefix, _ = (jnp.asarray(a[None]) for a in lay_out([(8, [20, 12])], 48))
    q, k, v, _ = random_qkv((1, 48, 2, 16), kv_heads=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="a shared prompt .*with a window, causal=False or spans"):
        block_metadata(ids, SMALL, window=8, prefix_ids=prefix)
    with pytest.raises(ValueError, match="a shared prompt .*with a window, causal=False or spans"):
        block_metadata(ids, SMALL, queries=(0, 48), prefix_ids=prefix)
    with pytest.raises(ValueError, match=r"prefix_ids without metadata for them; expected block_metadata\(\.\.\., "):
        flash_attention(q, k, v, ids, metadata=block_metadata(ids, SMALL), prefix_ids=prefix)
    with pytest.raises(ValueError, match="metadata for a shared prompt, but no prefix_ids"):
        flash_attention(q, k, v, ids, metadata=block_metadata(ids, SMALL, prefix_ids=prefix))


@pytest.mark.slow  # (26 s of interpreter: the fast loop keeps the kernel's own tests above)
def test_a_model_on_pallas_takes_the_shared_prompt_as_xla_does():
    """model.attention=pallas with a batch's prefix_ids (GRPO's prompt_once rows): the model computes the shared
    prompt's ranges once a forward and every layer runs the flash kernel; logits and every parameter's gradient equal
    the dense mask's (xla). With a sliding window pallas refuses in one line; auto falls back to the dense mask."""
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.core.errors import ConfigError
    from seqjax.model import build_model

    ids, prefix, positions = (jnp.asarray(np.stack(a)) for a in zip(lay_out([(9, [30, 4, 21])], 64),
                                                                     lay_out([(20, [12, 25])], 64)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, ids.shape))

    def run(backend, *extra):
        config = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                                    "model.head_dim=16", "model.vocab_size=50", "model.max_seq_len=64",
                                    "data.seq_len=64", f"model.attention={backend}", *extra])
        graphdef, params, rest = nnx.split(build_model(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params):
            model = nnx.merge(graphdef, params, rest)
            logits = model(tokens, positions=positions, segment_ids=ids, prefix_ids=prefix)
            return (logits.astype(jnp.float32) ** 2).mean(), logits

        with jax.default_matmul_precision("highest"):
            return jax.value_and_grad(loss, has_aux=True)(params)

    (_, flash_logits), flash_grads = run("pallas")
    (_, dense_logits), dense_grads = run("xla")
    np.testing.assert_allclose(flash_logits, dense_logits, rtol=2e-5, atol=2e-5)
    for got, want in zip(jax.tree.leaves(flash_grads), jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    windowed = ("model.layer_types=[sliding,full]", "model.sliding_window=8")
    with pytest.raises(ConfigError, match="got 'pallas', which cannot honour a shared prompt's mask .*with a sliding"):
        run("pallas", *windowed)
    (_, auto_logits), _ = run("auto", *windowed)  # (on the CPU auto is xla; on a GPU, the dense mask too)
    assert np.isfinite(np.asarray(auto_logits)).all()


def test_the_shared_prompt_lowers_to_triton_for_h100():
    """Without a GPU: forward, dQ and dK/dV with the prompt's ranges and ids pass Pallas's Triton lowering for an
    H100 (AOT, abstract device), in bfloat16 at D = 128."""
    q = jax.ShapeDtypeStruct((1, 300, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 300), jnp.int32)

    def loss(q, k, v, s, prefix):
        return flash_attention(q, k, v, s, interpret=False, prefix_ids=prefix).astype(jnp.float32).sum()

    text = lowered_for_h100(loss, q, kv, kv, ids, ids)
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.slow  # (a subprocess: the CLI's counts; the fast loop keeps the ranges' own tests)
def test_bench_grpo_counts_each_layouts_flash_tiles():
    """``scripts/bench_grpo.py --tiles-only``: each layout's positions and the flash kernel's forward tiles a step,
    from the batches' own ids; prompt_once's second range visits fewer tiles than one range from the prompt."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "scripts/bench_grpo.py", "--tiles-only", "--shape", "toy", "--prompts", "3",
                           "--generations", "4", "--prompt-median", "40", "--completion-median", "60",
                           "--max-completion", "128", "--seq-len", "1024", "--batch", "1"],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    once = result["prompt_once"]
    assert 0 < once["flash_tiles_per_step"] < once["flash_tiles_one_range_per_step"]
    assert once["positions_computed_per_step"] < result["trl_layout"]["positions_computed_per_step"]
    assert all(result[layout]["flash_tiles_per_step"] > 0 for layout in ("prompt_per_completion", "padded"))
    assert "step_s" not in once and "sampling" not in result  # nothing timed
