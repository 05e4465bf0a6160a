"""The Redis job system: keys and queue names, connections, enqueue, the fair pick, a job's life, end and stream,
and RQ's internals (rq_adapter.py, the only module that touches them).

`rqbatcher.jobs.generate` is the function every queued job names (contract.py), so it stays importable here: a
job enqueued before an upgrade still runs.
"""

from rqbatcher.jobs.contract import JOB_FUNCTION, generate

__all__ = ["JOB_FUNCTION", "generate"]
