"""Process groups and collectives: the parallel context, counted collectives, context parallelism, the batch launcher."""
