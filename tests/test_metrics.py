"""The worker's Prometheus metrics: the names and labels dashboards rely on, and a real engine's
values moving on /metrics, scraped over HTTP while its requests run."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from rqbatcher.config import EngineConfig
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.engine import build_engine
from rqbatcher.workers.job_worker.engine_metrics import DEFAULT_METRICS_ADDR, FINISHED_REASONS, EngineMetrics
from tests.jobs_support import keep_signal_handlers_fixture  # noqa: F401

NUM_REQUESTS = 5
MAX_TOKENS = 12
PROMPT_LEN = 10
BLOCK_SIZE = 4
QUEUE_S, E2E_S = 0.5, 2.0

# Exposed family name -> (type, label names). Dashboards and alerts are written against these.
EXPECTED_METRICS = {
    "batcher_num_requests_running": ("gauge", {"model_name"}),
    "batcher_num_requests_waiting": ("gauge", {"model_name"}),
    "batcher_kv_cache_usage_perc": ("gauge", {"model_name"}),
    "batcher_engine_info": ("gauge", {"model_name", "dtype", "quantization"}),
    "batcher_queue_depth": ("gauge", {"queue"}),
    "batcher_time_to_first_token_seconds": ("histogram", {"model_name"}),
    "batcher_inter_token_latency_seconds": ("histogram", {"model_name"}),
    "batcher_request_queue_time_seconds": ("histogram", {"model_name"}),
    "batcher_e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "batcher_step_duration_seconds": ("histogram", {"model_name"}),
    "batcher_batch_size": ("histogram", {"model_name"}),
    "batcher_prompt_tokens_total": ("counter", {"model_name"}),
    "batcher_generation_tokens_total": ("counter", {"model_name"}),
    "batcher_num_preemptions_total": ("counter", {"model_name"}),
    "batcher_prefix_cache_queries_total": ("counter", {"model_name"}),
    "batcher_prefix_cache_hits_total": ("counter", {"model_name"}),
    "batcher_prefix_blocks_awaited_total": ("counter", {"model_name"}),
    "batcher_request_success_total": ("counter", {"model_name", "finished_reason"}),
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # 3 slots for 5 requests, so some wait; 10 blocks of 4 tokens hold 3 prompts (sharing two blocks)
    # but not their outputs, so decoding preempts.
    return build_engine(EngineConfig(model=str(tiny_model_dir("llama")), max_num_seqs=3, block_size=BLOCK_SIZE,
                                     num_blocks=10, max_num_batched_tokens=32, device="cpu",
                                     dtype="float32"))


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_names_types_and_labels(engine):
    registry = CollectorRegistry()
    metrics = EngineMetrics(engine, registry)
    metrics.set_queue_depth("default", 0)
    found = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        found[name] = (family.type, labels)
    assert found == EXPECTED_METRICS
    reasons = {s.labels["finished_reason"] for f in registry.collect() if f.name == "batcher_request_success"
               for s in f.samples if s.name.endswith("_total")}
    assert reasons == set(FINISHED_REASONS) == {"stop", "length", "cancelled", "timeout", "error"}
    model_names = {s.labels.get("model_name") for f in registry.collect() for s in f.samples} - {None}
    assert model_names == {engine.loaded.name}
    info = [s for f in registry.collect() if f.name == "batcher_engine_info" for s in f.samples]
    assert [(s.labels["dtype"], s.labels["quantization"], s.value) for s in info] == [("float32", "none", 1.0)]


def test_unknown_finish_reason_is_refused(engine):
    metrics = EngineMetrics(engine, CollectorRegistry())
    with pytest.raises(ValueError, match="unknown finish reason"):
        metrics.observe_finished("r0", "exploded")


def test_http_scrape_while_requests_run(engine):
    registry = CollectorRegistry()
    metrics = EngineMetrics(engine, registry)
    server = metrics.start_http_server(0)
    assert server.server_address[0] == DEFAULT_METRICS_ADDR
    url = f"http://{DEFAULT_METRICS_ADDR}:{server.server_port}/metrics"
    model = engine.loaded.name
    try:
        before = scrape(url)
        assert value(before, "batcher_num_requests_running", model_name=model) == 0
        assert value(before, "batcher_generation_tokens_total", model_name=model) == 0

        request = GenerationRequest(prompt_token_ids=list(range(5, 5 + PROMPT_LEN)),
                                    sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        for i in range(NUM_REQUESTS):
            engine.add(f"r{i}", request)
        metrics.set_queue_depth("default", 7)
        first_step = engine.step_index
        during, preempted, seqs_per_step = [], 0, 0
        while engine.has_work():
            outputs = engine.step()
            metrics.observe_step(outputs)
            preempted += engine.last_step.num_preempted
            seqs_per_step += engine.last_step.num_seqs
            for out in outputs:
                if out.finished:
                    metrics.observe_finished(out.request_id, out.finish_reason, queue_s=QUEUE_S, e2e_s=E2E_S)
            during.append(scrape(url))
        metrics.observe_step([])  # a call with no new step in between counts nothing twice
        after = scrape(url)
    finally:
        server.shutdown()
        server.server_close()

    steps = engine.step_index - first_step
    assert len(during) == steps > MAX_TOKENS

    def series(name, **labels):
        return [value(s, name, model_name=model, **labels) for s in during]

    generated = series("batcher_generation_tokens_total")
    assert generated == sorted(generated) and generated[0] < generated[-1]
    assert max(series("batcher_num_requests_running")) == 3
    assert max(series("batcher_num_requests_waiting")) >= NUM_REQUESTS - 3
    assert max(series("batcher_kv_cache_usage_perc")) > 0.5
    assert len(set(series("batcher_time_to_first_token_seconds_count"))) > 1

    total_tokens = NUM_REQUESTS * MAX_TOKENS
    assert value(after, "batcher_generation_tokens_total", model_name=model) == total_tokens
    assert value(after, "batcher_prompt_tokens_total", model_name=model) == NUM_REQUESTS * PROMPT_LEN
    # the same prompt each time: all but the first find its full blocks but the last token's in the cache
    assert value(after, "batcher_prefix_cache_queries_total", model_name=model) == NUM_REQUESTS * PROMPT_LEN
    cached = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert value(after, "batcher_prefix_cache_hits_total", model_name=model) == (NUM_REQUESTS - 1) * cached
    assert value(after, "batcher_time_to_first_token_seconds_count", model_name=model) == NUM_REQUESTS
    assert value(after, "batcher_inter_token_latency_seconds_count", model_name=model) == total_tokens - NUM_REQUESTS
    assert value(after, "batcher_inter_token_latency_seconds_sum", model_name=model) > 0
    assert value(after, "batcher_step_duration_seconds_count", model_name=model) == steps
    assert value(after, "batcher_batch_size_count", model_name=model) == steps
    assert value(after, "batcher_batch_size_sum", model_name=model) == seqs_per_step
    assert preempted > 0
    assert value(after, "batcher_num_preemptions_total", model_name=model) == preempted
    assert value(after, "batcher_request_success_total", model_name=model, finished_reason="length") == NUM_REQUESTS
    assert value(after, "batcher_request_success_total", model_name=model, finished_reason="stop") == 0
    assert value(after, "batcher_request_queue_time_seconds_sum", model_name=model) == NUM_REQUESTS * QUEUE_S
    assert value(after, "batcher_e2e_request_latency_seconds_count", model_name=model) == NUM_REQUESTS
    assert value(after, "batcher_queue_depth", queue="default") == 7
    assert value(after, "batcher_num_requests_running", model_name=model) == 0
    assert value(after, "batcher_num_requests_waiting", model_name=model) == 0
    assert value(after, "batcher_kv_cache_usage_perc", model_name=model) == 0


@pytest.mark.usefixtures("keep_signal_handlers")
def test_a_worker_counts_every_token_of_every_job_exactly(tiny_model_dir):
    """Jobs of 1, 2, 3 and 10 tokens through a worker: one time to first token each, `tokens - 1` gaps each,
    and the token counters equal the jobs' usage (the last token of a job counts too)."""
    from rqbatcher.client import Client
    from rqbatcher.workers.job_worker.worker import JobWorker
    from tests.jobs_support import embedded_redis

    connection = embedded_redis()
    engine = build_engine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu"))
    registry = CollectorRegistry()
    metrics = EngineMetrics(engine, registry)
    client = Client(connection, queue="m")
    lengths = [1, 2, 3, 10]
    ids = client.submit_many([GenerationRequest(prompt_token_ids=[5 + i] * (3 + i),
                                                sampling=SamplingParams(max_tokens=n, ignore_eos=True))
                              for i, n in enumerate(lengths)])
    JobWorker(["m"], engine, connection=connection, **metrics.worker_hooks()).work(burst=True)
    usages = [client.result(job_id, timeout=10).usage for job_id in ids]

    def sample(name: str, **labels) -> float:
        return registry.get_sample_value(name, {"model_name": engine.loaded.name, **labels})

    assert sample("batcher_time_to_first_token_seconds_count") == len(lengths)
    assert sample("batcher_inter_token_latency_seconds_count") == sum(n - 1 for n in lengths)
    assert sample("batcher_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert sample("batcher_generation_tokens_total") == sum(u.completion_tokens for u in usages) == sum(lengths)
    assert sample("batcher_request_success_total", finished_reason="length") == len(lengths)
    assert sample("batcher_e2e_request_latency_seconds_count") == len(lengths)
