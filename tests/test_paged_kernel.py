"""The Pallas paged decode kernel (seqjax.model.kernels.paged, ``engine.attention=pallas``): in Pallas's
interpreter on the CPU it computes what the XLA path computes (each row's pages gathered, contract 2's
page mask, the dense softmax) for any page size, page table, length, window, GQA group and head size,
idle rows give zeros, the sinks apply through its log-sum-exp; the engine samples the same tokens on it;
and it passes the Triton lowering for an H100 without a GPU."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqjax.engine.engine import decode_attention
from seqjax.engine.paged import _gather
from seqjax.model.attention import masked_attention, with_sinks
from seqjax.model.kernels.paged import paged_attention
from seqjax.model.mask import page_mask
from test_flash import h100_lowering


def xla_path(q, keys, values, table, lengths, window, sinks=None, layer=0):
    """The engine's XLA decode attention for one query a row at place lengths - 1 (0: an idle row), over layer
    ``layer``'s pages of the stacked pools [layers, pages, Hkv, page_size, D]."""
    capacity = table.shape[1] * keys.shape[3]
    real = (lengths > 0)[:, None]
    mask = page_mask((lengths - 1)[:, None], real, lengths, capacity, window)
    with jax.default_matmul_precision("highest"):
        return masked_attention(q[:, None], _gather(keys, layer, table), _gather(values, layer, table), mask,
                                scale=q.shape[-1] ** -0.5, sinks=sinks, heads_first=True)[:, 0]


ROWS, WIDTH, PAGES, KV_HEADS, LAYERS = 3, 6, 22, 2, 2


@st.composite
def tables(draw, page_size: int):
    """Each row's pages distinct and anywhere in the pool, its length anything up to its table's capacity (0:
    an idle slot), the table's tail past the length no page (the pool's size); a window or none; a layer of the
    stacked pools."""
    order = draw(st.permutations(range(PAGES)))
    table = np.asarray(order[:ROWS * WIDTH], np.int32).reshape(ROWS, WIDTH)
    lengths = np.asarray([draw(st.integers(0, WIDTH * page_size)) for _ in range(ROWS)], np.int32)
    for r, n in enumerate(lengths):
        table[r, -(-n // page_size):] = PAGES
    window = draw(st.one_of(st.none(), st.integers(1, 3 * page_size)))
    return table, lengths, window, draw(st.integers(0, LAYERS - 1)), draw(st.integers(0, 99))


# (page size, query heads a kv head, head_dim, pages a loop step): shapes compiled once each, the pages drawn
SHAPES = [(1, 1, 8, None), (4, 3, 16, 1), (16, 2, 32, None)]


@pytest.mark.parametrize("page_size, group, head_dim, per_block", SHAPES)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_the_kernel_computes_the_xla_paths_attention_over_any_pages(page_size, group, head_dim, per_block, data):
    table, lengths, window, layer, seed = data.draw(tables(page_size))
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(ROWS, KV_HEADS * group, head_dim)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(LAYERS, PAGES, KV_HEADS, page_size, head_dim)), jnp.float32)
                    for _ in "kv")
    table, lengths = jnp.asarray(table), jnp.asarray(lengths)
    sinks = jnp.asarray(rng.normal(size=(KV_HEADS * group,)), jnp.float32)
    window = None if window is None else jnp.int32(window)  # (traced, as a scanned model's decode step has it)
    out, want, sunk, want_sunk = kernel_and_xla(q, keys, values, table, lengths, window, jnp.int32(layer), sinks,
                                                per_block=per_block)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    idle = np.asarray(lengths) == 0
    assert not np.asarray(out)[idle].any()  # (an idle slot: zeros, as the XLA path gives)
    np.testing.assert_allclose(np.asarray(sunk), np.asarray(want_sunk), atol=2e-5, rtol=2e-5)


@functools.partial(jax.jit, static_argnames=("per_block", "interpret"))
def kernel_and_xla(q, keys, values, table, lengths, window, layer, sinks, *, per_block, interpret=True):
    """The kernel's attention (interpreted; compiled on a GPU with ``interpret=False``, tests/test_gpu.py) and the
    XLA path's on the same operands in float32, without and with sinks (one program a shape)."""
    out, lse = paged_attention(q, keys, values, table, lengths, scale=q.shape[-1] ** -0.5, window=window,
                               layer=layer, pages_per_block=per_block, interpret=interpret)
    sunk = with_sinks(out[:, None], lse[:, :, None], sinks)[:, 0]
    q, keys, values = (a.astype(jnp.float32) for a in (q, keys, values))
    return (out, xla_path(q, keys, values, table, lengths, window, layer=layer), sunk,
            xla_path(q, keys, values, table, lengths, window, sinks, layer))


@pytest.mark.slow  # (the full suite: the interpreted kernel inside the decode loop)
@pytest.mark.parametrize("layout", ["false", "true"], ids=["unrolled", "scanned"])
def test_the_engine_samples_the_same_tokens_on_the_kernel(layout):
    """A model with a sliding layer, attention sinks and GQA, 6 sequences through 3 slots on pages of 4: the
    same tokens and log-probabilities (float32 rounding) on the kernel as on the XLA path; scanned, the kernel
    reads a traced layer's pages out of the stacked pool under a traced window."""
    from seqjax.config.engine import EngineConfig
    from seqjax.engine import Engine
    from seqjax.model.sampling import SamplingConfig
    from test_engine import model_of, prompts_of

    model = model_of("model.sliding_window=4", "model.layer_types=[sliding,full]", "model.attention_sinks=true",
                     f"model.scan_layers={layout}")
    prompts = prompts_of([5, 9, 3])
    done = {}
    for name in ("xla", "pallas"):
        engine = Engine(model, EngineConfig(slots=3, page_size=4, attention=name))
        done[name] = engine.run(prompts, max_new_tokens=9, stop_ids=[], sampling=SamplingConfig(temperature=1.0),
                                key=jax.random.key(1), copies=2)
    assert [c.tokens for c in done["pallas"]] == [c.tokens for c in done["xla"]]
    np.testing.assert_allclose([x for c in done["pallas"] for x in c.logprobs],
                               [x for c in done["xla"] for x in c.logprobs], atol=2e-5)


def test_auto_is_the_kernel_on_a_gpu_and_the_xla_path_elsewhere_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr("seqjax.core.progress._SAID", set())  # (said once a process: say it here)
    backend = jax.default_backend()
    with caplog.at_level(logging.INFO):
        pick = decode_attention("auto")
    assert pick == ("pallas" if backend == "gpu" else "xla")
    assert f"engine.attention=auto: {pick} on {backend}" in caplog.text
    assert decode_attention("pallas") == "pallas" and decode_attention("xla") == "xla"


def test_the_kernel_lowers_to_triton_for_an_h100():
    """Without a GPU: a bfloat16 decode step of 64 rows, 4 query heads a kv head, head_dim 128, pages of 16, a
    traced window and a traced layer of 4 stacked pools (a scanned decode's) passes Pallas's Triton lowering (AOT,
    an abstract H100) as one kernel."""
    pool = jax.ShapeDtypeStruct((4, 1000, 8, 16, 128), jnp.bfloat16)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16), pool, pool, jax.ShapeDtypeStruct((64, 40), jnp.int32),
            jax.ShapeDtypeStruct((64,), jnp.int32), scalar, scalar)

    def step(q, keys, values, table, lengths, window, layer):
        return paged_attention(q, keys, values, table, lengths, scale=128**-0.5, window=window, layer=layer,
                               interpret=False)

    text = h100_lowering(step, *args)
    assert text.count("__gpu$xla.gpu.triton") == 1 and "seqjax_paged_decode" in text


@pytest.mark.parametrize("name", ["nope"])
def test_an_unknown_choice_is_refused_in_one_line(name):
    from seqjax.config.load import load_config
    from seqjax.core.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.attention"):
        load_config(None, [f"engine.attention={name}"])
