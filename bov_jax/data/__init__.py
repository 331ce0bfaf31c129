"""Data layer: corpora as parquet shards, the sentencepiece tokenizer, and the grain pipeline."""
