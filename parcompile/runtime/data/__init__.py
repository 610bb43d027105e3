"""Training and evaluation data: sources, files, tokenized datasets, per-rank batches."""
