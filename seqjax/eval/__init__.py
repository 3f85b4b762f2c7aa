"""Scoring a model: perplexity in three units (evaluate.py), the evaluation protocols as contract
rows (windows.py), and the lm-evaluation-harness's wikitext task (lm_eval.py). ``python -m
seqjax.eval`` is the command."""
