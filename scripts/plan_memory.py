"""How much memory one device needs to train a config: compiled ahead of time, no real array allocated (JSON).

    python scripts/plan_memory.py --config configs/llama3_1b_finetune.yaml --devices 1 [key=value ...]
    python scripts/plan_memory.py --config configs/llama3_8b_fsdp.yaml --devices 8 mesh.fsdp=4 mesh.tensor=2
    python scripts/plan_memory.py --config configs/qwen3_vl_lora.yaml --devices 1

It compiles the real train step (the one ``python -m seqjax.train`` runs: the
model's full shape, the optimizer, gradient accumulation, the mesh's
shardings) for ``--devices`` host devices (``--xla_force_host_platform_device_count``),
with abstract inputs: nothing of the model's size is allocated. It prints, per
device: parameter bytes and optimizer-state bytes (from each array's shard
shape), the batch's bytes, and the temporary bytes of XLA's compiled memory
analysis (activations and everything else the step allocates), and their
total against an 80 GB (H100) and a 141 GB (H200) GPU.

The GPU kernels cannot lower on a CPU, so the step compiles here with XLA's attention. For a run whose attention
is a kernel (``auto``, ``pallas``, ``pallas_mosaic``, the cuDNN ones) that would count what the kernel never
keeps: the dense path's [T, T] scores and probabilities of every head, 2.9 GB a 2,048-token row at
Llama-3.2-1B's shape, which made the plan 43.5 GB where the H200 measured 23.0 GB (2026-11-27). So the attention
compiles as a stand-in with a flash kernel's memory (:func:`flash_memory`: its output and the log-sum-exp rows it
keeps for the backward pass, never a [T, T] array); the dense path stays where the run takes it (``xla``,
attention dropout, a shared prompt). The CPU compiler still assigns buffers differently from the GPU's; BENCHMARKS.md
records the plan beside what GPUs measured. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

from seqjax.core.devices import with_host_devices


def with_vocab(config):
    """``model.vocab_size: null`` as training resolves it: the tokenizer's size (the configured tokenizer.path's,
    else the tokenizer.vocab_size that prepare trains), without building anything."""
    import dataclasses

    if config.model.vocab_size is not None:
        return config
    vocab = config.tokenizer.vocab_size
    if config.tokenizer.path:
        from tokenizers import Tokenizer

        from seqjax.core.errors import ConfigError

        try:
            vocab = Tokenizer.from_file(str(Path(config.tokenizer.path).expanduser())).get_vocab_size(True)
        except Exception as err:  # tokenizers raises a bare Exception for a missing or malformed file
            raise ConfigError(f"tokenizer.path: {config.tokenizer.path!r} is not a readable tokenizer.json ({err}); "
                              "or set model.vocab_size") from None
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=vocab))


def flash_memory(q, k, v, segment_ids, *, scale=None, dropout_rate=0.0, dropout_key=None, window=None, sinks=None):
    """An attention stand-in for planning with a flash kernel's device memory: it keeps q, k, v, its output
    and the log-sum-exp rows [B, T, H] for the backward pass, and makes dq, dk, dv; no [T, T] array exists.
    Its numbers mean nothing: only the shapes and lifetimes of what it allocates are the kernel's (attention
    sinks rescale its output by the log-sum-exp rows it already keeps: no memory of their own)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def kernel(q, k, v):
        return forward(q, k, v)[0]

    def forward(q, k, v):
        group = q.shape[2] // k.shape[2]
        out = q * jnp.repeat(k + v, group, axis=2)  # ([B, T, H, D]: the output, reading all three)
        lse = jnp.sum(q.astype(jnp.float32), axis=-1)  # [B, T, H]
        return out, (q, k, v, out, lse)

    def backward(residuals, g):
        q, k, v, out, lse = residuals
        group = q.shape[2] // k.shape[2]
        delta = jnp.sum((g * out).astype(jnp.float32), axis=-1) + lse  # [B, T, H], as flash's backward makes
        dq = g * delta[..., None].astype(g.dtype)
        dkv = jnp.sum((g * q).reshape(*k.shape[:2], k.shape[2], group, k.shape[3]), axis=3)
        return dq, dkv * k, dkv * v

    kernel.defvjp(forward, backward)
    return kernel(q, k, v)


def grouped_memory(lhs, rhs, group_sizes, preferred_element_type=None, **_):
    """A stand-in for ``jax.lax.ragged_dot`` with a grouped-matmul kernel's device memory: lhs [M, K] sorted by
    group, rhs [G, K, N] -> [M, N]; its backward keeps lhs and makes d lhs [M, K] and d rhs [G, K, N]. XLA's
    CPU (and default GPU) lowering of ragged_dot instead pads every group to M rows, G times the memory; a GPU
    run picks a grouped kernel (docs/model.md, "Mixture of experts"). Its numbers mean nothing."""
    import jax
    import jax.numpy as jnp

    out_dtype = preferred_element_type or lhs.dtype

    @jax.custom_vjp
    def kernel(lhs, rhs):
        return forward(lhs, rhs)[0]

    def forward(lhs, rhs):
        return jnp.matmul(lhs, rhs[0], preferred_element_type=out_dtype), (lhs, rhs)

    def backward(residuals, g):
        lhs, rhs = residuals
        d_lhs = jnp.matmul(g.astype(lhs.dtype), jnp.swapaxes(rhs[0], 0, 1))
        d_rhs = jnp.broadcast_to(jnp.matmul(lhs.T, g.astype(lhs.dtype))[None], rhs.shape).astype(rhs.dtype)
        return d_lhs, d_rhs

    kernel.defvjp(forward, backward)
    return kernel(lhs, rhs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    # Before jax is imported: the number of host devices is fixed when the CPU backend starts.
    os.environ["XLA_FLAGS"] = with_host_devices(os.environ.get("XLA_FLAGS", ""), args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from flax import nnx

    from seqjax.config.load import load_config
    from seqjax.core.errors import SeqjaxError
    from seqjax.data.contract import OPTIONAL_FIELDS, given_fields
    from seqjax.model import attention as attention_module
    from seqjax.model import build_model, context, quant, sharding, split_params
    from seqjax.model.lora import adapters_off
    from seqjax.objectives import resolve, settings_of
    from seqjax.train.optimizer import build_optimizer
    from seqjax.train.step import make_train_step
    from seqjax.weights.reference import BASE, MODEL, decide

    # The attention the CPU compiles is XLA's (the GPU kernels cannot lower here); the rest is the run's own. A
    # kernel's run plans with its memory: flash_memory stands in for the dense path's scores.
    try:
        asked = load_config(args.config, args.overrides)
    except SeqjaxError:
        asked = None  # (the refusal comes below, with its message)
    # (attention dropout runs the dense path whatever the backend: auto picks xla for it, as it does for a shared
    # prompt's mask, which only the dense path computes)
    # (a row split over mesh.context runs seqjax.model.context's own blocks, planned as they are)
    kernel_memory = (asked is not None and asked.model.attention != "xla" and not asked.model.attention_dropout
                     and "prefix_ids" not in given_fields(asked) and asked.mesh.context == 1)
    if kernel_memory:
        attention_module.reference_attention = flash_memory
    # experts: dispatched as a GPU run's auto dispatches them (ragged_dot), with a grouped kernel's memory
    jax.lax.ragged_dot = grouped_memory
    try:
        config = with_vocab(load_config(args.config, [*args.overrides, "model.attention=xla", "train.init_from=null",
                                                      "model.experts.dispatch=ragged_dot"]))
    except SeqjaxError as err:
        print(f"plan_memory.py: config error: {err}", file=sys.stderr)
        sys.exit(2)
    mesh = sharding.build_mesh(config.mesh, jax.devices()[: args.devices])
    model = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    # Under model.lora only the adapters train (and have optimizer state); the base is a frozen argument.
    graphdef, param_state, frozen_state, rest = split_params(model)

    def abstract(state):
        shardings = sharding.param_shardings(state, mesh)
        return shardings, jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                                       nnx.to_pure_dict(state), shardings)

    param_shardings, params = abstract(param_state)
    frozen_shardings, frozen = abstract(frozen_state) if frozen_state is not None else (None, None)
    base_parameters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(frozen or {}))
    lora = config.model.lora
    if lora.quantize != "none":  # QLoRA: the base's projections as the run stores them (int8, or nf4 and its scales)
        stored = jax.eval_shape(lambda f: quant.quantize_base(f, lora.quantize, lora.quant_block,
                                                               config.model.scan_layers), frozen)
        frozen_shardings = quant.shardings(frozen_shardings, stored, sharding.replicated(mesh))
        frozen = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), stored,
                              frozen_shardings)
    tx, _ = build_optimizer(config.train)
    replicated = sharding.replicated(mesh)
    opt_abstract = jax.eval_shape(tx.init, params)
    import optax

    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, param_shardings,
                                          transform_non_params=lambda _: replicated)
    opt_state = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), opt_abstract,
                             opt_shardings)
    batch_sharding = sharding.batch_sharding(mesh)
    b, t = config.data.batch_size, config.data.seq_len
    # the batch the data gives (preference pairs add pair_ids, and prefix_ids with a shared prompt)
    objective = resolve(config.train.objective, config.train.objective_weights)
    ref = decide(config, objective.reference)  # (the run's one decision: seqjax.weights.reference)
    precomputed = ref.kind is not None and ref.precompute  # (the batch carries them)
    patches, patch_dim = config.data.patches_per_row, config.model.vision.patch_dim

    def shape_of(name: str) -> tuple[tuple[int, ...], type]:  # (chats with images: a row's patches beside its tokens)
        dtype = OPTIONAL_FIELDS[name].dtype if name in OPTIONAL_FIELDS else (
            np.float32 if name == "weights" else np.int32)
        if name == "positions_3d":
            return (b, t, 3), dtype
        if name in OPTIONAL_FIELDS and OPTIONAL_FIELDS[name].per_row:
            return (b, 1), dtype
        if name == "patches":
            return (b, patches, patch_dim), dtype
        return ((b, patches) if name.startswith("patch_") else (b, t)), dtype

    batch = {name: jax.ShapeDtypeStruct(*shape_of(name), sharding=batch_sharding)
             for name in given_fields(config)}
    rng = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    extra = [] if frozen is None else [frozen]
    extra_shardings = [] if frozen is None else [frozen_shardings]
    # the train.objective the run computes, and its reference model: under model.lora the same state with the
    # adapters off (no memory), otherwise a frozen copy of the trained weights (their bytes again)
    reference_graphdef, reference = None, None
    if ref.in_step and ref.kind == BASE:
        reference_graphdef = adapters_off(graphdef, param_state, frozen_state, rest)
    elif ref.in_step and ref.kind == MODEL and lora.rank:  # (another base: the frozen base's bytes again)
        reference_graphdef, reference = adapters_off(graphdef, param_state, frozen_state, rest), frozen
        extra, extra_shardings = [frozen, frozen], [frozen_shardings, frozen_shardings]
    elif ref.in_step:
        reference = params
        extra, extra_shardings = [frozen, params], [frozen_shardings, param_shardings]
    settings = settings_of(config, objective)
    step = jax.jit(make_train_step(graphdef, rest, tx, grad_accum=config.train.grad_accum, z_loss=config.train.z_loss,
                                   objective=objective, settings=settings, reference_graphdef=reference_graphdef,
                                   precomputed=precomputed, model_config=config.model),
                   in_shardings=(param_shardings, opt_shardings, batch_sharding, replicated, replicated,
                                 *extra_shardings),
                   out_shardings=(param_shardings, opt_shardings, replicated), donate_argnums=(0, 1))
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch, rng, 0, *extra).compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()

    def per_device(tree) -> int:  # 4-bit values count half a byte, as XLA packs them on a GPU
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * quant.bits(x.dtype) // 8
                   for x in jax.tree.leaves(tree))

    trainable = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    total_params = trainable + base_parameters
    row = {
        "config": args.config, "overrides": args.overrides, "devices": args.devices,
        "mesh": dict(mesh.shape), "parameters": total_params,
        "batch_size": b, "seq_len": t, "grad_accum": config.train.grad_accum,
        "patches_per_row": patches if config.data.image_processor is not None else None,
        "remat": config.model.remat, "loss_chunk_tokens": config.model.loss_chunk_tokens,
        "param_dtype": config.model.param_dtype, "compute_dtype": config.model.compute_dtype,
        "trainable_parameters": trainable, "lora_rank": config.model.lora.rank, "base_storage": lora.quantize,
        "experts": config.model.experts.count, "expert_memory": "a grouped matmul's (jax.lax.ragged_dot)"
        if config.model.experts.enabled else None,
        "attention_memory": "a flash kernel's (output and log-sum-exp rows)" if kernel_memory else
        f"a split row's blocks (up to {context.QUERY_CHUNK} queries x a shard's keys, {config.model.context_attention})"
        if config.mesh.context > 1 else "XLA's dense path ([T, T] scores)",
        "objective": config.train.objective, "reference": "none" if not objective.reference else
        "precomputed" if precomputed else "a frozen copy" if reference is not None else "the base, adapters off",
        "param_bytes_per_device": per_device(params) + per_device(frozen or {}) + (
            per_device(reference) if reference is not None else 0),
        "optimizer_bytes_per_device": per_device(opt_state),
        "batch_bytes_per_device": per_device(batch),
        "temp_bytes_per_device": int(stats.temp_size_in_bytes),
        "compile_seconds": round(seconds, 2),
    }
    total = row["param_bytes_per_device"] + row["optimizer_bytes_per_device"] + row["batch_bytes_per_device"] + \
        row["temp_bytes_per_device"]
    if config.data.format == "prompt":  # (an RL run's other program: sampling its completions, between steps)
        row |= sampling_memory(config, model, mesh, row["param_bytes_per_device"] + row["optimizer_bytes_per_device"])
        total = max(total, row["sampling_total_bytes_per_device"])
    row |= {"total_bytes_per_device": total, "fits_80GB": total <= 80e9, "fits_141GB": total <= 141e9,
            "date": datetime.date.today().isoformat(), "backend": jax.default_backend()}
    print(json.dumps(row), flush=True)
    return row


def sampling_memory(config, model, mesh, resident: int) -> dict:
    """An RL run's sampling programs (seqjax.engine: the packed prefill and the decode loop) compiled for its
    generation batch: each prompt at the longest a row holds beside its completions (data.seq_len less
    rl.num_generations x rl.max_completion_length in the prompt-once layout, less one completion otherwise),
    stored once in the paged KV cache, its G completions decoded through engine.slots slots. ``resident``: the
    weights and optimizer state that stay on the device meanwhile; the cache's pages count beside them."""
    import jax
    from flax import nnx

    from seqjax.engine.engine import Engine
    from seqjax.model import sharding
    from seqjax.model.sampling import SamplingConfig

    rl = config.rl
    prompt = max(1, config.data.seq_len - rl.max_completion_length * (
        rl.num_generations if rl.layout == "prompt_once" else 1))
    graphdef, state = nnx.split(model)
    shardings = sharding.param_shardings(state, mesh)
    pure = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), nnx.to_pure_dict(state),
                        shardings)
    nnx.replace_by_pure_dict(state, pure)
    engine = Engine(model, config.engine, state=state)
    start = time.perf_counter()
    # (the loop at its full width: engine.shrink_to's narrower loop bodies run after it on fewer rows, hold less,
    # and each would compile the whole decode step again)
    lowered, plan = engine.lower([prompt] * rl.generation_prompts, copies=rl.num_generations,
                                 max_new_tokens=rl.max_completion_length,
                                 sampling=SamplingConfig(rl.temperature, rl.top_k, rl.top_p))
    compiled = lowered.compile()
    temp = int(compiled.memory_analysis().temp_size_in_bytes)  # (the paged cache is made inside: counted here)
    return {"sampling_rows": rl.generation_prompts * rl.num_generations, "sampling_prompt_tokens": prompt,
            "sampling_slots": plan.slots, "sampling_kv_bytes_per_device": plan.kv_bytes,
            "sampling_temp_bytes_per_device": temp, "sampling_total_bytes_per_device": resident + temp,
            "sampling_compile_seconds": round(time.perf_counter() - start, 2)}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
