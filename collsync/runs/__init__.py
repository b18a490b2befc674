"""The run shapes of `collsync-train`, each a module: the simulator (`simulated`), the serverless replicas
(`replicas`: allreduce and partial allreduce, one skeleton) and the parameter-server shards (`shards`: the
shard engine `collsync.serving`, which also serves `collsync.torch`'s server ranks, with the trainer's extras);
their parts built once from the config (`parts`), and checkpoints and resumes (`resume`)."""
