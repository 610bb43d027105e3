"""The training step: the pipeline schedule executor, the optimizers and their sharding, gradient buckets, loss scaling, weight-gradient split, metrics."""
