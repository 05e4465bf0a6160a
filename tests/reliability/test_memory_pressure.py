"""Memory pressure: a KV cache far smaller than the jobs' working set. A JobWorker (real engine,
tiny model) finishes every job through preemption and recompute, with the reference tokens."""

from __future__ import annotations

import pytest
import torch

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.engine_helpers import engine_for
from tests.jobs_support import keep_signal_handlers_fixture  # noqa: F401
from tests.reliability.support import RedisServer, greedy, prompt_pool, record, reference

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("keep_signal_handlers")]
NUM_BLOCKS, BLOCK_SIZE, MAX_TOKENS = 6, 16, 48


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: OpenMP's spinning threads cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_jobs_finish_through_preemption_with_a_tiny_kv_cache(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    server = RedisServer(tmp_path / "redis").start()
    try:
        prompts = prompt_pool()[:16]
        client = Client(server.connection(), queue="pressure")
        ids = client.submit_many([greedy(MAX_TOKENS, prompt_token_ids=p) for p in prompts])
        engine = engine_for(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=16)
        preempted = []
        worker = JobWorker(keys.priority_queue_names(["pressure"]), engine, connection=server.connection(),
                             on_step=lambda w, _: preempted.append(w.engine.last_step.num_preempted))
        assert worker.work(burst=True)
        working_set = sum(len(p) + MAX_TOKENS for p in prompts)
        cache = NUM_BLOCKS * BLOCK_SIZE
        assert working_set > 6 * cache
        assert sum(preempted) > 0
        for job_id, prompt in zip(ids, prompts):
            result = client.result(job_id, timeout=10)
            assert result.token_ids == reference(model_dir, prompt, MAX_TOKENS), job_id
        record("memory_pressure", jobs=len(ids), kv_cache_tokens=cache, working_set_tokens=working_set,
               preemptions=sum(preempted), jobs_lost=0, tokens_equal_reference=True)
    finally:
        server.stop()
