"""Gated DeltaNet (seqjax.model.deltanet) over packed rows: equal to transformers 5.24's own torch path
(scripts/make_deltanet_references.py made tests/data/deltanet), and no state or convolution tap crossing
a segment: a packed row's outputs, final states and gradients are each document's alone, for any
packing, chunk size and document length (shorter than the convolution, starts on and off chunk
boundaries)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from seqjax.model.delta_rule import chunked_prompt_rule, chunked_rule, prompt_rule, recurrent_rule
from seqjax.model.deltanet import gated_deltanet

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "deltanet"
sys.path.insert(0, str(REPO / "scripts"))
from make_deltanet_references import weights  # noqa: E402  (the script's weights, drawn from their names)

META = json.loads((DATA / "deltanet.json").read_text())
REF = load_file(str(DATA / "deltanet.safetensors"))
ROW, KEY_HEADS, VALUE_HEADS, DIM = 48, 1, 2, 4


def close(actual, expected, tolerance=1e-5, whole=None):
    """Equal within ``tolerance`` of the largest magnitude of the expected array (or of ``whole``,
    the array it is a slice of), and of no less than 0.01 (float32 rounding: a gradient through the
    L2 norm is a difference of terms of order 1, so it rounds as they do however small it is)."""
    expected = np.asarray(expected)
    scale = max(float(np.abs(expected if whole is None else whole).max()), 1e-2)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=tolerance * scale)


def seqjax_params() -> dict:
    """The script's tensors in seqjax's layout: linears [in, out], the conv [C, K]."""
    out = {}
    for name, value in weights().items():
        key = name.removesuffix(".weight")
        out[key] = value.T if name.startswith(("in_proj", "out_proj")) else value
    out["conv1d"] = out["conv1d"][:, 0]
    return {k: jnp.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("form", ["chunk64", *(pytest.param(f, marks=pytest.mark.slow) for f in ("chunk16", "chunk5")),
                                  "recurrent"])
def test_the_rule_is_transformers_chunked_rule_in_output_and_final_state(form):
    """torch_chunk_gated_delta_rule (q/k L2-normed in the rule) on each document alone: a chunk
    crossing, a document shorter than the convolution; every chunk size and the recurrent form."""
    for doc, n in META["docs"].items():
        args = [jnp.asarray(REF[f"rule.{doc}.{k}"]) for k in ("q", "k", "v", "g", "beta")]
        seg = jnp.ones((1, n), jnp.int32)
        if form == "recurrent":
            out, state = jax.jit(recurrent_rule)(*args, seg)
        else:
            rule = jax.jit(chunked_rule, static_argnames="chunk")
            out, state = rule(*args, seg, chunk=int(form.removeprefix("chunk")))
        close(out, REF[f"rule.{doc}.out"])
        close(state, REF[f"rule.{doc}.state"])


@pytest.mark.slow  # (the full suite; the fast loop keeps the rule against transformers)
@pytest.mark.parametrize("chunk", [64, 16, 3])
def test_the_layer_is_transformers_alone_and_a_packed_row_is_each_document_alone(chunk):
    """The whole layer (projections, the causal conv, the rule, the gated norm): each document alone
    equals transformers', and the three packed into one row give the same, where transformers'
    own packed forward (no segment ids) carries state and conv taps across and moves outputs by
    more than 1."""
    params, docs = seqjax_params(), META["docs"]
    kwargs = dict(key_heads=META["key_heads"], value_heads=META["value_heads"], eps=META["eps"], chunk=chunk)
    alone = np.concatenate([REF[f"layer.{doc}"] for doc in docs], axis=1)
    for doc, n in docs.items():
        out, _ = gated_deltanet(params, jnp.asarray(REF[f"x.{doc}"]), jnp.ones((1, n), jnp.int32), **kwargs)
        close(out, REF[f"layer.{doc}"])
    x = jnp.concatenate([REF[f"x.{doc}"] for doc in docs], axis=1)
    seg = jnp.concatenate([jnp.full((1, n), i + 1, jnp.int32) for i, n in enumerate(docs.values())], axis=1)
    packed, _ = gated_deltanet(params, x, seg, **kwargs)
    close(packed, alone)
    assert np.abs(REF["layer.packed"] - alone).max() > 1.0  # transformers' packed row leaks


def oracle(q, k, v, g, beta):
    """The rule as its definition reads, token by token in float64, for one document alone [T, ...]."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    group = v.shape[1] // k.shape[1]
    q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    state = np.zeros((v.shape[1], k.shape[-1], v.shape[-1]))
    out = np.zeros(v.shape)
    for t in range(len(v)):
        state = state * np.exp(g[t])[:, None, None]
        seen = np.einsum("hkv,hk->hv", state, k[t])
        state = state + k[t][:, :, None] * ((v[t] - seen) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out, state


def draw_inputs(seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, ROW, KEY_HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((1, ROW, KEY_HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((1, ROW, VALUE_HEADS, DIM)).astype(np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((1, ROW, VALUE_HEADS)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((1, ROW, VALUE_HEADS))))).astype(np.float32)
    return [q, k, v, g, beta], rng.standard_normal((1, ROW, VALUE_HEADS, DIM)).astype(np.float32)


def row_of(lengths, gaps):
    """Segment ids [1, ROW]: documents 1..n with ``gaps`` padding tokens before each, the row's
    tail padding; and each document's (start, end)."""
    seg, spans, place = np.zeros((1, ROW), np.int32), [], 0
    for i, (n, gap) in enumerate(zip(lengths, gaps)):
        place += gap
        seg[0, place:place + n] = i + 1
        spans.append((place, place + n))
        place += n
    return seg, spans


@jax.jit(static_argnames=("chunk", "recurrent"))
def outputs_and_grads(args, seg, cotangent, *, chunk, recurrent=False):
    def run(*a):
        if recurrent:
            return recurrent_rule(*a, seg)
        return chunked_rule(*a, seg, chunk=chunk)

    (out, state), pull = jax.vjp(run, *args)
    return out, state, pull((cotangent, jnp.zeros_like(state)))


@jax.jit(static_argnames=("chunk",))
def states_at(args, seg, ends, *, chunk):
    """The chunked rule's state after each (row, place) of ``ends``: a packed prefill's documents'."""
    return chunked_rule(*args, seg, chunk=chunk, ends=ends)[1]


@pytest.mark.slow  # (the full suite; the fast loop keeps the rule against transformers)
@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 11), min_size=1, max_size=4),
       gaps=st.lists(st.integers(0, 2), min_size=4, max_size=4),
       chunk=st.sampled_from([1, 3, 4, 8, 16, 64]), seed=st.integers(0, 2**16))
@example(lengths=[8, 8, 3, 1], gaps=[0, 0, 0, 0], chunk=8, seed=0)  # starts on chunk boundaries
@example(lengths=[2, 3, 11, 11], gaps=[1, 0, 2, 0], chunk=4, seed=1)  # shorter than the conv, and off them
def test_a_packed_row_gives_each_document_its_own_outputs_state_and_gradients(lengths, gaps, chunk, seed):
    """Any packing: each document's outputs equal the rule run on it alone (the float64 oracle), the
    chunked form equals the recurrent one, and each document's gradients equal those of the same
    document alone in a row; the state a document leaves is its own final state alone, and so is the
    state the chunked rule keeps at each document's last token (``ends``: the engine's packed prefill)."""
    args, cotangent = draw_inputs(seed)
    seg, spans = row_of(lengths, gaps)
    out, state, grads = outputs_and_grads(args, seg, cotangent, chunk=chunk)
    kept = np.asarray(states_at(args, seg, jnp.asarray([[0, end - 1] for _, end in spans], jnp.int32), chunk=chunk))
    rec_out, rec_state, rec_grads = outputs_and_grads(args, seg, cotangent, chunk=chunk, recurrent=True)
    close(out, rec_out)
    close(state, rec_state)
    for a, b in zip(grads, rec_grads):
        close(a, b)
    assert not np.asarray(out)[0][seg[0] == 0].any()  # padding reads nothing
    for i, (start, end) in enumerate(spans):
        expected, final = oracle(*(a[0, start:end] for a in args))
        close(np.asarray(out)[0, start:end], expected, whole=out)
        alone = np.where(seg == i + 1, i + 1, 0).astype(np.int32)
        _, _, alone_grads = outputs_and_grads(args, alone, cotangent, chunk=chunk)
        for a, b in zip(grads, alone_grads):
            # (to the scale of the row's gradient: a document's own may be exactly 0, e.g. a one-token
            # document's decay, which multiplies a state of zeros)
            close(np.asarray(a)[0, start:end], np.asarray(b)[0, start:end], whole=a)
        # the state a document leaves: the row's, ended at its last token
        ended = np.where(np.arange(ROW) < end, seg, seg[0, start]).astype(np.int32)
        ended_args = [np.where((np.arange(ROW) < end).reshape((1, ROW) + (1,) * (a.ndim - 2)), a, 0) for a in args]
        _, left, _ = outputs_and_grads(ended_args, ended, cotangent, chunk=chunk)
        close(np.asarray(left)[0], final)
        close(kept[i], final)


@pytest.mark.slow  # (the full suite; the fast loop keeps the rule against transformers)
@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(1, 11), min_size=2, max_size=4), chunk=st.sampled_from([3, 8, 64]),
       seed=st.integers(0, 2**16), data=st.data())
def test_changing_one_documents_tokens_changes_no_other_documents_outputs_or_gradients(lengths, chunk, seed,
                                                                                      data):
    """A document's inputs redrawn: its outputs change; every other document's outputs and
    gradients do not."""
    args, cotangent = draw_inputs(seed)
    seg, spans = row_of(lengths, [0] * len(lengths))
    changed = data.draw(st.integers(0, len(lengths) - 1))
    start, end = spans[changed]
    other = [np.array(a) for a in draw_inputs(seed + 1)[0]]
    moved = []
    for a, b in zip(args, other):
        c = np.array(a)
        c[0, start:end] = b[0, start:end]
        moved.append(c)
    out, _, grads = outputs_and_grads(args, seg, cotangent, chunk=chunk)
    out2, _, grads2 = outputs_and_grads(moved, seg, cotangent, chunk=chunk)
    keep = seg[0] != changed + 1
    assert not np.array_equal(np.asarray(out)[0, start:end], np.asarray(out2)[0, start:end])
    # the other documents' outputs and gradients: the same to float32 rounding, 1e-5 of scale as above
    # (a leak moves them by the inputs' own size; the backward's triangular solves round a few last
    # bits differently: up to 1.1e-6 of scale was seen)
    close(np.asarray(out2)[0][keep], np.asarray(out)[0][keep], whole=out)
    for a, b in zip(grads, grads2):
        close(np.asarray(b)[0][keep], np.asarray(a)[0][keep], whole=a)


LINEAR_MODEL = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
                "model.vocab_size=64", "model.max_seq_len=64", "data.seq_len=64", "model.attention=xla",
                "model.layer_types=[linear,full,linear]", "model.deltanet.key_heads=2",
                "model.deltanet.value_heads=4", "model.deltanet.key_dim=8", "model.deltanet.value_dim=8",
                "model.deltanet.chunk=8"]


@pytest.mark.slow
def test_a_model_with_linear_layers_gives_each_packed_document_its_own_logits_and_gradients():
    """model.layer_types places a Gated DeltaNet where it says linear (the block's mixer row): a packed
    row of three documents (one shorter than the convolution, one across chunks) and padding gives
    each document's logits and input-embedding gradients alone. The engine refuses a model with no
    attention layer to page, and a family whose checkpoints hold no such layer (Llama's) refuses to
    export it, each in one line."""
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.core.errors import UsageError
    from seqjax.engine import Engine
    from seqjax.model import build_model
    from seqjax.model.deltanet import DeltaNet

    model = build_model(load_config(None, LINEAR_MODEL), rngs=nnx.Rngs(0))
    assert [type(model.layer(i).attn).__name__ for i in range(3)] == ["DeltaNet", "Attention", "DeltaNet"]
    assert isinstance(model.layer(0).attn, DeltaNet)
    rng = np.random.default_rng(0)
    lengths, width = [13, 2, 20], 40
    docs = [rng.integers(1, 64, n).astype(np.int32) for n in lengths]
    inputs = np.zeros((1, width), np.int32)
    positions, seg = np.zeros_like(inputs), np.zeros_like(inputs)
    place = 0
    for i, doc in enumerate(docs):
        inputs[0, place:place + len(doc)], seg[0, place:place + len(doc)] = doc, i + 1
        positions[0, place:place + len(doc)] = np.arange(len(doc))
        place += len(doc)

    @jax.jit
    def run(embeddings, pos, s):
        def total(embeddings):
            out = model.from_embeddings(embeddings, positions=pos, segment_ids=s)
            return jnp.sum(jnp.where(s[..., None] > 0, out, 0.0) ** 2), out

        return jax.value_and_grad(total, has_aux=True)(embeddings)

    def logits_and_grad(ids, pos, s):
        (_, out), grad = run(model.embed_tokens(jnp.asarray(ids)), jnp.asarray(pos), jnp.asarray(s))
        return np.asarray(out), np.asarray(grad)

    packed, packed_grad = logits_and_grad(inputs, positions, seg)
    place = 0
    for doc in docs:
        n = len(doc)
        alone, alone_grad = logits_and_grad(doc[None], np.arange(n)[None], np.ones((1, n), np.int32))
        close(packed[0, place:place + n], alone[0])
        close(packed_grad[0, place:place + n], alone_grad[0])
        place += n
    only_linear = build_model(load_config(None, [*LINEAR_MODEL, "model.layer_types=[linear,linear,linear]"]),
                              rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match="every layer is linear .* expected at least one full or sliding layer"):
        Engine(only_linear)
    from seqjax.core.errors import CheckpointError
    from seqjax.hf.families import hf_config

    with pytest.raises(CheckpointError, match="model.layer_types: got .*linear"):
        hf_config(model.cfg, bos_token_id=1, eos_token_id=0, dtype="float32")


SHARED_WIDTH, ALONE_WIDTH = 48, 24


@functools.lru_cache(maxsize=None)
def _shared_model():
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.model import build_model

    return build_model(load_config(None, LINEAR_MODEL), rngs=nnx.Rngs(1))


@jax.jit
def _completion_outputs_and_grads(graphdef, state, ids, positions, segment_ids, prefix_ids, scored):
    """(the blocks' outputs [B, T, D], d sum(outputs^2 over ``scored``) / d embeddings)."""
    from flax import nnx

    model = nnx.merge(graphdef, state)

    def total(embeddings):
        out = model.hidden(embeddings, positions=positions, segment_ids=segment_ids, prefix_ids=prefix_ids)
        return jnp.sum(jnp.where(scored[..., None], out, 0.0) ** 2), out

    (_, out), grad = jax.value_and_grad(total, has_aux=True)(model.embed_tokens(ids))
    return out, grad


@pytest.mark.slow  # (hypothesis over a model's forward and backward: the full suite)
@settings(max_examples=6, deadline=None)
@given(prompt=st.lists(st.integers(1, 63), min_size=2, max_size=9),
       completions=st.lists(st.lists(st.integers(1, 63), min_size=1, max_size=8), min_size=1, max_size=3))
def test_a_shared_prompt_continues_into_each_completion_as_one_sequence_per_completion(prompt, completions):
    """The shared-prompt layout (data.shared_prompt, rl.layout=prompt_once): the prompt's first n - 1 ids once,
    then each completion as a segment starting at the prompt's last id, continuing its positions. Through
    Gated DeltaNet layers (and attention) each completion's outputs and input gradients equal those of its own
    sequence (prompt + completion) alone, and the prompt's gradient is the sum of theirs: each completion
    starts from the prompt's final state and convolution tail, never from another completion's. Prompts and
    completions shorter than the convolution are drawn too."""
    from flax import nnx

    graphdef, state = nnx.split(_shared_model())
    n = len(prompt)
    ids, pos, seg, prefix = (np.zeros((1, SHARED_WIDTH), np.int32) for _ in range(4))
    ids[0, :n - 1], pos[0, :n - 1], seg[0, :n - 1] = prompt[:-1], np.arange(n - 1), 1
    place, spans = n - 1, []
    for i, completion in enumerate(completions):
        piece = [prompt[-1], *completion]
        end = place + len(piece)
        ids[0, place:end], pos[0, place:end] = piece, np.arange(n - 1, n - 1 + len(piece))
        seg[0, place:end], prefix[0, place:end] = i + 2, 1
        spans.append((place, end))
        place = end
    out, grad = (np.asarray(a)[0] for a in _completion_outputs_and_grads(
        graphdef, state, *map(jnp.asarray, (ids, pos, seg, prefix, prefix > 0))))
    prompt_grad = np.zeros_like(grad[:n - 1])
    for (start, end), completion in zip(spans, completions):
        sequence = [*prompt, *completion]
        alone = [np.zeros((1, ALONE_WIDTH), np.int32) for _ in range(3)]
        alone[0][0, :len(sequence)], alone[1][0, :len(sequence)] = sequence, np.arange(len(sequence))
        alone[2][0, :len(sequence)] = 1
        scored = (np.arange(ALONE_WIDTH) >= n - 1) & (np.arange(ALONE_WIDTH) < len(sequence))
        a_out, a_grad = (np.asarray(a)[0] for a in _completion_outputs_and_grads(
            graphdef, state, *map(jnp.asarray, (*alone, np.zeros_like(alone[0]))), jnp.asarray(scored[None])))
        close(out[start:end], a_out[n - 1:len(sequence)])
        close(grad[start:end], a_grad[n - 1:len(sequence)])
        prompt_grad += a_grad[:n - 1]
    close(grad[:n - 1], prompt_grad)


def shared_row(items, gaps):
    """Segment and prefix ids [1, ROW] of a row with shared prompts: each item a group (prompt length,
    [completion lengths]), its completions' prefix ids naming its prompt, or a plain document (length,
    []), ``gaps`` padding tokens before each item; None if they do not fit."""
    seg, prefix, place, number = np.zeros((1, ROW), np.int32), np.zeros((1, ROW), np.int32), 0, 0
    for (n, completions), gap in zip(items, gaps):
        place += gap
        number += 1
        prompt = number
        for i, length in enumerate([n, *completions]):
            if place + length > ROW:
                return None
            number += i > 0
            seg[0, place:place + length] = number
            prefix[0, place:place + length] = prompt if i > 0 else 0
            place += length
    return seg, prefix


@jax.jit(static_argnames=("chunk",))
def prompt_outputs_and_grads(args, seg, prefix, cotangents, *, chunk):
    """(out, state, input gradients) of the token-by-token definition (chunk 0) or the chunked form."""
    def run(*a):
        return prompt_rule(*a, seg, prefix) if chunk == 0 else chunked_prompt_rule(*a, seg, prefix, chunk=chunk)

    (out, state), pull = jax.vjp(run, *args)
    return out, state, pull(cotangents)


def check_prompt_rule(row, chunk, seed):
    args, cotangent = draw_inputs(seed)
    state_cotangent = np.random.default_rng(seed + 1).standard_normal((1, VALUE_HEADS, DIM, DIM)).astype(np.float32)
    ours = prompt_outputs_and_grads(args, *row, (cotangent, state_cotangent), chunk=chunk)
    theirs = prompt_outputs_and_grads(args, *row, (cotangent, state_cotangent), chunk=0)
    close(ours[0], theirs[0])
    close(ours[1], theirs[1])
    for a, b in zip(ours[2], theirs[2]):
        close(a, b)


GROUP = st.tuples(st.integers(1, 7), st.lists(st.integers(1, 6), min_size=0, max_size=3))


def test_the_chunked_shared_prompt_rule_is_the_token_by_token_one():
    """Two groups whose prompts end inside one chunk of 4 (and a completion entering at a chunk's
    first token), a plain document, padding: the chunked form's outputs, final state and gradients
    are the register's, token by token."""
    row = shared_row([(5, [3, 1, 4]), (1, [2, 2]), (3, []), (2, [6])], [0, 0, 1, 0])
    assert row is not None
    check_prompt_rule(row, 4, 0)


@pytest.mark.slow  # (the full suite; the fast loop keeps the case above)
@settings(max_examples=20, deadline=None)
@given(items=st.lists(GROUP, min_size=1, max_size=4), gaps=st.lists(st.integers(0, 2), min_size=4, max_size=4),
       chunk=st.sampled_from([1, 2, 3, 5, 8, 64]), seed=st.integers(0, 2**16))
def test_the_chunked_shared_prompt_rule_is_the_token_by_token_one_for_any_row(items, gaps, chunk, seed):
    """Any row of groups (prompts and completions shorter or longer than a chunk, several prompts
    ending in one chunk, completions entering on and off chunk boundaries), plain documents and
    padding: :func:`chunked_prompt_rule` equals :func:`prompt_rule` in outputs, the row's final
    state and every input's gradient (a completion starting from zero, or from the carried state,
    fails it)."""
    row = shared_row(items, gaps)
    assume(row is not None)
    check_prompt_rule(row, chunk, seed)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12).flatmap(lambda width: st.lists(
    st.lists(st.integers(0, 3), min_size=width, max_size=width), min_size=1, max_size=3)))
def test_run_starts_is_each_tokens_runs_first_index(rows):
    """The one place a run's start is found (seqjax/model/mask.py), which the segment sums, the shared prompt's
    convolution taps and its chunked rule read: a loop over the row says the same."""
    from seqjax.model.mask import run_starts

    expected = []
    for row in rows:
        starts = [0]
        for t in range(1, len(row)):
            starts.append(t if row[t] != row[t - 1] else starts[-1])
        expected.append(starts)
    np.testing.assert_array_equal(run_starts(jnp.asarray(rows, jnp.int32)), expected)
