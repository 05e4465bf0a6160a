"""Prometheus metrics of one worker's engine, and the HTTP endpoint that serves them.

Names follow vLLM's (`vllm:num_requests_running` becomes `batcher_num_requests_running`), so that
dashboards and alerts written for vLLM translate directly. Every series carries `model_name`;
the worker's identity comes from the scrape target (`instance`, `pod`), not from a label, so a
restarted worker does not start new series.

The worker calls, from its engine loop (through `worker_hooks`):
  - `observe_step(outputs)` after each `Engine.step()`: each output carries its request's times,
  - `observe_finished(request_id, reason, ...)` once for each request that ends, however it ends (before or
    after the step that produced its last token is observed: either way that token counts),
  - `set_queue_depth(queue, n)` whenever it has read a queue's length.
The gauges of the engine's state, and the prefix cache's counters, are read from the engine's stats snapshot
when Prometheus scrapes, so they cost the loop nothing and stay right while the engine is idle.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from rqbatcher.config import DEFAULT_METRICS_ADDR
from rqbatcher.schema import FinishReason

if TYPE_CHECKING:
    from http.server import HTTPServer

    from rqbatcher.workers.engine.api import EngineProtocol, RequestOutput


# A request that ended in an error rather than with one of the schema's finish reasons.
ERROR_REASON = "error"
FINISHED_REASONS = (*typing.get_args(FinishReason), ERROR_REASON)

# Histogram buckets, in seconds but for the batch size. A batch job's queue time and end-to-end
# latency run from under a second to a day.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                         0.75, 1.0, 2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                       80.0, 160.0, 640.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                           3600.0, 3 * 3600.0, 12 * 3600.0, 24 * 3600.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

MODEL_LABEL = "model_name"


class _PrefixCacheCollector:
    """vLLM's `prefix_cache_queries` and `prefix_cache_hits`, in tokens: prompt tokens looked up in the
    prefix cache when a request is first admitted, and those found there. Their rates' ratio is the hit rate.
    And `prefix_blocks_awaited`: blocks that requests waited for another's prefill to fill, rather than compute."""

    def __init__(self, engine: EngineProtocol) -> None:
        self._engine = engine

    def collect(self):
        stats = self._engine.stats().prefix_cache
        model = self._engine.loaded.name
        for name, doc, tokens in (
                ("batcher_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.queries),
                ("batcher_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", stats.hits)):
            family = CounterMetricFamily(name, doc, labels=[MODEL_LABEL])
            family.add_metric([model], tokens)
            yield family
        awaited = CounterMetricFamily("batcher_prefix_blocks_awaited", "Prompt blocks requests waited for another "
                                      "request's prefill in flight to fill, rather than compute them again.",
                                      labels=[MODEL_LABEL])
        awaited.add_metric([model], self._engine.stats().prefix_blocks_awaited)
        yield awaited


class EngineMetrics:
    """The metrics of one engine. One per process on the default registry; tests pass their own."""

    def __init__(self, engine: EngineProtocol, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._engine = engine
        self._last_token_times: dict[str, float] = {}  # by request, once it has its first token
        self._finished: set[str] = set()  # ended, tracked until the step that produced their last token is observed
        self._last_step_seen: int | None = None
        model = engine.loaded.name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, [MODEL_LABEL], registry=self.registry).labels(model)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, [MODEL_LABEL], registry=self.registry).labels(model)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, [MODEL_LABEL], buckets=buckets, registry=self.registry).labels(model)

        gauge("batcher_num_requests_running", "Requests in the engine's running batch.").set_function(
            lambda: engine.stats().num_running)
        gauge("batcher_num_requests_waiting", "Requests in the engine, waiting for a slot or KV blocks.").set_function(
            lambda: engine.stats().num_waiting)
        gauge("batcher_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).").set_function(
            lambda: engine.stats().kv_cache_usage)
        self.registry.register(_PrefixCacheCollector(engine))
        stats = engine.stats()
        Gauge("batcher_engine_info", "How the engine runs, as labels (the value is 1): the dtype of the model, and "
              "its linears' quantization (none, int8).", [MODEL_LABEL, "dtype", "quantization"],
              registry=self.registry).labels(model, stats.dtype, stats.quantization).set(1)
        self._queue_depth = Gauge("batcher_queue_depth", "Jobs waiting in a Redis queue, as this worker last read it.",
                                  ["queue"], registry=self.registry)

        self._ttft = histogram("batcher_time_to_first_token_seconds",
                               "From arrival in the engine to the first generated token.", FIRST_TOKEN_BUCKETS)
        self._itl = histogram("batcher_inter_token_latency_seconds",
                              "Between two consecutive generated tokens of one request.", TOKEN_LATENCY_BUCKETS)
        self._queue_time = histogram("batcher_request_queue_time_seconds",
                                     "From enqueue in Redis to admission into the engine.", REQUEST_LATENCY_BUCKETS)
        self._e2e = histogram("batcher_e2e_request_latency_seconds",
                              "From enqueue in Redis to the end of the request.", REQUEST_LATENCY_BUCKETS)
        self._step_duration = histogram("batcher_step_duration_seconds",
                                        "Wall time of one engine step: schedule, forward, sample.",
                                        TOKEN_LATENCY_BUCKETS)
        self._batch_size = histogram("batcher_batch_size", "Sequences computed in one engine step.",
                                     BATCH_SIZE_BUCKETS)

        self._prompt_tokens = counter("batcher_prompt_tokens_total",
                                      "Prompt tokens of requests that started generating.")
        self._generation_tokens = counter("batcher_generation_tokens_total", "Generated tokens.")
        self._preemptions = counter("batcher_num_preemptions_total",
                                    "Sequences preempted (KV blocks freed, to be recomputed).")
        success = Counter("batcher_request_success_total", "Requests that ended, by finish reason.",
                          [MODEL_LABEL, "finished_reason"], registry=self.registry)
        # Every reason exists from the start at 0, so rate() sees the first request of each.
        self._by_reason = {reason: success.labels(model, reason) for reason in FINISHED_REASONS}

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Record the step the engine has just run and the tokens it produced, by the engine's own timestamps
        (each output carries its request's times and one new token)."""
        stats = self._engine.stats().last_step
        if stats is not None and stats.step != self._last_step_seen:  # step() had nothing to run otherwise
            self._last_step_seen = stats.step
            self._step_duration.observe(stats.duration_s)
            self._batch_size.observe(stats.num_seqs)
            if stats.num_preempted:
                self._preemptions.inc(stats.num_preempted)
        generated = 0
        for out in outputs:
            if not out.new_token_ids:
                continue
            generated += len(out.new_token_ids)
            previous = self._last_token_times.get(out.request_id)
            if previous is None:
                self._ttft.observe(out.first_token_time - out.arrival_time)
                self._prompt_tokens.inc(out.num_prompt_tokens)
            else:
                self._itl.observe(out.last_token_time - previous)
            self._last_token_times[out.request_id] = out.last_token_time
        if generated:
            self._generation_tokens.inc(generated)
        for request_id in self._finished:
            self._last_token_times.pop(request_id, None)
        self._finished.clear()

    def observe_finished(self, request_id: str, reason: str, queue_s: float | None = None,
                         e2e_s: float | None = None) -> None:
        """Count a request that ended (`reason`: a finish reason or "error") and forget it.

        `queue_s` (to admission) and `e2e_s` (to the end) are measured from the job's enqueue in
        Redis; None when unknown, as for a job that failed before it was admitted.
        """
        if reason not in self._by_reason:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {', '.join(FINISHED_REASONS)}")
        self._finished.add(request_id)
        self._by_reason[reason].inc()
        if queue_s is not None:
            self._queue_time.observe(queue_s)
        if e2e_s is not None:
            self._e2e.observe(e2e_s)

    def worker_hooks(self) -> dict:
        """The `on_step` and `on_job_end` hooks that feed these metrics from a JobWorker."""

        def on_step(worker, outputs: list[RequestOutput]) -> None:
            self.observe_step(outputs)
            for queue, depth in worker.queue_depths.items():
                self.set_queue_depth(queue, depth)

        def on_job_end(worker, end) -> None:
            if end.status == "lost":  # another worker runs it now and will count it
                self._last_token_times.pop(end.execution_id, None)
                return
            timings = end.result.timings if end.result is not None else None
            queue_s = timings.queue_s if timings else None
            e2e_s = queue_s + timings.total_s if timings and queue_s is not None and timings.total_s else None
            reason = {"finished": end.result.finish_reason if end.result else "error",
                      "stopped": "cancelled"}.get(end.status, ERROR_REASON)
            self.observe_finished(end.execution_id, reason, queue_s, e2e_s)

        return {"on_step": on_step, "on_job_end": on_job_end}

    def set_queue_depth(self, queue: str, depth: int) -> None:
        self._queue_depth.labels(queue).set(depth)

    def start_http_server(self, port: int, addr: str = DEFAULT_METRICS_ADDR) -> HTTPServer:
        """Serve /metrics from a daemon thread; port 0 picks a free port (see `server.server_port`)."""
        server, _thread = prometheus_client.start_http_server(port, addr, registry=self.registry)
        return server
