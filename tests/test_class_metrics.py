"""Metrics per service class and tenant (workers/job_worker/class_metrics.py) on a real tiny engine, preempting for
urgency."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rqbatcher.schema import Timings
from rqbatcher.workers.job_worker import class_metrics
from rqbatcher.workers.job_worker.class_metrics import ClassMetrics, combined_hooks
from rqbatcher.workers.job_worker.in_flight import JobEnd
from rqbatcher.workers.scheduler.step_budget import BATCH_PROMPT_FLOOR
from tests.engine_helpers import engine_for, greedy, random_prompts


def test_queue_time_ttft_tokens_and_urgency_preemptions_by_class_and_tenant(tiny_model_dir):
    engine = engine_for(tiny_model_dir("llama"), max_num_seqs=2, min_batch_share=0.0)
    registry = CollectorRegistry()
    metrics = ClassMetrics(engine, registry)
    ended: list[str] = []
    hooks = combined_hooks(metrics.worker_hooks(), {"on_job_end": lambda worker, end: ended.append(end.job_id)})
    prompts = random_prompts(3, seed=3, min_len=4, max_len=8)
    requests = {"b0": greedy(prompts[0], 6).model_copy(update={"service_class": "batch", "tenant": "key-a"}),
                "b1": greedy(prompts[1], 6).model_copy(update={"service_class": "batch", "tenant": "key-b"})}
    for rid, request in requests.items():
        engine.add(rid, request)
    engine.step()
    requests["i0"] = greedy(prompts[2], 3)
    engine.add("i0", requests["i0"])  # no slot free: it preempts a batch sequence
    finals, mixes = {}, set()
    while engine.has_work():
        outputs = engine.step()
        hooks["on_step"](None, outputs)
        mixes.add(engine.stats().last_step.mix)
        finals.update({o.request_id: o for o in outputs if o.finished})
    for rid, out in finals.items():
        timings = Timings(queue_s=0.25, ttft_s=out.first_token_time - out.arrival_time)
        hooks["on_job_end"](None, JobEnd(rid, rid, "q", "finished", out.to_result(timings), request=requests[rid]))
    assert sorted(ended) == ["b0", "b1", "i0"]

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": engine.loaded.name, **labels})

    assert value("batcher_urgency_preemptions_total", service_class="batch") == 1
    assert value("batcher_fairness_preemptions_total") == 0
    assert mixes >= {"interactive+batch", "batch"}
    assert sum(value("batcher_step_seconds_count", mix=mix) for mix in mixes) == engine.step_index - 1, \
        "every step but the first (run before the hooks) is timed under its mix"
    budget = value("batcher_step_prompt_token_budget")
    assert BATCH_PROMPT_FLOOR <= budget <= engine.config.max_num_batched_tokens, "the measured target's, or the full"
    assert value("batcher_step_prompt_tokens_total", kind="urgent") == len(prompts[2]), "i0's prompt, once"
    assert value("batcher_step_prompt_tokens_total", kind="batch") > min(map(len, prompts[:2])), \
        "the preempted batch sequence's recompute, its prompt and a token (its first step ran before the hooks)"
    assert value("batcher_step_target_infeasible") == 0, "no target given: the measured one is never infeasible"
    assert value("batcher_class_queue_time_seconds_count", service_class="batch") == 2
    assert value("batcher_class_time_to_first_token_seconds_count", service_class="interactive") == 1
    assert value("batcher_tenant_tokens_total", service_class="batch", tenant="key-a", kind="generated") == 6
    assert (value("batcher_tenant_tokens_total", service_class="interactive", tenant="none", kind="prompt")
            == len(prompts[2]))


def test_tenant_labels_are_bounded():
    metrics = ClassMetrics.__new__(ClassMetrics)
    metrics._tenants = set()
    labels = [metrics.tenant_label(f"key-{i}") for i in range(class_metrics.MAX_TENANT_LABELS + 5)]
    assert len(set(labels)) == class_metrics.MAX_TENANT_LABELS + 1 and labels[-1] == class_metrics.OTHER_TENANT
    assert metrics.tenant_label("key-0") == "key-0"  # a tenant seen before keeps its label
