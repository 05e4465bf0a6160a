"""Prometheus metrics per service class and per tenant, beside `workers.metrics.EngineMetrics`.

- `batcher_class_queue_time_seconds{service_class}`: from enqueue in Redis to admission;
- `batcher_class_time_to_first_token_seconds{service_class}`: from admission to the first token;
- `batcher_tenant_tokens_total{service_class, tenant, kind}`: prompt and generated tokens served, per tenant;
- `batcher_urgency_preemptions_total{service_class}`: sequences of a class preempted for more urgent work.
Tenants are labels only for the first MAX_TENANT_LABELS a worker sees; the rest count as `other`, so a pool
with thousands of keys keeps a bounded number of series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily

from batcher.service_class import CLASSES
from workers.metrics import FIRST_TOKEN_BUCKETS, MODEL_LABEL, REQUEST_LATENCY_BUCKETS

if TYPE_CHECKING:
    from batcher.scheduler import Sequence
    from workers.engine_api import EngineProtocol, RequestOutput

MAX_TENANT_LABELS = 20
OTHER_TENANT = "other"
NO_TENANT = "none"


class _UrgencyPreemptions:
    def __init__(self, engine: EngineProtocol) -> None:
        self._engine = engine

    def collect(self):
        family = CounterMetricFamily("batcher_urgency_preemptions", "Sequences preempted for more urgent work, by "
                                     "the class of the preempted sequence.", labels=[MODEL_LABEL, "service_class"])
        counts = self._engine.urgency_preemptions
        for service_class in CLASSES:
            family.add_metric([self._engine.loaded.name, service_class], counts.get(service_class, 0))
        yield family


class ClassMetrics:
    """Feeds from a BatchWorker's hooks (`worker_hooks`); one per process on the default registry."""

    def __init__(self, engine: EngineProtocol, registry: CollectorRegistry | None = None) -> None:
        registry = REGISTRY if registry is None else registry
        self._model = engine.loaded.name
        self._seqs: dict[str, Sequence] = {}
        self._first_seen: set[str] = set()
        self._tenants: set[str] = set()
        labels = [MODEL_LABEL, "service_class"]
        self._queue_time = Histogram("batcher_class_queue_time_seconds", "From enqueue in Redis to admission, "
                                     "by service class.", labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self._ttft = Histogram("batcher_class_time_to_first_token_seconds", "From admission into the engine to the "
                               "first token, by service class.", labels, buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self._tokens = Counter("batcher_tenant_tokens", "Tokens served, by class, tenant and kind (prompt, "
                               "generated).", [*labels, "tenant", "kind"], registry=registry)
        registry.register(_UrgencyPreemptions(engine))

    def tenant_label(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            return OTHER_TENANT
        self._tenants.add(tenant)
        return tenant

    def observe_added(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            seq = self._seqs.get(out.request_id)
            if seq is None or not out.new_token_ids or out.request_id in self._first_seen:
                continue
            self._first_seen.add(out.request_id)
            self._ttft.labels(self._model, seq.service_class).observe(seq.first_token_time - seq.arrival_time)

    def observe_end(self, end) -> None:
        seq = self._seqs.pop(end.execution_id, None)
        self._first_seen.discard(end.execution_id)
        if seq is None or end.status == "lost" or end.result is None:
            return
        service_class, usage, timings = seq.service_class, end.result.usage, end.result.timings
        if timings.queue_s is not None:
            self._queue_time.labels(self._model, service_class).observe(timings.queue_s)
        tenant = self.tenant_label(seq.tenant)
        self._tokens.labels(self._model, service_class, tenant, "prompt").inc(usage.prompt_tokens)
        self._tokens.labels(self._model, service_class, tenant, "generated").inc(usage.completion_tokens)

    def worker_hooks(self) -> dict:
        return {"on_added": lambda worker, seq: self.observe_added(seq),
                "on_step": lambda worker, outputs: self.observe_step(outputs),
                "on_job_end": lambda worker, end: self.observe_end(end)}


def combined_hooks(*hook_sets: dict) -> dict:
    """One BatchWorker hook of each kind that calls every given one in turn."""
    names = {name for hooks in hook_sets for name in hooks}

    def chain(name):
        hooks = [h[name] for h in hook_sets if name in h]
        return lambda worker, arg: [hook(worker, arg) for hook in hooks] and None

    return {name: chain(name) for name in names}
