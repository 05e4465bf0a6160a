"""The figures a worker publishes for `batcher workers`: built from the worker's state with every heartbeat,
written to `keys.worker_stats_key(name)` (expiring soon after a dead worker's last one), removed at exit."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Protocol

from redis import Redis

from rqbatcher.jobs import keys
from rqbatcher.jobs.worker_stats import WorkerState, WorkerStats
from rqbatcher.workers.engine.api import EngineProtocol
from rqbatcher.workers.job_worker.class_pick import in_flight_by_class
from rqbatcher.workers.job_worker.in_flight import InFlightJobs

log = logging.getLogger(__name__)

STATS_TTL_LEASES = 2  # a worker's published stats outlive one missed heartbeat, not a dead worker


class PublishingWorker(Protocol):
    """What the publisher reads of a worker (`rqbatcher.workers.job_worker.worker.JobWorker`)."""

    name: str
    connection: Redis
    queues: list
    model_name: str
    lease_s: int
    engine: EngineProtocol
    jobs: InFlightJobs
    tokens_generated: int

    @property
    def drain_requested(self) -> bool: ...

    @property
    def suspended(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...


class StatsPublisher:
    def __init__(self, worker: PublishingWorker) -> None:
        self.worker = worker
        self._rate_mark = (time.monotonic(), 0)  # (when, tokens generated) at the last publication

    def write_on(self, pipe) -> None:
        """Queue the current figures on the heartbeat's pipeline; a failure to gather them never stops it."""
        worker = self.worker
        try:
            stats = self.current()
        except Exception:  # the figures are for people; the leases must be renewed regardless
            log.exception("worker %s: could not gather its stats", worker.name)
            return
        key = keys.worker_stats_key(worker.name)
        pipe.hset(key, mapping=stats.to_dict())
        pipe.expire(key, STATS_TTL_LEASES * worker.lease_s)
        pipe.sadd(keys.WORKERS_SET, worker.name)

    def current(self) -> WorkerStats:
        worker, engine = self.worker, self.worker.engine.stats()  # a snapshot
        moment, tokens = time.monotonic(), worker.tokens_generated
        since, before = self._rate_mark
        self._rate_mark = (moment, tokens)
        state: WorkerState
        if worker.drain_requested:
            state = "draining"
        elif worker.suspended:
            state = "suspended"
        else:
            state = "busy" if worker.num_in_flight else "idle"
        return WorkerStats(
            name=worker.name, host=socket.gethostname(), pid=os.getpid(),
            queues=",".join(sorted({keys.base_queue(q.name) for q in worker.queues})),
            model=worker.model_name, state=state, in_flight=worker.num_in_flight, free_slots=engine.free_slots,
            kv_usage=round(engine.kv_cache_usage, 4), dtype=engine.dtype,
            quantization=engine.quantization,
            tokens_per_s=round((tokens - before) / max(moment - since, 1e-9), 2), last_heartbeat=time.time(),
            prefix_cache_hit_rate=round(engine.prefix_cache.hit_rate, 4),
            in_flight_by_class=in_flight_by_class(worker.jobs.snapshot()),
            step_time_target_s=round(engine.step_time_target_s, 4), step_s=round(engine.recent_step_s, 4),
            step_target_infeasible=int(bool(engine.last_step and engine.last_step.target_infeasible)),
            urgent_prompt_tokens=engine.last_step.urgent_prompt_tokens if engine.last_step else 0,
            batch_prompt_tokens=engine.last_step.batch_prompt_tokens if engine.last_step else 0,
            prefix_blocks_awaited=engine.prefix_blocks_awaited,
            vocab_size=engine.vocab_size, tasks=engine.tasks, embedding_size=engine.embedding_size,
            matryoshka_dimensions=engine.matryoshka_dimensions, max_model_len=engine.max_model_len)

    def remove(self) -> None:
        worker = self.worker
        try:
            with worker.connection.pipeline() as pipe:
                pipe.delete(keys.worker_stats_key(worker.name))
                pipe.srem(keys.WORKERS_SET, worker.name)
                pipe.execute()
        except Exception:  # Redis gone at exit: the hash expires on its own
            log.warning("worker %s: could not remove its stats from Redis", worker.name)
