"""Requests become RQ jobs: on the right queue (the model's queue, the priority level), with the client's
TTLs, under backpressure. The client and batch ingestion both enqueue through an `Enqueuer`.

Jobs are plain RQ jobs (`rqbatcher.jobs.generate`, JSON serializer), so rq's own tools see them too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from redis import Redis

from rqbatcher.errors import BatcherError
from rqbatcher.jobs import durability, keys
from rqbatcher.jobs.contract import JOB_FUNCTION, job_argument
from rqbatcher.jobs.fairness import note_on
from rqbatcher.jobs.queues import backlog_add_on, class_queue, parse_queue
from rqbatcher.jobs.rq_adapter import Job, Queue, rq_queue
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import INTERACTIVE, class_of

DEFAULT_RESULT_TTL_S = 24 * 3600  # how long a result (and its stream) stays readable
DEFAULT_FAILURE_TTL_S = 7 * 24 * 3600  # how long a failure (its reason, its stream) stays readable
DEFAULT_QUEUE_TTL_S = 24 * 3600  # the longest a job may wait in the queue before RQ drops it
DEFAULT_MAX_QUEUE_LENGTH = 100_000  # refuse to enqueue beyond this many waiting jobs in one queue
DESCRIPTION_CHARS = 60


class QueueFull(BatcherError, RuntimeError):
    """Backpressure: the queue holds more jobs than the client's `max_queue_length`."""


Prepared = tuple[str, tuple]  # (the RQ queue's name, RQ's enqueue data)


@dataclass
class Enqueuer:
    """Enqueues the requests of one base queue (its priority levels are `queue.pN`, its models' queues
    `queue__<model>`)."""

    connection: Redis
    queue: str
    result_ttl: int = DEFAULT_RESULT_TTL_S
    failure_ttl: int = DEFAULT_FAILURE_TTL_S
    queue_ttl: int = DEFAULT_QUEUE_TTL_S
    max_queue_length: int | None = DEFAULT_MAX_QUEUE_LENGTH
    replica_wait: durability.ReplicaWait | None = None  # None: the process's (--wait-replicas, $BATCHER_WAIT_REPLICAS)
    _queues: dict[str, Queue] = field(default_factory=dict, repr=False)

    def submit(self, requests: list[GenerationRequest], job_ids: list[str] | None = None) -> list[str]:
        """Enqueue `requests` in one transaction, all or none; return their job ids in order."""
        if job_ids is not None and len(job_ids) != len(requests):
            raise ValueError(f"got {len(job_ids)} job ids for {len(requests)} requests")
        prepared = [self.prepare(request, None if job_ids is None else keys.check_job_id(job_ids[i]), self.queue_ttl)
                    for i, request in enumerate(requests)]
        self.check_room(Counter(name for name, _ in prepared))
        with self.connection.pipeline() as pipe:
            jobs = self.enqueue_on(pipe, requests, prepared)
            pipe.execute()
        self.confirm(jobs, f"the enqueue of {len(jobs)} jobs")
        return [job.id for job in jobs]

    def confirm(self, jobs: list[Job], what: str) -> None:
        """Return once a replica holds the jobs just enqueued (`rqbatcher.jobs.durability`); raise NotReplicated if none
        does in time."""
        ids = [job.id for job in jobs]
        durability.confirm(self.connection, what, self.replica_wait, present=lambda: self._all_exist(ids))

    def _all_exist(self, job_ids: list[str]) -> bool:
        return not job_ids or self.connection.exists(*(Job.key_for(job_id) for job_id in job_ids)) == len(job_ids)

    def prepare(self, request: GenerationRequest, job_id: str | None, queue_ttl: int) -> Prepared:
        """Where one request goes, and the job RQ will store: a request that names a `model` goes to that
        model's queue, which only workers serving the model poll; one without runs on any worker of the queue.
        Its service class (and, for batch work, its tenant) picks the queue of that class (`service_class`)."""
        base = self.queue if request.model is None else keys.model_queue(self.queue, request.model)
        return class_queue(base, class_of(request), request.priority, request.tenant), Queue.prepare_data(
            JOB_FUNCTION,
            args=(job_argument(request),),
            description=description(request),
            job_id=job_id,
            result_ttl=self.result_ttl,
            failure_ttl=self.failure_ttl,
            ttl=queue_ttl,
        )

    def enqueue_on(self, pipe, requests: list[GenerationRequest], prepared: list[Prepared]) -> list[Job]:
        """Queue the jobs on `pipe`, and name each model queue they use (for `batcher queues`)."""
        models = {keys.model_queue(self.queue, r.model): r.model for r in requests if r.model is not None}
        if models:
            pipe.hset(keys.MODEL_QUEUES, mapping=models)
        classed = {name for name, _ in prepared if parse_queue(name).service_class != INTERACTIVE}
        if classed:  # queues of a class or a tenant: workers and `batcher queues` find them here
            pipe.sadd(keys.class_queues_key(self.queue), *classed)
        jobs = [self.rq_queue(name).enqueue_many([data], pipeline=pipe)[0] for name, data in prepared]
        for (name, _), job in zip(prepared, jobs):
            backlog_add_on(pipe, name, {job.id: job.ttl})  # what an autoscaler counts of the batch queues
        noted = [(name, request, job.id) for request, (name, _), job in zip(requests, prepared, jobs)]
        note_on(pipe, self.queue, noted, max([self.queue_ttl] + [job.ttl or 0 for job in jobs]))
        return jobs

    def check_room(self, adding: dict[str, int]) -> None:
        """Backpressure (a soft limit: producers racing each other may pass it by a few jobs)."""
        if self.max_queue_length is None:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for name in adding:
                pipe.llen(self.rq_queue(name).key)
            lengths = pipe.execute()
        for (name, n), length in zip(adding.items(), lengths):
            if length + n > self.max_queue_length:
                raise QueueFull(f"queue {name} holds {length} jobs; adding {n} would pass the limit of "
                                f"{self.max_queue_length}")

    def rq_queue(self, name: str) -> Queue:
        if name not in self._queues:
            self._queues[name] = rq_queue(name, self.connection)
        return self._queues[name]


def as_request(request: GenerationRequest | str | dict) -> GenerationRequest:
    """A request from a GenerationRequest, its dict, or a bare prompt."""
    if isinstance(request, GenerationRequest):
        return request
    if isinstance(request, str):
        return GenerationRequest(prompt=request)
    return GenerationRequest.model_validate(request)


def description(request: GenerationRequest) -> str:
    """A short description for rq info and dashboards (RQ's default repeats the whole prompt)."""
    if request.prompt is not None:
        head = request.prompt
    elif request.messages is not None:
        head = request.messages[-1].content
    elif request.embed is not None:
        return f"embed: {len(request.embed)} inputs"
    else:
        head = f"{len(request.prompt_token_ids)} prompt tokens"
    head = " ".join(head.split())
    return f"generate: {head[:DESCRIPTION_CHARS]}{'...' if len(head) > DESCRIPTION_CHARS else ''}"
