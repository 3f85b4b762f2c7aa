"""The model: Transformer LM, segment-masked attention dispatch, loss and KV-cache decoding."""

from seqjax.model.transformer import TransformerLM, build_model, param_count

__all__ = ["TransformerLM", "build_model", "param_count"]
