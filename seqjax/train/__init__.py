"""Training: optimizer, train step, checkpoints, sharding, metrics and the ``python -m
seqjax.train`` loop."""
