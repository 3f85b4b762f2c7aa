"""Reference outputs of transformers' own Gated DeltaNet (Qwen3.5's linear-attention layer), made by
transformers 5 itself on its torch path (no FLA kernels).

    python scripts/make_deltanet_references.py --out tests/data/deltanet   # needs torch, transformers >= 5.24

One tiny layer (``Qwen3_5GatedDeltaNet`` of a ``Qwen3_5TextConfig``: 2 key heads, 4 value heads, head
dims 8, the conv of width 4), its weights drawn from their names (:func:`weights`, so the tests can draw
them without torch), and three documents of 70, 3 and 21 tokens (one crossing transformers' chunk of
64, one shorter than the convolution):

- ``layer.<doc>``: the layer's output on each document alone;
- ``layer.packed``: its output on the three packed into one row (transformers carries the state, and the
  convolution, from one document into the next: what seqjax must not do);
- ``rule.<doc>.out`` / ``rule.<doc>.state``: ``torch_chunk_gated_delta_rule`` (q/k L2-normed in the rule)
  on each document's own random q, k, v, g, beta alone, its output and final state;
- the inputs: ``x.<doc>`` and ``rule.<doc>.{q,k,v,g,beta}``, and ``deltanet.json`` with the sizes
  and the versions that made them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH, EPS = 32, 2, 4, 8, 4, 1e-6
DOCS = {"doc0": 70, "doc1": 3, "doc2": 21}


def draw(name: str, shape, scale: float = 0.3) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little"))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def weights() -> dict[str, np.ndarray]:
    """The layer's tensors in transformers' layout (linears [out, in], the conv [C, 1, K])."""
    key, value = KEY_HEADS * HEAD_DIM, VALUE_HEADS * HEAD_DIM
    conv = 2 * key + value
    return {"in_proj_qkv.weight": draw("in_proj_qkv", (conv, HIDDEN)),
            "in_proj_z.weight": draw("in_proj_z", (value, HIDDEN)),
            "in_proj_b.weight": draw("in_proj_b", (VALUE_HEADS, HIDDEN)),
            "in_proj_a.weight": draw("in_proj_a", (VALUE_HEADS, HIDDEN)),
            "conv1d.weight": draw("conv1d", (conv, 1, WIDTH), 0.5),
            "dt_bias": draw("dt_bias", (VALUE_HEADS,), 1.0),
            "A_log": np.log(np.linspace(0.5, 8.0, VALUE_HEADS)).astype(np.float32),
            "norm.weight": 1.0 + draw("norm", (HEAD_DIM,), 0.2),
            "out_proj.weight": draw("out_proj", (HIDDEN, value))}


def rule_inputs(doc: str, n: int) -> dict[str, np.ndarray]:
    return {"q": draw(f"{doc}.q", (1, n, KEY_HEADS, HEAD_DIM), 1.0),
            "k": draw(f"{doc}.k", (1, n, KEY_HEADS, HEAD_DIM), 1.0),
            "v": draw(f"{doc}.v", (1, n, VALUE_HEADS, HEAD_DIM), 1.0),
            "g": -np.abs(draw(f"{doc}.g", (1, n, VALUE_HEADS), 0.5)),
            "beta": 1 / (1 + np.exp(-draw(f"{doc}.beta", (1, n, VALUE_HEADS), 1.0)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    out = p.parse_args().out
    import torch
    import transformers
    from safetensors.numpy import save_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    config = transformers.Qwen3_5TextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=WIDTH,
        rms_norm_eps=EPS, num_hidden_layers=1, layer_types=["linear_attention"])
    layer = m.Qwen3_5GatedDeltaNet(config, 0).eval()
    layer.load_state_dict({k: torch.from_numpy(v) for k, v in weights().items()})
    tensors = {}
    with torch.no_grad():
        for doc, n in DOCS.items():
            x = draw(f"x.{doc}", (1, n, HIDDEN), 1.0)
            tensors[f"x.{doc}"] = x
            tensors[f"layer.{doc}"] = layer(torch.from_numpy(x)).numpy().copy()
            inputs = rule_inputs(doc, n)
            o, state = m.torch_chunk_gated_delta_rule(
                *(torch.from_numpy(inputs[k]) for k in ("q", "k", "v")), g=torch.from_numpy(inputs["g"]),
                beta=torch.from_numpy(inputs["beta"]), output_final_state=True, use_qk_l2norm_in_kernel=True)
            tensors |= {f"rule.{doc}.{k}": a for k, a in inputs.items()}
            tensors[f"rule.{doc}.out"], tensors[f"rule.{doc}.state"] = o.numpy().copy(), state.numpy().copy()
        packed = np.concatenate([tensors[f"x.{doc}"] for doc in DOCS], axis=1)
        tensors["layer.packed"] = layer(torch.from_numpy(packed)).numpy().copy()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "deltanet.safetensors"))
    meta = {"hidden": HIDDEN, "key_heads": KEY_HEADS, "value_heads": VALUE_HEADS, "head_dim": HEAD_DIM,
            "conv_width": WIDTH, "eps": EPS, "docs": DOCS, "transformers": transformers.__version__,
            "torch": torch.__version__}
    (out / "deltanet.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
