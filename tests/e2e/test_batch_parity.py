"""End to end through the official `openai` SDK: the Batch API's parity fields against a real `batcher serve`, a
real `batcher worker` (a tiny Llama that generates and embeds) and the real Redis. A file's `expires_after`, a
batch's `output_expires_after` (the output file's expires_at, its real TTL, and a 404 past it), the batch's `usage`
(the sum of its output lines'), and batches of /v1/responses and /v1/embeddings lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest
from openai import OpenAI
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response

from rqbatcher.jobs import keys
from rqbatcher.jobs.admin import list_workers
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.reliability.support import free_port

pytestmark = pytest.mark.timeout(300)
QUEUE = "parity"
MODEL = "tiny-parity"
HOUR = 3600
TTL_SLACK_S = 30  # seconds between an expiry being set and the test reading its TTL, on a loaded machine
BATCH_END_S = 120
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def server(e2e_redis, tiny_model_dir, tmp_path_factory):
    """A worker that generates and embeds, and a gateway in front of it: (SDK client, Redis connection)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("parity")
    name, worker = start_worker(url, tiny_model_dir("llama"), QUEUE, logs / "worker.log", 8,
                                "--served-model-name", MODEL, "--task", "generate", "--task", "embed")
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                                "--queue", QUEUE], stdout=subprocess.DEVNULL, stderr=(logs / "gateway.log").open("w"))
    sdk = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        wait_ready(connection, name, worker)
        wait_for(lambda: name in [w.name for w in list_workers(connection)], 30, "the worker's stats")

        def serving() -> bool:
            assert gateway.poll() is None, (logs / "gateway.log").read_text()
            try:
                return MODEL in [m.id for m in sdk.models.list()]
            except openai.APIConnectionError:
                return False

        wait_for(serving, 60, "the gateway to list the worker's model")
        yield sdk, connection
    finally:
        stop(gateway)
        stop(worker)


def batch_file(url: str, bodies: list[dict]) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": {"model": MODEL, **b}})
                     for i, b in enumerate(bodies)).encode()


def run_batch(sdk: OpenAI, url: str, bodies: list[dict], **create):
    """Upload the lines, run them as one batch, and wait for its end: (the ended batch, its output lines)."""
    uploaded = sdk.files.create(file=("in.jsonl", batch_file(url, bodies)), purpose="batch")
    created = sdk.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h", **create)
    done = wait_for(lambda: (b := sdk.batches.retrieve(created.id)).status in ENDED and b, BATCH_END_S,
                    f"batch {created.id} to end")
    assert done.status == "completed" and done.request_counts.failed == 0, done
    return done, [json.loads(x) for x in sdk.files.content(done.output_file_id).text.splitlines()]


def test_files_and_batch_outputs_expire_as_asked_and_usage_sums_the_lines(server):
    sdk, connection = server
    kept = sdk.files.create(file=("x.jsonl", b"{}"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    assert kept.expires_at == kept.created_at + 2 * HOUR
    assert 2 * HOUR - TTL_SLACK_S <= connection.ttl(keys.file_key(kept.id)) <= 2 * HOUR
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("x.jsonl", b"{}"), purpose="batch", expires_after={"anchor": "created_at",
                                                                                  "seconds": 60})
    assert refused.value.param == "expires_after"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h",
                           output_expires_after={"anchor": "created_at", "seconds": 59})
    assert refused.value.param == "output_expires_after"

    chats = [{"messages": [{"role": "user", "content": f"request number {i}" * (1 + i)}], "max_tokens": 3 + i,
              "ignore_eos": True} for i in range(4)]
    done, out = run_batch(sdk, "/v1/chat/completions", chats,
                          output_expires_after={"anchor": "created_at", "seconds": HOUR})
    usages = [o["response"]["body"]["usage"] for o in out]
    assert done.usage is not None and done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert done.usage.output_tokens == sum(3 + i for i in range(4)) == sum(u["completion_tokens"] for u in usages)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.input_tokens_details.cached_tokens == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                for u in usages)
    output = sdk.files.retrieve(done.output_file_id)
    assert output.created_at == done.completed_at and output.expires_at == done.completed_at + HOUR
    assert HOUR - TTL_SLACK_S <= connection.ttl(keys.batch_lines_key(done.id)) <= HOUR

    connection.hset(keys.batch_key(done.id), "output_expires_at", int(time.time()) - 1)  # as an hour later
    for past in (lambda: sdk.files.retrieve(done.output_file_id), lambda: sdk.files.content(done.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            past()
    assert sdk.batches.retrieve(done.id).usage == done.usage  # the batch itself lives on


def test_batches_of_responses_and_of_embeddings_lines(server):
    sdk, _ = server
    asks = [{"input": f"Say something about queue {i}", "instructions": "Be brief", "max_output_tokens": 4}
            for i in range(3)]
    done, out = run_batch(sdk, "/v1/responses", asks)
    responses = [Response.model_validate(o["response"]["body"]) for o in out]
    assert [o["custom_id"] for o in out] == ["c0", "c1", "c2"]
    assert all(r.status in ("completed", "incomplete") and r.output_text is not None for r in responses)
    assert done.usage.output_tokens == sum(r.usage.output_tokens for r in responses)

    texts = [{"input": ["a queue", "a stack"]}, {"input": "a batch", "encoding_format": "float"}]
    done, out = run_batch(sdk, "/v1/embeddings", texts)
    lists = [CreateEmbeddingResponse.model_validate(o["response"]["body"]) for o in out]
    assert [len(e.data) for e in lists] == [2, 1] and lists[0].model == MODEL
    vectors = [d.embedding for e in lists for d in e.data]
    assert len({len(v) for v in vectors}) == 1 and all(isinstance(x, float) for v in vectors for x in v)
    assert done.usage.input_tokens == sum(e.usage.prompt_tokens for e in lists) and done.usage.output_tokens == 0
