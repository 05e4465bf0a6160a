"""Poison job: a request whose forward raises (tests/reliability/poison_worker.py) fails alone, with the
reason; the rest of its batch is rerun without it and matches the reference; the worker lives on."""

from __future__ import annotations

import pytest
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from rqbatcher.client import Client, JobFailed
from tests.reliability.poison_worker import POISON_IDS
from tests.reliability.support import fetch, greedy, prompt_pool, record, reference

pytestmark = pytest.mark.timeout(300)


def test_a_poisoned_request_fails_alone_and_its_batch_finishes(shared_worker):
    w = shared_worker
    client = Client(w.connection, queue=w.queue)
    prompts = prompt_pool()[:8]
    good = client.submit_many([greedy(40, prompt_token_ids=p) for p in prompts[:4]])
    poison = client.submit(greedy(40, prompt_token_ids=[5, *POISON_IDS, 9]))
    more = client.submit_many([greedy(40, prompt_token_ids=p) for p in prompts[4:]])
    with pytest.raises(JobFailed) as failed:
        client.result(poison, timeout=120)
    assert "generation failed: RuntimeError: poisoned input" in failed.value.reason
    assert "Traceback" not in failed.value.reason
    assert poison in FailedJobRegistry(w.queue, connection=w.connection, serializer=JSONSerializer)
    assert fetch(w.connection, poison).retries_left == 0  # a bad request is not retried
    for job_id, prompt in zip(good + more, prompts):
        assert client.result(job_id, timeout=120).token_ids == reference(w.model_dir, prompt, 40)
    after = client.submit(greedy(8, prompt_token_ids=prompts[0]))  # the same worker serves on
    assert client.result(after, timeout=120).token_ids == reference(w.model_dir, prompts[0], 8)
    assert w.process.poll() is None
    isolations = w.log.read_text().count("isolating the culprit")
    record("poison", poisoned_jobs=1, batch_jobs=len(good + more), batch_isolations=isolations, worker_alive=True)
