"""``model.lora``: the low-rank adapters of a block's projections, and the split of a model's state
into what trains and what stays frozen.

Flax's ``nnx.LoRA`` holds each adapter (A [in, r], B [r, out] zeros), so a new adapter adds 0 and a
LoRA model starts as its base, bit for bit. Its parameters are ``nnx.LoRAParam``, a subclass of
``nnx.Param``: one filter tells the adapters (what trains) from the base (what is frozen), and
checkpoints hold only what trains. ``model.lora.modules_to_save`` adds whole modules (the
embeddings, the head) to what trains, as PEFT's ``modules_to_save`` does.

What a projection x -> x W computes with its adapter (s = alpha / r, or alpha / sqrt(r) under
``rslora``; x_d is x after the adapters' dropout, x itself outside training)::

    LoRA    x W + s (x_d A) B
    DoRA    x W + (g - 1) (x_d W) + g s (x_d A) B,   g = m / ||W + s A B||   (one per output)

DoRA's ``g`` rescales each output column to its trained magnitude ``m`` (started at ||W||, so a new
adapter changes nothing); the norm runs over the inputs and is not differentiated (the DoRA paper's
section 4.3, which PEFT follows). Without dropout the DoRA line is ``g (x W + s x A B)``: the
direction W + s A B, scaled to m. A bias is added after, unscaled, as PEFT does.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from seqjax.config.model import LoraConfig, ModelConfig

LORA_STREAM = 0x6C6F7261  # "lora"
# The model's own weights: every nnx.Param but the adapters (nnx.LoRAParam, a Param subclass).
BASE_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
# model.lora.modules_to_save -> the model's top-level attribute holding that module's weights.
SAVED_ATTRIBUTES = {"embed": "embed", "head": "lm_head"}
# How A starts (B starts at 0): PEFT's kaiming_uniform(a=sqrt(5)) bounds A by 1/sqrt(in), which is
# variance scaling 1/3 over fan_in, uniform; flax's he_uniform bounds it by sqrt(6 / in).
A_INITS = {
    "peft": lambda rank: nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
    "gaussian": lambda rank: nnx.initializers.normal(1 / rank),
    "flax": lambda rank: nnx.initializers.he_uniform(),
}


def trained_filter(lora: LoraConfig):
    """What trains under ``model.lora``: the adapters, and the modules of ``modules_to_save``."""
    saved = [nnx.All(nnx.Param, nnx.PathContains(SAVED_ATTRIBUTES[m])) for m in lora.modules_to_save]
    return nnx.Any(nnx.LoRAParam, *saved)


def frozen_part(weights: dict, lora: LoraConfig) -> dict:
    """A model's whole weights (pure dict) without what trains beside the adapters: the frozen base
    of a ``model.lora`` run."""
    saved = {SAVED_ATTRIBUTES[m] for m in lora.modules_to_save}
    return {key: value for key, value in weights.items() if key not in saved}


def saved_part(weights: dict, lora: LoraConfig) -> dict:
    """The weights of ``modules_to_save`` alone (what they start from, a base's own)."""
    return {SAVED_ATTRIBUTES[m]: weights[SAVED_ATTRIBUTES[m]] for m in lora.modules_to_save}


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State | None, nnx.State]:
    """(graphdef, the parameters that train, the frozen base or None, the rest of the state).

    Without adapters every parameter trains (no frozen part); with ``model.lora`` only the adapters
    (and ``modules_to_save``) do, and the base rides along frozen. ``nnx.merge(graphdef, trained,
    *([frozen] if frozen else []), rest)`` rebuilds it.
    """
    lora = model.cfg.lora
    if lora.rank:
        trained = trained_filter(lora)
        return nnx.split(model, trained, nnx.All(nnx.Param, nnx.Not(trained)), ...)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params, None, rest


def adapters_off(graphdef: nnx.GraphDef, *states) -> nnx.GraphDef:
    """The graph of ``graphdef`` with every adapter switched off: merged with the same states (the
    adapters included, unused), it computes the base alone. A preference objective's reference under
    ``model.lora``, with no second copy of any weight."""
    model = nnx.merge(graphdef, *states)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (Adapters, ExpertAdapters)):
            module.active = False
    return nnx.graphdef(model)


def _drop(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """``x`` through a dropout layer: masked with ``key`` (training), unchanged without one."""
    return layer(x, deterministic=key is None, rngs=key)


def column_norms(w: jax.Array, a: jax.Array | None = None, b: jax.Array | None = None,
                 scale: float = 0.0) -> jax.Array:
    """||W + s A B|| over the inputs, one per output, in float32 (||W|| without A and B): w is the
    weight with its inputs first, [in, out] or in its own layout with A and B (flattened by their
    sizes)."""
    if a is None:
        return jnp.linalg.norm(w.astype(jnp.float32), axis=0)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(
        w.reshape(a.shape[0], b.shape[1]).astype(jnp.float32) + scale * (a @ b), axis=0)


class Adapters(nnx.Module):
    """``model.lora``'s low-rank adapters of one module's projections: flax's ``nnx.LoRA`` each (A
    [in, r] from ``model.lora.init``, B [r, out] zeros: a new adapter adds 0), scaled by s, with
    dropout on their input, and under DoRA a magnitude per output (``magnitude`` [out]).

    ``apply(name, x, out, w)`` is the projection's output with adapter ``name``'s part: x [..., in]
    its input, out [..., out] its output x W, w its weight (both flattened to [in], [out]; returned
    unchanged when the projection has no adapter). Their parameters are ``nnx.LoRAParam``: the
    train step differentiates those alone, and checkpoints hold only them.

    ``projections[name]`` is ``(weight, n)``: the projection's weight, whose first ``n`` dimensions
    are its input (wo's [heads, head_dim]; the others' one). A reads the input flattened, B writes
    the output flattened, and each takes the logical axis that leads its side of the weight beside
    ``lora_rank``: the mesh lays an adapter out as its projection (B of q split over heads where wq
    is), so its output adds to the projection's in place.
    """

    def __init__(self, cfg: ModelConfig, projections: dict[str, tuple[nnx.Param, int]], *,
                 rngs: nnx.Rngs):
        lora = cfg.lora
        self.names = tuple(name for name in projections if lora.rank and name in lora.targets)
        self.scale, self.dora = lora.scale, lora.dora
        self.active = True  # static: False is the base alone (a preference objective's reference)
        self.dropout = nnx.Dropout(lora.dropout)
        pdt = jnp.dtype(cfg.param_dtype)
        for name in self.names:
            weight, n = projections[name]
            module = nnx.LoRA(math.prod(weight.shape[:n]), lora.rank, math.prod(weight.shape[n:]),
                              param_dtype=pdt, a_initializer=A_INITS[lora.init](lora.rank), rngs=rngs)
            module.lora_a.set_metadata(axes=(weight.axes[0], "lora_rank"))
            module.lora_b.set_metadata(axes=("lora_rank", weight.axes[n]))
            # m = ||W||: g = 1 while B = 0 (set again once the base's weights are read)
            if self.dora:
                flat = weight[...].reshape(module.in_features, module.out_features)
                module.magnitude = nnx.LoRAParam(column_norms(flat).astype(pdt), axes=(weight.axes[n],))
            setattr(self, name, module)

    def key(self, dropout_key: jax.Array | None) -> jax.Array | None:
        """The adapters' dropout key from the module's (None: no adapter dropout, or not training).
        A tag folded in keeps the model's own dropout masks what they are without adapters."""
        return None if dropout_key is None or not self.dropout.rate else jax.random.fold_in(
            dropout_key, LORA_STREAM)

    def apply(self, name: str, x: jax.Array, out: jax.Array, w: jax.Array,
              key: jax.Array | None = None) -> jax.Array:
        if name not in self.names or not self.active:
            return out
        module = getattr(self, name)
        dt = x.dtype
        if key is not None:  # each adapter its own mask, as PEFT gives each target its own dropout
            x = _drop(self.dropout, x, jax.random.fold_in(key, self.names.index(name)))
        low_rank = (x @ module.lora_a[...].astype(dt)) @ (self.scale * module.lora_b[...]).astype(dt)
        if not self.dora:
            return out + low_rank
        norms = jax.lax.stop_gradient(
            column_norms(w, module.lora_a[...], module.lora_b[...], self.scale))
        g = (module.magnitude[...].astype(jnp.float32) / norms).astype(dt)
        if key is None:
            return g * (out + low_rank)
        return out + (g - 1) * (x @ w.reshape(x.shape[-1], -1)) + g * low_rank


# model.lora.targets of a mixture of experts' experts (PEFT's target_parameters
# mlp.experts.gate_up_proj and mlp.experts.down_proj), and the projections each adapts
EXPERT_TARGETS = ("experts_gate_up", "experts_down")


class ExpertAdapters(nnx.Module):
    """``model.lora``'s adapters of a layer's experts, one low-rank pair per expert as PEFT's
    ``target_parameters`` adapts a fused expert tensor: ``experts_gate_up`` adds ``s A_e B_e`` to
    expert e's gate and up projections together (A_e [D, r], B_e [r, 2F]: gate's F columns, then
    up's), ``experts_down`` to its down projection (A_e [F, r], B_e [r, D]). Stored stacked over
    the experts (``{target}_a`` [E, in, r], ``{target}_b`` [E, r, out], ``nnx.LoRAParam``: they
    train, the experts stay frozen). B starts at 0: a new adapter adds nothing. PEFT refuses
    dropout and DoRA on such tensors, and so does seqjax (model.lora's check)."""

    def __init__(self, cfg: ModelConfig, experts: int, d: int, f: int, *, rngs: nnx.Rngs):
        lora = cfg.lora
        self.names = tuple(t for t in EXPERT_TARGETS if lora.rank and t in lora.targets)
        self.scale, self.active = lora.scale, True
        pdt = jnp.dtype(cfg.param_dtype)
        shapes = {"experts_gate_up": (d, 2 * f, "embed", "ff"), "experts_down": (f, d, "ff", "embed")}
        init = A_INITS[lora.init](lora.rank)
        for name in self.names:
            fan_in, fan_out, axis_in, axis_out = shapes[name]
            a = jax.vmap(lambda key: init(key, (fan_in, lora.rank), pdt))(jax.random.split(rngs.params(), experts))
            setattr(self, f"{name}_a", nnx.LoRAParam(a, axes=("experts", axis_in, "lora_rank")))
            setattr(self, f"{name}_b", nnx.LoRAParam(jnp.zeros((experts, lora.rank, fan_out), pdt),
                                                     axes=("experts", "lora_rank", axis_out)))

    def factors(self) -> dict[str, jax.Array]:
        """The active adapters' stacked factors (``{target}_a``, ``{target}_b``) and their scale
        (``scale``), as the dispatch reads them; empty with the adapters off."""
        if not self.active or not self.names:
            return {}
        out = {f"{n}_{s}": getattr(self, f"{n}_{s}")[...] for n in self.names for s in ("a", "b")}
        return {**out, "scale": self.scale}
