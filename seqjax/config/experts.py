"""``model.experts``: a mixture of experts in place of each block's gated MLP, its routing and
dispatch (seqjax.model.experts computes it; docs/model.md, "Mixture of experts"). A Hugging Face
folder's config.json fills it (seqjax.hf.families: Qwen3-MoE, Mixtral, gpt-oss)."""

from __future__ import annotations

from dataclasses import dataclass

from seqjax.config.fields import MODEL, setting
from seqjax.core.errors import ConfigError

ROUTERS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")
DISPATCHES = ("auto", "ragged_dot", "blocked", "dense")
AUX_LOSS_SCOPES = ("step", "micro_batch")


@dataclass(frozen=True)  # hashable: the model keeps it as static graph data
class ExpertsConfig:
    """``model.experts``: a mixture of experts in place of the gated MLP (``count`` > 0;
    docs/model.md, "Mixture of experts"). Each token goes to the ``top_k`` experts its router
    picks, none dropped; the router's auxiliary loss and z-loss are side terms of the forward,
    over real tokens only."""

    count: int = setting(0, "experts a layer holds (0: the gated MLP, a "
                            "dense model)", min=0, resume=MODEL)
    top_k: int = setting(2, "experts each token goes to (num_experts_per_tok)", min=1, resume=MODEL)
    d_ff: int | None = setting(None, "each expert's hidden width (moe_intermediate_size; null: "
                                     "model.d_ff)",
                               min=1, resume=MODEL)
    router: str = setting(
        "softmax_topk", "softmax_topk: a float32 softmax over every expert, then the top k (Qwen3-MoE, Mixtral); "
        "topk_softmax: the top k of the logits, then a softmax over those (gpt-oss)", choices=ROUTERS,
        resume=MODEL)
    norm_topk_prob: bool = setting(
        True, "softmax_topk: the k chosen probabilities renormalized to sum to 1 (Mixtral always; Qwen3-MoE's "
        "norm_topk_prob)", resume=MODEL)
    bias: bool = setting(False, "biases on the router and the experts' projections "
                                "(gpt-oss)", resume=MODEL)
    activation: str = setting(
        "swiglu", "the experts' gated activation: swiglu, silu(gate) * up; clamped_swiglu (gpt-oss): (up + 1) * "
        "gate * sigmoid(alpha * gate), the gate clamped from above and up to +-limit",
        choices=EXPERT_ACTIVATIONS, resume=MODEL)
    swiglu_limit: float = setting(7.0, "clamped_swiglu: the clamp (gpt-oss's swiglu_limit)", min=0.0, resume=MODEL)
    swiglu_alpha: float = setting(1.702, "clamped_swiglu: the sigmoid's slope (gpt-oss's "
                                         "swiglu_alpha)",
                                  min=0.0, resume=MODEL)
    shared_d_ff: int = setting(
        0, "a shared expert every token goes through beside its routed ones, this wide, its output times "
        "sigmoid(x w_shared_gate) (Qwen3.5-MoE's shared_expert_intermediate_size; 0: none)", min=0, resume=MODEL)
    dense_layers: list[int] = setting(
        [], "layers with the gated MLP instead of experts (Qwen3-MoE's "
            "mlp_only_layers)", resume=MODEL)
    aux_loss_coef: float = setting(
        0.0, "the router's load-balancing loss (transformers' load_balancing_loss_func, pooled over the "
        "layers and real tokens of aux_loss_scope) times this joins the loss (router_aux_loss_coef when the "
        "folder's output_router_logits is set; 0: logged, not trained)", min=0.0)
    z_loss_coef: float = setting(
        0.0, "the router's z-loss (mean over the real tokens and layers of aux_loss_scope of "
        "logsumexp(router logits)^2) times this joins the loss (0: logged, not trained)", min=0.0)
    aux_loss_scope: str = setting(
        "step", "the tokens the router's losses pool: step, every micro-batch of the step (one forward "
        "pass more, routing only, when train.grad_accum > 1 and a coefficient is above 0: the gradient does "
        "not change with the micro-batch split); micro_batch, each micro-batch's own, averaged over the "
        "step's (Megatron's; no extra pass)", choices=AUX_LOSS_SCOPES)
    dispatch: str = setting(
        "auto", "how tokens reach their experts: ragged_dot (sorted by expert, one grouped matmul: "
        "jax.lax.ragged_dot), blocked (sorted by expert, padded to 64-row blocks, one batched matmul over "
        "blocks), dense (every expert on every token, weighted: the reference); auto: blocked on the CPU, "
        "ragged_dot elsewhere (BENCHMARKS.md, Mixture of experts)",
        choices=DISPATCHES)

    @property
    def enabled(self) -> bool:
        return self.count > 0

    def check(self, n_layers: int) -> None:
        if not self.enabled:
            return
        if self.top_k > self.count:
            raise ConfigError(f"model.experts.top_k: got {self.top_k}, expected at most "
                              f"model.experts.count={self.count}")
        bad = [i for i in self.dense_layers if not 0 <= i < n_layers]
        if bad:
            raise ConfigError(f"model.experts.dense_layers: got layer {bad[0]}, expected layers 0 "
                              f"to {n_layers - 1}")
