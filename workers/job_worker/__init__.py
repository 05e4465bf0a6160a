"""The RQ worker that keeps many jobs in flight on one engine: its loop, admission by class, leases, streams,
job ends, the stats it publishes and its metrics. It never imports torch, and takes only the engine's API."""
