"""Prometheus metrics per service class and per tenant, beside `workers.job_worker.engine_metrics.EngineMetrics`.

- `batcher_class_queue_time_seconds{service_class}`: from enqueue in Redis to admission;
- `batcher_class_time_to_first_token_seconds{service_class}`: from admission to the first token;
All of them are observed when a job ends, from its result's timings and usage and the request it carried.
- `batcher_tenant_tokens_total{service_class, tenant, kind}`: prompt and generated tokens served, per tenant;
- `batcher_urgency_preemptions_total{service_class}`: sequences of a class preempted for more urgent work;
- `batcher_fairness_preemptions_total`: interactive sequences preempted for another tenant's (apart from those);
- `batcher_step_seconds{mix}`: each step's wall time, by the classes of work it carried ("interactive+batch");
- `batcher_step_prompt_token_budget`: the batch prompt tokens the last step could take: the step-time target's
  while urgent work is about (workers/scheduler/step_budget.py), else the full token budget;
- `batcher_step_prompt_tokens_total{kind}`: prompt tokens the steps gave to urgent work (priority, interactive, and
  the prefills they wait for) and to batch work;
- `batcher_step_target_infeasible`: 1 while the given step-time target is below what the decodes alone cost (the
  measured target then runs), else 0.
Tenants are labels only for the first MAX_TENANT_LABELS a worker sees; the rest count as `other`, so a pool
with thousands of keys keeps a bounded number of series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from rqbatcher.service_class import CLASSES, class_of
from rqbatcher.workers.job_worker.engine_metrics import (
    FIRST_TOKEN_BUCKETS,
    MODEL_LABEL,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
)

if TYPE_CHECKING:
    from rqbatcher.workers.engine.api import EngineProtocol
    from rqbatcher.workers.job_worker.in_flight import JobEnd

MAX_TENANT_LABELS = 20
OTHER_TENANT = "other"
NO_TENANT = "none"


class _UrgencyPreemptions:
    def __init__(self, engine: EngineProtocol) -> None:
        self._engine = engine

    def collect(self):
        family = CounterMetricFamily("batcher_urgency_preemptions", "Sequences preempted for more urgent work, by "
                                     "the class of the preempted sequence.", labels=[MODEL_LABEL, "service_class"])
        stats = self._engine.stats()
        for service_class in CLASSES:
            family.add_metric([self._engine.loaded.name, service_class],
                              stats.urgency_preemptions.get(service_class, 0))
        yield family
        fairness = CounterMetricFamily("batcher_fairness_preemptions", "Interactive sequences preempted so that "
                                       "another tenant's waiting request gets a slot.", labels=[MODEL_LABEL])
        fairness.add_metric([self._engine.loaded.name], stats.fairness_preemptions)
        yield fairness


class ClassMetrics:
    """Feeds from a JobWorker's job-end hook (`worker_hooks`); one per process on the default registry."""

    def __init__(self, engine: EngineProtocol, registry: CollectorRegistry | None = None) -> None:
        registry = REGISTRY if registry is None else registry
        self._model = engine.loaded.name
        self._tenants: set[str] = set()
        labels = [MODEL_LABEL, "service_class"]
        self._queue_time = Histogram("batcher_class_queue_time_seconds", "From enqueue in Redis to admission, "
                                     "by service class.", labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self._ttft = Histogram("batcher_class_time_to_first_token_seconds", "From admission into the engine to the "
                               "first token, by service class.", labels, buckets=FIRST_TOKEN_BUCKETS, registry=registry)
        self._tokens = Counter("batcher_tenant_tokens", "Tokens served, by class, tenant and kind (prompt, "
                               "generated).", [*labels, "tenant", "kind"], registry=registry)
        self._step_seconds = Histogram("batcher_step_seconds", "Wall time of one engine step, by the classes of "
                                       "work it carried.", [MODEL_LABEL, "mix"], buckets=TOKEN_LATENCY_BUCKETS,
                                       registry=registry)
        self._budget = Gauge("batcher_step_prompt_token_budget", "Prompt tokens the last step could take: the "
                             "step-time target's while urgent work is about, else the full budget.", [MODEL_LABEL],
                             registry=registry).labels(self._model)
        self._prompt_tokens = Counter("batcher_step_prompt_tokens", "Prompt tokens the steps gave to urgent work "
                                      "(priority, interactive) and to batch work.", [MODEL_LABEL, "kind"],
                                      registry=registry)
        self._infeasible = Gauge("batcher_step_target_infeasible", "1 while the given step-time target is below what "
                                 "the decodes alone cost (the measured target runs instead).", [MODEL_LABEL],
                                 registry=registry).labels(self._model)
        self._engine = engine
        self._last_step_seen: int | None = None
        registry.register(_UrgencyPreemptions(engine))

    def tenant_label(self, tenant: str | None) -> str:
        if tenant is None:
            return NO_TENANT
        if tenant not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            return OTHER_TENANT
        self._tenants.add(tenant)
        return tenant

    def observe_end(self, end: JobEnd) -> None:
        if end.status == "lost" or end.result is None or end.request is None:
            return  # another worker counts it; or it never ran
        service_class, usage, timings = class_of(end.request), end.result.usage, end.result.timings
        if timings.queue_s is not None:
            self._queue_time.labels(self._model, service_class).observe(timings.queue_s)
        if timings.ttft_s is not None:
            self._ttft.labels(self._model, service_class).observe(timings.ttft_s)
        tenant = self.tenant_label(end.request.tenant)
        self._tokens.labels(self._model, service_class, tenant, "prompt").inc(usage.prompt_tokens)
        self._tokens.labels(self._model, service_class, tenant, "generated").inc(usage.completion_tokens)

    def observe_step(self) -> None:
        step = self._engine.stats().last_step
        if step is not None and step.step != self._last_step_seen and step.mix:
            self._last_step_seen = step.step
            self._step_seconds.labels(self._model, step.mix).observe(step.duration_s)
            self._budget.set(step.prompt_token_budget)
            self._prompt_tokens.labels(self._model, "urgent").inc(step.urgent_prompt_tokens)
            self._prompt_tokens.labels(self._model, "batch").inc(step.batch_prompt_tokens)
            self._infeasible.set(int(step.target_infeasible))

    def worker_hooks(self) -> dict:
        return {"on_job_end": lambda worker, end: self.observe_end(end),
                "on_step": lambda worker, outputs: self.observe_step()}


def combined_hooks(*hook_sets: dict) -> dict:
    """One JobWorker hook of each kind that calls every given one in turn."""
    names = {name for hooks in hook_sets for name in hooks}

    def chain(name):
        hooks = [h[name] for h in hook_sets if name in h]
        return lambda worker, arg: [hook(worker, arg) for hook in hooks] and None

    return {name: chain(name) for name in names}
