"""Hugging Face folders in and out: config.json, safetensors shards and the tokenizer
(folders.py)."""
