"""`batcher bench`: workloads (`workload`), the systems run (`system`), how each one runs (`run` in this process,
`through_redis` as jobs), what a run records (`record`) and the metrics derived from it (`report`). The peers, the
roofline and the plots are in the checkout's benchmarks/, which imports this package (never the reverse)."""
