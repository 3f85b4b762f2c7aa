"""Text to token store: corpora read as documents, the tokenizer, instruction examples, and the
sharded, checksummed stores that prepare() builds and the batching stage reads."""
