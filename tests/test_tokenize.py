"""/tokenize and /detokenize (vLLM's shape) through the gateway, and the tokenize-only job under them: with the fake
engine's worker (its tokens are characters) on fakeredis, and on a real tiny transformers model, whose ids must be
its tokenizer's own."""

from __future__ import annotations

import threading

import pytest
from fakeredis import aioredis
from rq.job import Job
from rq.serializers import JSONSerializer
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys, tenant_of
from rqbatcher.gateway.job_service import tokenize_job
from rqbatcher.gateway.tenant_limits import reserved_tokens
from rqbatcher.jobs import keys
from rqbatcher.jobs.life import decode_request
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.job_worker.worker import JobWorker
from tests import test_gateway
from tests.engine_helpers import engine_for
from tests.fake_engine import MAX_MODEL_LEN
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401
from tests.letter_engine import LETTER_VOCAB_SIZE, LetterEngine, letter_prompt_ids
from tests.test_gateway import MODEL, A, error_of, worker_fixture  # noqa: F401
from tests.tiny_models import build_tool_model

gateway = test_gateway.gateway  # its fixture: a gateway on fakeredis with the keys of A and B

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TINY_CONTEXT = 64  # the real engine's max_model_len in these tests: a longer prompt is still counted


def job_requests(connection) -> list[GenerationRequest]:
    """The requests of every job the gateway enqueued."""
    ids = [k.decode().removeprefix("rq:job:") for k in connection.keys("rq:job:*") if k.count(b":") == 2]
    return [decode_request(Job.fetch(i, connection=connection, serializer=JSONSerializer)) for i in ids]


# ----- the job -----
@pytest.mark.parametrize("refused", [{"sampling": SamplingParams(max_tokens=3)}, {"echo": True}, {"regex": "a+"},
                                     {"choice": ["a", "b"]}, {"response_format": {"type": "json_object"}}])
def test_a_tokenize_only_job_takes_nothing_that_shapes_an_answer(refused):
    with pytest.raises(ValueError, match="tokenize_only takes no"):
        GenerationRequest(prompt="hi", tokenize_only=True, **refused)
    assert GenerationRequest(messages=CHAT, tools=[WEATHER], tokenize_only=True).tokenize_only


def test_the_fake_engine_answers_a_tokenize_only_job_in_its_next_step_without_a_slot():
    engine = LetterEngine(max_num_seqs=1)
    engine.add("busy", GenerationRequest(prompt="x", sampling=SamplingParams(max_tokens=5)))
    engine.add("count", GenerationRequest(prompt="hé", tokenize_only=True))
    assert engine.free_slots == 0
    out = next(o for o in engine.step() if o.request_id == "count")
    assert (out.finish_reason, out.prompt_token_ids, out.token_ids, out.text) == ("stop", [104, 233], [], "")
    assert out.to_result().usage.prompt_tokens == 2 and out.to_result().prompt_token_ids == [104, 233]


def test_a_token_id_outside_the_vocabulary_fails_a_tokenize_only_job_at_its_add():
    engine = LetterEngine()
    with pytest.raises(RequestError, match=f"token id {LETTER_VOCAB_SIZE} is outside the vocabulary"):
        engine.add("x", GenerationRequest(prompt_token_ids=[65, LETTER_VOCAB_SIZE], tokenize_only=True))
    assert not engine.has_work()


def test_the_tokenize_job_of_a_generation_keeps_what_renders_its_prompt_and_drops_the_rest():
    generation = GenerationRequest(messages=CHAT, tools=[WEATHER], tool_choice="none", model=MODEL,
                                   chat_template_kwargs={"enable_thinking": False},
                                   sampling=SamplingParams(max_tokens=5, temperature=0.7),
                                   response_format={"type": "json_object"}, tenant="tenant-a")
    job = tokenize_job(generation)
    assert job.tokenize_only and job.tenant == "tenant-a" and job.sampling == SamplingParams()
    assert job.response_format is None
    kept = ("messages", "tools", "tool_choice", "model", "chat_template_kwargs")
    assert [getattr(job, n) for n in kept] == [getattr(generation, n) for n in kept]


def test_a_tokenize_only_job_reserves_its_prompt_alone_against_tokens_per_minute():
    counted = reserved_tokens(GenerationRequest(prompt="x" * 40, tokenize_only=True))
    assert counted == reserved_tokens(GenerationRequest(prompt="x" * 40, sampling=SamplingParams(max_tokens=1))) - 1


# ----- the routes, on the fake engine's worker -----
def test_tokenize_counts_a_prompt_as_the_worker_reads_it(gateway, worker, fake_redis):
    for path in ("/tokenize", "/v1/tokenize"):
        response = gateway.post(path, headers=A, json={"model": MODEL, "prompt": "héllo"})
        assert response.status_code == 200, response.text
        assert response.json() == {"count": 5, "max_model_len": MAX_MODEL_LEN, "tokens": [ord(c) for c in "héllo"],
                                   "token_strs": None}
    jobs = job_requests(fake_redis)
    assert len(jobs) == 2 and all(j.tokenize_only and j.tenant == tenant_of("key-of-a") for j in jobs)


def test_tokenize_renders_messages_with_their_tools(gateway, worker):
    with_tools = gateway.post("/tokenize", headers=A, json={"model": MODEL, "messages": CHAT, "tools": [WEATHER]})
    without = gateway.post("/tokenize", headers=A, json={"messages": CHAT, "add_generation_prompt": True})
    expected = letter_prompt_ids(GenerationRequest(messages=CHAT, tools=[WEATHER]))
    assert with_tools.json()["tokens"] == expected and with_tools.json()["count"] == len(expected)
    assert without.json()["tokens"] == letter_prompt_ids(GenerationRequest(messages=CHAT)) != expected


def test_a_prompt_past_the_context_is_counted_not_refused(gateway, worker):
    refused = gateway.post("/v1/completions", headers=A, json={"model": MODEL, "prompt": "too long"})
    assert error_of(refused, 400)["code"] == "generation_failed"
    counted = gateway.post("/tokenize", headers=A, json={"model": MODEL, "prompt": "too long"})
    assert counted.status_code == 200 and counted.json()["count"] == len("too long")


def test_detokenize_gives_back_the_text(gateway, worker):
    tokens = gateway.post("/tokenize", headers=A, json={"prompt": "round trip"}).json()["tokens"]
    for path in ("/detokenize", "/v1/detokenize"):
        response = gateway.post(path, headers=A, json={"model": MODEL, "tokens": tokens})
        assert response.status_code == 200 and response.json() == {"prompt": "round trip"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"prompt": "a", "tools": [WEATHER]}, "tools"),
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": []}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "a"}, "prompt"),
    ("/detokenize", {"model": 3, "tokens": [1]}, "model"),
])
def test_a_bad_body_answers_400_naming_the_field_and_enqueues_nothing(gateway, fake_redis, path, body, param):
    error = error_of(gateway.post(path, headers=A, json=body), 400)
    assert error["param"] == param and param in error["message"]
    assert job_requests(fake_redis) == []


def test_an_id_outside_the_vocabulary_is_refused_as_tokens(gateway, worker, fake_redis):
    error = error_of(gateway.post("/detokenize", headers=A, json={"model": MODEL, "tokens": [65, 9999]}), 400)
    assert error["param"] == "tokens" and error["message"].startswith("tokens: token id 9999")
    assert job_requests(fake_redis) == []


def test_an_unknown_model_is_404_and_no_key_is_401(gateway, worker):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [65]})):
        assert error_of(gateway.post(path, headers=A, json={**body, "model": "nobody"}), 404)["code"] == \
            "model_not_found"
        assert error_of(gateway.post(path, json=body), 401)["code"] == "missing_api_key"


# ----- on a real tiny model -----
@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tokenize-model"))


@pytest.fixture
def real_worker(fake_redis, keep_signal_handlers, tool_model):
    """A gateway and a worker on the tiny model (context TINY_CONTEXT), on fakeredis; and the worker's engine."""
    engine = engine_for(tool_model, max_model_len=TINY_CONTEXT)
    running = JobWorker(keys.priority_queue_names([keys.DEFAULT_QUEUE], model="tiny"), engine, connection=fake_redis,
                        model_name="tiny", lease_s=5)
    thread = threading.Thread(target=running.work, daemon=True)
    thread.start()
    wait_for(lambda: fake_redis.exists(keys.worker_stats_key(running.name)), 30, "the worker's stats")
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    with TestClient(create_app(GatewayConfig(api_keys=ApiKeys(["key-of-a"])), fake_redis, aconnection)) as http:
        yield http, engine
    running.request_stop(None, None)
    thread.join(30)


def test_the_ids_are_the_tokenizers_own_and_detokenize_round_trips(real_worker, tool_model):
    http, engine = real_worker
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # past the context: counted all the same
    counted = http.post("/tokenize", headers=A, json={"model": "tiny", "prompt": prompt}).json()
    assert counted["tokens"] == tokenizer(prompt)["input_ids"] and counted["count"] > TINY_CONTEXT
    assert counted["max_model_len"] == TINY_CONTEXT
    chat = http.post("/tokenize", headers=A, json={"messages": CHAT, "tools": [WEATHER]}).json()
    rendered = tokenizer.apply_chat_template(CHAT, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "get_weather" in rendered
    assert chat["tokens"] == tokenizer.apply_chat_template(CHAT, tools=[WEATHER], add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"]
    for tokens, text in ((counted["tokens"], prompt), (chat["tokens"], rendered)):
        back = http.post("/detokenize", headers=A, json={"model": "tiny", "tokens": tokens})
        assert back.status_code == 200 and back.json() == {"prompt": text}
    assert engine.step_index == 0  # each was answered without a model step
