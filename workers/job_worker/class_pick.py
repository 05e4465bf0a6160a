"""Admission by urgency: which queues a worker takes from, in which order, and how many jobs.

A worker is started on its interactive queues (`keys.priority_queue_names`); the queues of the priority
and batch classes of its bases (a batch queue per tenant) are found in their registry
(`keys.class_queues_key`) at every admission scan and become queues of the worker, so its lease recovery,
stranded-job requeue and RQ maintenance cover them as any other. One pick (`rqbatcher.jobs.fairness.Picker`, a Lua
script) then takes, atomically across workers:
- first, up to the engine's `batch_deficit` batch jobs, the batch class's minimum share of the slots;
- then the most urgent waiting work: priority, interactive, batch lines whose window is about to close, then
  batch, each by level, and each job from the tenant with the least service (VTC);
- up to the engine's free slots, and for priority and interactive work up to `urgent_room` more: the engine
  takes them into its waiting queue and preempts as many running batch sequences (bounded by the batch
  work above its minimum share). How many batch lines are queued never delays an interactive job;
- then up to the engine's `fair_room` interactive jobs of tenants that hold no slot of the worker: the engine
  preempts one sequence of the most-served tenant for each, so that one tenant's wave of chat requests never
  holds every slot while another tenant waits.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from rqbatcher.jobs import keys
from rqbatcher.jobs.fairness import Candidate, Picker
from rqbatcher.jobs.queues import parse_queue, tenant_token
from rqbatcher.jobs.redis_text import as_text
from rqbatcher.jobs.rq_adapter import taken_list_key
from rqbatcher.service_class import BATCH, CLASSES, INTERACTIVE, class_of

GROUP_RANK = 1_000_000  # a candidate's group: class rank, then level, then the routed queue's position
GROUP_LEVEL = 1_000


class ClassAdmission:
    """The class queues of one worker and its pick. `worker` is a JobWorker (its `queues` grow here)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        routed: list[str] = []
        for queue in worker.queues:
            name = keys.unprioritised(queue.name)
            if name not in routed:
                routed.append(name)
        self.routed = routed  # in the worker's order: per base, its model queue first, then the base
        self.bases = list(dict.fromkeys(keys.base_queue(name) for name in routed))
        self._picker = Picker(worker.connection)
        self._known = {queue.name for queue in worker.queues}
        self._candidates: list[tuple[Candidate, object]] = []
        self._refresh(worker.queues)

    def read_on(self, pipe) -> None:
        """Queue the reads of the class-queue registries (on the admission scan's pipeline)."""
        for base in self.bases:
            pipe.smembers(keys.class_queues_key(base))

    def update(self, registries: list) -> bool:
        """Take in the registries `read_on` read: a new class queue of this worker's becomes one of its queues.
        Whether one did."""
        found = {as_text(name) for names in registries for name in names}
        new = sorted(name for name in found - self._known if keys.unprioritised(name) in self.routed)
        if not new:
            return False
        worker = self.worker
        queues = [worker.queue_class(name, connection=worker.connection, serializer=worker.serializer) for name in new]
        worker.queues = worker.queues + queues  # rebound, not grown in place: the keeper's thread iterates it
        self._known.update(new)
        self._refresh(worker.queues)
        return True

    def empty_depths(self) -> dict[str, int]:
        """What `pick` reports of the queues when none holds a job."""
        return {queue.name: 0 for _, queue in self._candidates}

    def pick(self, free: int, extra: int, batch_first: int, fair_extra: int = 0, holding: frozenset[str] = frozenset()
             ) -> tuple[dict[str, int], list[tuple[object, list[tuple[str, str]]]]]:
        """({queue name: depth before}, [(queue, [(job id, tenant charged)])]): the jobs taken are in the queues'
        intermediate lists, and each one's tenant was charged the pick's advance. `holding`: the tenant tokens
        of the jobs in flight."""
        candidates = [c for c, _ in self._candidates]
        lengths, taken = self._picker.pick(candidates, free, extra, batch_first, fair_extra=fair_extra,
                                           holding=holding)
        depths = {queue.name: n for (_, queue), n in zip(self._candidates, lengths)}
        by_queue: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for index, job_id, tenant in taken:
            by_queue[index].append((job_id, tenant))
        return depths, [(self._candidates[i][1], jobs) for i, jobs in by_queue.items()]

    def _refresh(self, queues: list) -> None:
        rows = []
        for queue in queues:
            parsed = parse_queue(queue.name)
            if parsed.routed not in self.routed:
                continue
            position = self.routed.index(parsed.routed)
            batch = parsed.service_class == BATCH
            if batch:  # one group for the tenants of a base, whatever model queue they came through
                position = self.bases.index(keys.base_queue(parsed.routed))
            group = parsed.rank * GROUP_RANK + parsed.level * GROUP_LEVEL + position
            base = keys.base_queue(parsed.routed)
            candidate = Candidate(queue.key, taken_list_key(queue), keys.fairness_key(base, parsed.service_class),
                                  keys.job_tenants_key(base), keys.due_key(queue.name),
                                  keys.waiting_tenants_key(queue.name), group, batch,
                                  parsed.tenant or tenant_token(None), parsed.service_class == INTERACTIVE)
            rows.append((candidate, queue))
        self._candidates = sorted(rows, key=lambda row: (row[0].group,
                                                         self.routed.index(parse_queue(row[1].name).routed)))


def in_flight_by_class(in_flight) -> str:
    """How many jobs in flight run in each class, most urgent first (what `batcher workers` shows)."""
    counts = Counter(class_of(f.request) if f.request is not None else INTERACTIVE for f in in_flight)
    return ",".join(f"{c}={counts[c]}" for c in CLASSES if counts[c])
