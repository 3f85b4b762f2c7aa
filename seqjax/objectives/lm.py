"""``train.objective=lm`` (the default): next-token cross-entropy, contract 3 (docs/design.md).

    loss = sum(weights * nll) / sum(weights)

plus PaLM's z-loss when ``train.z_loss`` > 0. Which targets count and how much is the batch's
``weights`` (``train.loss_normalization``: tokens or examples), so the objective itself is one sum.
"""

from __future__ import annotations

import jax.numpy as jnp

from seqjax.data.contract import Batch
from seqjax.model.context import row_spans
from seqjax.model.loss import chunked_lm_loss, lm_loss
from seqjax.objectives.base import Inputs, Objective, Terms


def lm_terms(inputs: Inputs, micro: Batch) -> Terms:
    """Contract 3's sums for one micro-batch; with ``model.loss_chunk_tokens`` the logits are never
    built whole."""
    model, z_loss = inputs.model, inputs.settings.get("z_loss", 0.0)
    outputs, head, _ = inputs.forward(micro)
    if head is None:
        loss, aux = lm_loss(outputs, micro["targets"], micro["weights"], z_loss=z_loss)
    else:
        loss, aux = chunked_lm_loss(outputs, head, micro["targets"], micro["weights"],
                                    chunk_tokens=model.cfg.loss_chunk_tokens, z_loss=z_loss,
                                    spans=row_spans(outputs))
    # lm_loss is a mean over this micro-batch's weights; times their sum it is a sum again
    return Terms(loss * aux["weight_sum"], aux["weight_sum"], aux["nll_sum"])


LM = Objective("lm", lm_terms, denominator=lambda batch: jnp.sum(batch["weights"].astype(jnp.float32)),
               settings=("z_loss",), doc="next-token cross-entropy on the scored targets (contract 3)")
