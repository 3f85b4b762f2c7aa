"""Hugging Face tensors <-> seqjax parameters: the names and layouts of every family's weights.

HF stores PyTorch ``nn.Linear`` weights as [out, in]; seqjax keeps [in, out]
with the heads split out (V vocab, D d_model, H heads, K kv heads, Dh
head_dim, F d_ff). The tensor table (:func:`block_tensors`) is one list per
block, the same for every family but for the entries its settings add and
Gemma's names for its four norms:

=========================================  ===============  =============================
HF tensor (model.layers.i.)                HF shape         seqjax parameter (blocks.i.)
=========================================  ===============  =============================
input_layernorm.weight                     [D]              attn_norm.scale
self_attn.q_proj.weight / .bias            [H*Dh, D] / .    attn.wq [D, H, Dh] / attn.bq [H, Dh]
self_attn.k_proj, v_proj (.weight, .bias)  [K*Dh, D] / .    attn.wk, wv [D, K, Dh] / bk, bv
self_attn.q_norm.weight, k_norm.weight     [Dh]             attn.q_norm.scale, k_norm.scale
self_attn.o_proj.weight                    [D, H*Dh]        attn.wo [H, Dh, D]
post_attention_layernorm.weight            [D]              mlp_norm.scale (Gemma: post_attn_norm.scale)
pre_feedforward_layernorm.weight (Gemma)   [D]              mlp_norm.scale
post_feedforward_layernorm.weight (Gemma)  [D]              post_mlp_norm.scale
mlp.gate_proj, up_proj .weight             [F, D]           mlp.w_gate, w_up [D, F]
mlp.down_proj.weight                       [D, F]           mlp.w_down [F, D]
=========================================  ===============  =============================

A Gated DeltaNet layer (Qwen3.5's ``linear_attn.*``) holds :func:`deltanet_tensors` in place of
``self_attn.*``; Qwen3.5's gated q_proj is [H*2Dh, D], each head's query then its gate (attn.wq
[D, H, 2Dh]).

plus model.embed_tokens.weight [V, D] (embed.embedding), model.norm.weight [D]
(final_norm.scale) and, untied, lm_head.weight [V, D] (lm_head [D, V]). No
RoPE permutation is needed: HF's checkpoints are in the rotate-half layout.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from seqjax.config.model import ModelConfig
from seqjax.core.errors import CheckpointError
from seqjax.hf.families import FAMILIES, IGNORED_TENSOR_SUFFIXES
from seqjax.model.stacking import blocks_layout


def _layer(i: int) -> str:
    return f"model.layers.{i}."


Converter = Callable[[np.ndarray], np.ndarray]


def block_tensors(cfg: ModelConfig, layer: int = 0) -> list[tuple[str, tuple[str, ...], Converter, Converter]]:
    """(HF name suffix, seqjax path in the block, seqjax -> HF, HF -> seqjax) for block
    ``layer``'s tensors that map one to one (a layer with experts adds :func:`expert_groups`)."""
    d, h, k, dh = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    same = (lambda w: w), (lambda t: t)
    linear = (lambda w: w.T), (lambda t: t.T)

    def heads_in(n, width=dh):  # [D, n, Dh] <-> [n*Dh, D] (Qwen3.5's gated queries: 2 Dh wide)
        return (lambda w: w.reshape(d, n * width).T), (lambda t: t.T.reshape(d, n, width))

    def heads_bias(n):  # [n, Dh] <-> [n*Dh]
        return (lambda w: w.reshape(n * dh)), (lambda t: t.reshape(n, dh))

    gemma_norms = cfg.post_norms
    table = [
        ("input_layernorm.weight", ("attn_norm", "scale"), *same),
        # Llama's post_attention_layernorm is its pre-MLP norm; Gemma's is the attention branch's
        # post-norm
        ("post_attention_layernorm.weight",
         ("post_attn_norm", "scale") if gemma_norms else ("mlp_norm", "scale"), *same),
    ]
    if cfg.mixer_of(layer) == "deltanet":
        table += deltanet_tensors()
    else:
        table += [
            ("self_attn.q_proj.weight", ("attn", "wq"),
             *heads_in(h, dh * (1 + cfg.attention_gate))),
            ("self_attn.k_proj.weight", ("attn", "wk"), *heads_in(k)),
            ("self_attn.v_proj.weight", ("attn", "wv"), *heads_in(k)),
            ("self_attn.o_proj.weight", ("attn", "wo"), lambda w: w.reshape(h * dh, d).T,
             lambda t: t.T.reshape(h, dh, d))]
    if cfg.mlp_of(layer) == "gated":
        table += [("mlp.gate_proj.weight", ("mlp", "w_gate"), *linear),
                  ("mlp.up_proj.weight", ("mlp", "w_up"), *linear),
                  ("mlp.down_proj.weight", ("mlp", "w_down"), *linear)]
    attention = cfg.mixer_of(layer) == "attention"
    if cfg.mlp_of(layer) == "experts" and cfg.experts.shared_d_ff:  # Qwen3.5-MoE's shared expert
        table += [(f"mlp.shared_expert.{name}_proj.weight", ("mlp", "shared", f"w_{name}"), *linear)
                  for name in ("gate", "up", "down")] + [
            ("mlp.shared_expert_gate.weight", ("mlp", "shared_gate"), *linear)]
    if cfg.attention_sinks and attention:
        table += [("self_attn.sinks", ("attn", "sinks"), *same)]
    if cfg.attn_out_bias and attention:
        table += [("self_attn.o_proj.bias", ("attn", "bo"), *same)]
    if cfg.qkv_bias and attention:
        table += [("self_attn.q_proj.bias", ("attn", "bq"), *heads_bias(h)),
                  ("self_attn.k_proj.bias", ("attn", "bk"), *heads_bias(k)),
                  ("self_attn.v_proj.bias", ("attn", "bv"), *heads_bias(k))]
    if cfg.qk_norm and attention:
        table += [("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), *same),
                  ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), *same)]
    if gemma_norms:
        table += [("pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), *same),
                  ("post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), *same)]
    return table


def deltanet_tensors() -> list[tuple[str, tuple[str, ...], Converter, Converter]]:
    """A Gated DeltaNet layer's tensors (Qwen3.5's ``linear_attn``; seqjax.model.deltanet.DeltaNet
    keeps transformers' names): the linears [out, in] <-> [in, out], the depthwise conv [C, 1, K]
    <-> [C, K]."""
    same, linear = ((lambda w: w), (lambda t: t)), ((lambda w: w.T), (lambda t: t.T))
    rows = [(f"linear_attn.{name}.weight", ("attn", name), *linear)
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
    rows += [("linear_attn.conv1d.weight", ("attn", "conv1d"), lambda w: w[:, None, :],
              lambda t: t[:, 0, :])]
    rows += [(f"linear_attn.{name}", ("attn", name), *same) for name in ("A_log", "dt_bias")]
    return rows + [
        ("linear_attn.norm.weight", ("attn", "norm"), *same)]


# A group row: (HF tensors of the block and their shapes, the seqjax paths they make, seqjax values
# -> HF tensors, HF tensors -> seqjax values), both in the order listed: E per-expert tensors
# stacked into one array, or one fused tensor split into two.
Group = tuple[dict[str, tuple[int, ...]], tuple[tuple[str, ...], ...], Callable, Callable]


def expert_groups(cfg: ModelConfig, layer: int) -> list[Group]:
    """Block ``layer``'s expert tensors (none for a gated layer), as its family's row names them
    (:class:`seqjax.hf.families.ExpertTensors`): per-expert [F, D] projections stacked into [E,
    D, F] (Qwen3-MoE, Mixtral), or gpt-oss's fused [E, D, 2F] gate_up_proj, its gate and up
    columns interleaved, split in two."""
    if cfg.mlp_of(layer) != "experts":
        return []
    names = FAMILIES[cfg.family].experts
    e, d, f = cfg.experts.count, cfg.d_model, cfg.experts.d_ff or cfg.d_ff
    path = ("mlp", "experts")
    groups: list[Group] = [({f"{names.router}.weight": (e, d)}, (path + ("router",),),
                            lambda router: (router.T,), lambda t: (t.T,))]
    if names.fused is None:
        for param, pattern, shape in (("w_gate", names.gate, (f, d)), ("w_up", names.up, (f, d)),
                                      ("w_down", names.down, (d, f))):
            groups.append(({pattern.format(i) + ".weight": shape for i in range(e)}, (path + (param,),),
                           lambda w: tuple(np.swapaxes(w, 1, 2)), lambda *t: (np.swapaxes(np.stack(t), 1, 2),)))
        return groups
    fused = names.fused
    groups += [({f"{fused}.gate_up_proj": (e, d, 2 * f)}, (path + ("w_gate",), path + ("w_up",)),
                lambda g, u: (np.stack([g, u], axis=-1).reshape(e, d, 2 * f),),
                lambda t: (t[..., ::2], t[..., 1::2])),
               ({f"{fused}.down_proj": (e, f, d)}, (path + ("w_down",),), lambda w: (w,), lambda t: (t,))]
    if cfg.experts.bias:
        groups += [({f"{names.router}.bias": (e,)}, (path + ("router_bias",),), lambda b: (b,), lambda t: (t,)),
                   ({f"{fused}.gate_up_proj_bias": (e, 2 * f)}, (path + ("b_gate",), path + ("b_up",)),
                    lambda g, u: (np.stack([g, u], axis=-1).reshape(e, 2 * f),),
                    lambda t: (t[..., ::2], t[..., 1::2])),
                   ({f"{fused}.down_proj_bias": (e, d)}, (path + ("b_down",),), lambda b: (b,), lambda t: (t,))]
    return groups


def _block_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, ...]]:
    d, h, k, dh, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"input_layernorm.weight": (d, ), "post_attention_layernorm.weight": (d, )}
    if cfg.mixer_of(layer) == "deltanet":
        net = cfg.deltanet
        qkv, value = net.qkv_width, net.value_width
        shapes |= {"linear_attn.in_proj_qkv.weight": (qkv, d),
                   "linear_attn.in_proj_z.weight": (value, d),
                   "linear_attn.in_proj_b.weight": (net.value_heads, d),
                   "linear_attn.in_proj_a.weight": (net.value_heads, d),
                   "linear_attn.conv1d.weight": (qkv, 1, net.conv_width),
                   "linear_attn.A_log": (net.value_heads,), "linear_attn.dt_bias": (net.value_heads,),
                   "linear_attn.norm.weight": (net.value_dim,),
                   "linear_attn.out_proj.weight": (d, value)}
    else:
        shapes |= {"self_attn.q_proj.weight": (h * dh * (1 + cfg.attention_gate), d),
                   "self_attn.k_proj.weight": (k * dh, d), "self_attn.v_proj.weight": (k * dh, d),
                   "self_attn.o_proj.weight": (d, h * dh)}
    attention = cfg.mixer_of(layer) == "attention"
    if cfg.mlp_of(layer) == "gated":
        shapes |= {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    for hf, *_ in expert_groups(cfg, layer):
        shapes |= hf
    if cfg.mlp_of(layer) == "experts" and (shared := cfg.experts.shared_d_ff):
        shapes |= {"mlp.shared_expert.gate_proj.weight": (shared, d),
                   "mlp.shared_expert.up_proj.weight": (shared, d),
                   "mlp.shared_expert.down_proj.weight": (d, shared),
                   "mlp.shared_expert_gate.weight": (1, d)}
    if cfg.attention_sinks and attention:
        shapes["self_attn.sinks"] = (h,)
    if cfg.attn_out_bias and attention:
        shapes["self_attn.o_proj.bias"] = (d,)
    if cfg.qkv_bias and attention:
        shapes |= {"self_attn.q_proj.bias": (h * dh,), "self_attn.k_proj.bias": (k * dh,),
                   "self_attn.v_proj.bias": (k * dh,)}
    if cfg.qk_norm and attention:
        shapes |= {"self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)}
    if cfg.post_norms:
        shapes |= {"pre_feedforward_layernorm.weight": (d,), "post_feedforward_layernorm.weight": (d,)}
    return shapes


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of a model with ``cfg`` and its shape."""
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model),
        "model.norm.weight": (cfg.d_model, )
    }
    for i in range(cfg.n_layers):
        shapes.update({_layer(i) + name: shape for name, shape in _block_shapes(cfg, i).items()})
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    return shapes


def tree_get(tree: dict[str, Any], path: tuple) -> Any:
    """The value at ``path`` (keys) of a nested dict."""
    for key in path:
        tree = tree[key]
    return tree


def tree_put(tree: dict[str, Any], path: tuple, value: Any) -> None:
    """``value`` at ``path`` of a nested dict, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """seqjax parameters (``nnx.to_pure_dict`` of the model's Params) -> HF tensors by name, as
    numpy arrays."""
    # HF keeps a tensor per layer, whatever model.scan_layers
    params = blocks_layout(params, stacked=False)
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
    for i in range(cfg.n_layers):
        for name, path, to_hf_layout, _ in block_tensors(cfg, i):
            out[_layer(i) + name] = np.ascontiguousarray(
                to_hf_layout(np.asarray(tree_get(params["blocks"][i], path))))
        for hf, paths, to_hf_layout, _ in expert_groups(cfg, i):
            tensors = to_hf_layout(*(np.asarray(tree_get(params["blocks"][i], p)) for p in paths))
            out.update({_layer(i) + name: np.ascontiguousarray(t) for name, t in zip(hf, tensors)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def from_hf(read: Callable[[str], np.ndarray], names: Iterable[str], cfg: ModelConfig, source: str,
            dtype: Any = np.float32) -> dict[str, Any]:
    """HF tensors -> seqjax parameters (the pure dict ``nnx.merge`` takes), each cast to ``dtype``.

    ``read(name)`` returns one tensor; ``names`` are the tensors the checkpoint
    holds. A missing tensor, a wrong shape, or a tensor seqjax has no place
    for (a bias a family does not have, say) is refused with a CheckpointError
    naming it and ``source``. A tied model ignores an ``lm_head.weight``.
    """
    names = set(names)
    expected = hf_shapes(cfg)
    ignored = {n for n in names if n.endswith(IGNORED_TENSOR_SUFFIXES)}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unexpected = sorted(names - set(expected) - ignored)
    if unexpected:
        raise CheckpointError(
            f"{source}: holds tensors a {FAMILIES[cfg.family].architecture} with this config.json "
            f"has no place for: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    missing = sorted(set(expected) - names)
    if missing:
        raise CheckpointError(
            f"{source}: tensor {missing[0]} is missing ({len(missing)} missing in all)")

    def get(name: str) -> np.ndarray:
        tensor = read(name)
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                f"{expected[name]} from config.json"
            )
        return np.asarray(tensor).astype(dtype)

    params: dict[str, Any] = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.norm.weight")},
        "blocks": {},
    }
    for i in range(cfg.n_layers):
        block: dict[str, Any] = {}
        for name, path, _, from_hf_layout in block_tensors(cfg, i):
            tree_put(block, path, np.ascontiguousarray(from_hf_layout(get(_layer(i) + name))))
        for hf, paths, _, from_hf_layout in expert_groups(cfg, i):
            values = from_hf_layout(*(get(_layer(i) + name) for name in hf))
            for path, value in zip(paths, values):
                tree_put(block, path, np.ascontiguousarray(value))
        params["blocks"][i] = block
    if not cfg.tie_embeddings:
        params["lm_head"] = np.ascontiguousarray(get("lm_head.weight").T)
    return params
