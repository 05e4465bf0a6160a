"""The GPU-side runtime: model loading, the engine, and the Redis worker."""
