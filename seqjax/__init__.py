"""seqjax: a JAX language-model training stack that is careful about how sequences are cut, packed
and batched."""
