"""The model: Transformer LM, segment-masked attention dispatch, loss and KV-cache decoding."""

from seqjax.model.transformer import BASE_PARAMS, TransformerLM, build_model, param_count, split_params

__all__ = ["BASE_PARAMS", "TransformerLM", "build_model", "param_count", "split_params"]
