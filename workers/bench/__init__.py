"""`batcher bench`: workloads (`workload`), the systems compared (`system`), how each one runs (`run` for
batcher, `through_redis` for batcher as jobs, `peers` for transformers), what a run records (`record`),
the metrics derived from it (`report`) and the picture (`plot`)."""
