"""POST /v1/embeddings through the clients people use, unchanged: the official `openai` SDK and LangChain's
OpenAIEmbeddings, against a real `batcher serve` and the real Redis.

Most tests run on worker processes with the fake engine (tests/fake_engine.py): one serves EMBEDDER (it generates
and embeds, with vectors of EMBEDDING_SIZE that shorten to any length) and one serves WRITER (it only generates).
One test runs a real `batcher worker --task embed` on a tiny embedding model (tests/tiny_models.py), started with
the others and waited for only there."""

from __future__ import annotations

import base64
import math
import struct
import subprocess
import sys

import httpx
import openai
import pytest
from langchain_openai import OpenAIEmbeddings
from openai import OpenAI

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.jobs.admin import list_workers
from rqbatcher.jobs.worker_stats import WorkerStats
from tests.e2e.test_workers import start_worker, stop, wait_ready
from tests.jobs_support import wait_for
from tests.letter_engine import EMBEDDING_SIZE, letter_vector
from tests.reliability.support import free_port
from tests.tiny_models import build_embedding_model

pytestmark = pytest.mark.timeout(300)
QUEUE = "embeddings"
EMBEDDER, WRITER, REAL = "fake-embedder", "fake-writer", "tiny-embedder"
IDLE = "idle-embedder"  # published by a pretend worker that takes no job: its requests wait in their queue
REAL_SIZE = 64  # the tiny model's hidden size
REAL_CONTEXT = 512  # its max_position_embeddings
TEXTS = ["Queues carry jobs.", "Streams carry tokens."]
# Two workers in one process, each with a fake engine in a thread of its own (no signal handlers off the main one)
FAKE_WORKERS = """
import sys, threading
from rqbatcher.client import connect
from rqbatcher.jobs import keys
from tests.fake_engine import FakeEngine
from tests.letter_engine import LetterEngine
from rqbatcher.workers.job_worker.worker import JobWorker
url, queue, embedder, writer = sys.argv[1:]
for name, engine in ((embedder, FakeEngine()), (writer, LetterEngine(name=writer))):
    worker = JobWorker(keys.priority_queue_names([queue], model=name), engine, connection=connect(url),
                       model_name=name, lease_s=3)
    threading.Thread(target=worker.work, daemon=True).start()
threading.Event().wait()
"""


@pytest.fixture(scope="module")
def server(e2e_redis, tmp_path_factory):
    """The gateway in front of the fake workers, and the real worker still loading: (base url, real worker)."""
    url, connection = e2e_redis
    logs = tmp_path_factory.mktemp("embeddings")
    model_dir = build_embedding_model(tmp_path_factory.mktemp("embedding-model"))
    real_name, real = start_worker(url, model_dir, QUEUE, logs / "real.log", 4, "--served-model-name", REAL,
                                   "--task", "embed")
    fakes = subprocess.Popen([sys.executable, "-c", FAKE_WORKERS, url, QUEUE, EMBEDDER, WRITER],
                             stdout=subprocess.DEVNULL, stderr=(logs / "fakes.log").open("w"))
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "rqbatcher", "serve", "--port", str(port), "--redis-url", url,
                                "--queue", QUEUE], stdout=subprocess.DEVNULL, stderr=(logs / "gateway.log").open("w"))
    base = f"http://127.0.0.1:{port}/v1"
    try:
        def serving() -> bool:
            assert gateway.poll() is None, (logs / "gateway.log").read_text()
            assert fakes.poll() is None, (logs / "fakes.log").read_text()
            try:
                return {EMBEDDER, WRITER} <= {m.id for m in sdk(base).models.list()}
            except openai.APIConnectionError:
                return False

        wait_for(serving, 60, "the gateway to list the fake workers' models")
        yield base, lambda: (wait_ready(connection, real_name, real),
                             wait_for(lambda: REAL in [w.model for w in list_workers(connection)], 30,
                                      "the real worker's stats"))
    finally:
        for process in (gateway, fakes, real):
            stop(process)


def sdk(base: str) -> OpenAI:
    return OpenAI(base_url=base, api_key="unused", max_retries=0)


def decoded(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def close(found: list[float], expected: list[float]) -> bool:
    return len(found) == len(expected) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(found, expected))


def refusal(call, error=openai.BadRequestError) -> dict:
    with pytest.raises(error) as refused:
        call()
    return refused.value.body


def test_a_string_a_list_of_strings_and_token_ids_get_one_vector_each(server):
    client = sdk(server[0])
    cases = [("one text", ["one text"]), (TEXTS, TEXTS), ([72, 105], [[72, 105]]), ([[72, 105], [7]], [[72, 105], [7]])]
    for given, inputs in cases:
        answer = client.embeddings.create(model=EMBEDDER, input=given)  # the SDK asks for base64 and decodes it
        assert answer.model == EMBEDDER and [d.index for d in answer.data] == list(range(len(inputs)))
        for data, item in zip(answer.data, inputs):
            assert close(data.embedding, letter_vector(item))
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(i) for i in inputs)


def test_float_and_base64_carry_the_same_vectors_and_dimensions_shorten_them(server):
    client = sdk(server[0])
    floats = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="float")
    raw = client.embeddings.create(model=EMBEDDER, input=TEXTS, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)  # named explicitly, the SDK leaves it as sent
    assert [decoded(d.embedding) for d in raw.data] == [d.embedding for d in floats.data]
    assert all(close(d.embedding, letter_vector(t)) for d, t in zip(floats.data, TEXTS))
    short = client.embeddings.create(model=EMBEDDER, input=TEXTS, dimensions=3, encoding_format="float")
    assert all(close(d.embedding, letter_vector(t, 3)) for d, t in zip(short.data, TEXTS))
    body = client.embeddings.with_raw_response.create(model=EMBEDDER, input="x", encoding_format="float").http_response
    assert set(body.json()) == {"object", "data", "model", "usage"} and body.json()["object"] == "list"


def test_what_no_worker_can_answer_is_refused_before_it_is_queued(server):
    client = sdk(server[0])
    unknown = refusal(lambda: client.embeddings.create(model="no-such-model", input="x"), openai.NotFoundError)
    assert (unknown["code"], unknown["param"]) == ("model_not_found", "model")
    assert refusal(lambda: client.embeddings.create(model=WRITER, input="x"))["param"] == "model"
    anonymous = httpx.post(f"{server[0]}/embeddings", json={"input": "x"}, timeout=30)  # any worker: WRITER too
    assert anonymous.status_code == 400 and anonymous.json()["error"]["param"] == "model"
    too_long = refusal(lambda: client.embeddings.create(model=EMBEDDER, input="x", dimensions=EMBEDDING_SIZE + 1))
    assert too_long["param"] == "dimensions" and str(EMBEDDING_SIZE) in too_long["message"]
    for fields, param in [(dict(input=""), "input"), (dict(input=[]), "input"), (dict(input=["a", [1]]), "input"),
                          (dict(input="x", encoding_format="int8"), "encoding_format"),
                          (dict(input="x", extra_body={"service_tier": "flex"}), "service_tier")]:
        assert refusal(lambda: client.embeddings.create(model=EMBEDDER, **fields))["param"] == param


def test_langchains_openai_embeddings_embed_documents_and_a_query(server):
    # check_embedding_ctx_length=False sends the texts as they are: its default counts tokens with tiktoken first,
    # whose encoding is a download
    embeddings = OpenAIEmbeddings(model=EMBEDDER, base_url=server[0], api_key="unused", max_retries=0,
                                  check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(TEXTS)
    assert all(close(v, letter_vector(t)) for v, t in zip(documents, TEXTS)) and len(documents) == 2
    assert close(embeddings.embed_query("a question"), letter_vector("a question"))


def test_a_client_that_leaves_cancels_its_job(server, e2e_redis):
    base, _ = server
    url, connection = e2e_redis
    stats = WorkerStats(name=IDLE, host="h", pid=1, queues=QUEUE, model=IDLE, state="idle", in_flight=0, free_slots=1,
                        kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0, tasks="embed", embedding_size=8)
    connection.hset(keys.worker_stats_key(IDLE), mapping=stats.to_dict())
    connection.sadd(keys.WORKERS_SET, IDLE)
    wait_for(lambda: IDLE in [m["id"] for m in httpx.get(f"{base}/models").json()["data"]], 10,
             "the gateway to see the idle worker (it reads the live workers at most once a second)")
    jobs = set(connection.keys("rq:job:*"))
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes its connection
            httpx.post(f"{base}/embeddings", json={"model": IDLE, "input": "x"}, timeout=httpx.Timeout(30, read=0.5))
    finally:
        connection.delete(keys.worker_stats_key(IDLE))
    (job,) = {k.decode().removeprefix("rq:job:") for k in set(connection.keys("rq:job:*")) - jobs}
    client = Client(url, queue=QUEUE)
    wait_for(lambda: client.status(job).status in ("stopped", "canceled"), 20, "the abandoned job to stop")


def test_a_real_embedding_model_embeds_and_refuses_what_it_cannot(server):
    base, real_worker_ready = server
    real_worker_ready()
    client = sdk(base)
    answer = client.embeddings.create(model=REAL, input=[*TEXTS, TEXTS[0]], encoding_format="float")
    vectors = [d.embedding for d in answer.data]
    assert [len(v) for v in vectors] == [REAL_SIZE] * 3 and close(vectors[0], vectors[2])
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vectors)  # normalized
    assert vectors[0] != vectors[1] and answer.usage.prompt_tokens > 3
    plain = refusal(lambda: client.embeddings.create(model=REAL, input="x", dimensions=REAL_SIZE // 2))
    assert plain["param"] == "dimensions" and "Matryoshka" in plain["message"]
    assert len(client.embeddings.create(model=REAL, input="x", dimensions=REAL_SIZE).data[0].embedding) == REAL_SIZE
    too_long = refusal(lambda: client.embeddings.create(model=REAL, input=[[5] * 4, [5] * (REAL_CONTEXT + 1)]))
    assert too_long["param"] == "input" and too_long["code"] == "generation_failed", too_long
