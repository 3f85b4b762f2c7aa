"""The model: Transformer LM, segment-masked attention dispatch, loss and KV-cache decoding."""

from seqjax.model.lora import BASE_PARAMS, split_params
from seqjax.model.transformer import TransformerLM, build_model, param_count

__all__ = ["BASE_PARAMS", "TransformerLM", "build_model", "param_count", "split_params"]
