"""Bad input through HTTP always gets a 4xx (issue 44): hypothesis drives every endpoint of the gateway, in-process
(Starlette's TestClient) on fakeredis, with bodies mutated from a valid one: a field replaced by a value of another
type, a number out of range, an unknown enumeration, a huge string, deep nesting, a lone surrogate, an unknown
field, a field removed; and bodies that are not JSON objects at all (invalid UTF-8, NaN, a truncated text, an array).

Each example is checked: no 5xx; a refused body enqueued nothing (the queues' lengths and the job keys are as before),
its message is at most MAX_MESSAGE_CHARS long and quotes no more than a short prefix of what was sent, and its
`param` names a field of the body as sent (or a required one it lacks), as its message does; the gateway still
answers /health. A pretend worker publishes its model, vocabulary and embeddings, and a submitted job ends at once
(its stream gets a `done` with a result), so an accepted body is answered, streamed or not, and is counted too.

The examples are derandomized, so a run is the same everywhere; `pytest -s` prints each endpoint's corpus figures.
"""

from __future__ import annotations

import base64
import json
from array import array
from collections import Counter
from urllib.parse import quote

import pytest
from fakeredis import aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from rqbatcher.client import Client
from rqbatcher.errors import MAX_QUOTED_CHARS
from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys
from rqbatcher.gateway.body import MAX_JSON_DEPTH
from rqbatcher.gateway.error_objects import MAX_MESSAGE_CHARS
from rqbatcher.jobs import keys
from rqbatcher.jobs.worker_stats import WorkerStats
from rqbatcher.schema import Choice, GenerationRequest, GenerationResult, StreamEvent, Usage
from tests.jobs_support import fake_redis_fixture  # noqa: F401

EXAMPLES = 1000  # per endpoint: the corpus of issue 44's target, a long variant (`pytest -m slow`)
QUICK_EXAMPLES = 200  # per endpoint in the default run
HEALTH_EVERY = 50  # examples between two checks that the gateway still answers (and after the last)
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
KEY = "key-of-fuzz"
HEADERS = {"Authorization": f"Bearer {KEY}"}
JSON_HEADERS = {**HEADERS, "Content-Type": "application/json"}
MODEL = "fuzz-model"
VOCAB_SIZE = 1000
EMBEDDING_SIZE = 8
MARK = "0123456789"  # a huge string is this repeated: a message may quote only a short prefix of it
HUGE = MARK * 10_000
LONGEST_QUOTE = MARK * 10  # longer than any quote of a value (errors.MAX_QUOTED_CHARS) or a problem's cut
EXECUTION = "fuzz-execution"
JOB_PATTERNS = ("rq:job:*", "rq:queue:*", "rq:results:*", keys.STREAM_PREFIX + "*")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


# ----- values a field may be set to -----
WRONG_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 2, 3, 4, 5, 16, 17, 20, 21, 100, 101, 128, 129, 999, 1000, 2**31, 2**63, 2**64,
                     -(2**63) - 1, 0.5, 2.0, 2.5, -0.0, 1e308, -1e308, 5e-324]),
    st.sampled_from(["", "bogus", "4", "2", "true", "null", "auto", "none", "default", "text", "\x00", "é",
                     "\U0001f600", "\ud800", "x\udfffy", HUGE]),
    st.text(max_size=12),
    st.just(nested(MAX_JSON_DEPTH + 2)), st.just(nested(MAX_JSON_DEPTH - 4)),
    st.lists(st.integers(-5, VOCAB_SIZE + 5), max_size=5), st.lists(st.text(max_size=4), max_size=6),
    st.dictionaries(st.text(max_size=6), st.integers(-200, 200) | st.text(max_size=4) | st.booleans(), max_size=3),
)
UNKNOWN_FIELDS = st.sampled_from(["bogus", "Temperature", "max-tokens", "", "\ud800", HUGE, "stream_options "])
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
FLAT_TOOL = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
CHAT_VALUES = {
    "messages": [[{"role": "developer", "content": "be brief"}, *MESSAGES], [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], [{"role": "user"}], [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "tool", "tool_call_id": "c1", "content": "x"}], [], [{"role": ["user"], "content": "x"}]],
    "model": [MODEL, "other-model", "x" * 300],
    "max_tokens": [1, 64, 0, 1 << 15, (1 << 15) + 1], "max_completion_tokens": [1, 8, 0, -3],
    "temperature": [0, 0.7, 2, 2.01, -0.1], "top_p": [0.5, 1, 0, 1.5], "n": [1, 2, 16, 17, 0], "seed": [7, -7, 2**64],
    "stop": ["\n", ["a", "b"], ["a"] * 4, ["a"] * 5, [""], [1]],
    "frequency_penalty": [-2, 2, 2.5], "presence_penalty": [1.5, -3],
    "logit_bias": [{"5": 10}, {"5": 101}, {str(VOCAB_SIZE): 1}, {"-1": 1}, {"a": 1}, {"5": "1"}, {"5": True}],
    "logprobs": [True, False, 3], "top_logprobs": [0, 5, 20, 21],
    "stream": [True, False, "yes"], "stream_options": [{"include_usage": True}, {"continuous_usage_stats": True},
                                                       {"bogus": True}],
    "tools": [[TOOL], [], [TOOL, TOOL], [{"type": "function", "function": {"name": "bad name"}}],
              [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]],
    "tool_choice": ["none", "auto", "required", "sometimes", {"type": "function", "function": {"name": "get_weather"}},
                    {"type": "function", "function": {"name": "nobody"}}],
    "parallel_tool_calls": [True, False, 1],
    "response_format": [{"type": "text"}, {"type": "json_object"}, SCHEMA_FORMAT, {"type": "yaml"},
                        {"type": "json_schema"}],
    "service_tier": ["auto", "default", "flex", "priority", "scale", "fast", ["flex"]],
    "metadata": [{"team": "a"}, {"team": 1}, {f"k{i}": "v" for i in range(17)}],
    "user": ["u-1", 7], "store": [True, "no"], "reasoning_effort": ["low", "max", "extreme"],
    "verbosity": ["low", "loud"], "prompt_cache_retention": ["24h", "1h"], "safety_identifier": ["s", "s" * 129],
    "prediction": [{"type": "content", "content": "x"}, {"type": "content"}, {"type": "other", "content": "x"}],
    "modalities": [["text"], ["text", "audio"], "text"], "regex": ["[a-z]+", "("], "choice": [["yes", "no"], []],
    "ignore_eos": [True, 1], "top_k": [0, 40, -1], "repetition_penalty": [1.1, 0, 101],
    "audio": [{"voice": "alloy"}], "functions": [[]], "web_search_options": [{}],
}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
COMPLETION_VALUES = {
    **{k: v for k, v in CHAT_VALUES.items() if k not in ("messages", "tools", "tool_choice", "parallel_tool_calls",
                                                           "top_logprobs", "modalities", "logprobs")},
    "prompt": ["", "x", [1, 2, 3], [VOCAB_SIZE - 1], [VOCAB_SIZE], [1 << 31], [-1], ["a", "b"], [[1, 2]], [],
               [1.0], [True]],
    "logprobs": [0, 5, 6, True, -1], "echo": [True, False, "yes"], "best_of": [1, 2, 16, 17, 0],
    "suffix": ["end"],
}
RESPONSE = {"model": MODEL, "input": "hello", "max_output_tokens": 4}
RESPONSE_VALUES = {
    "input": ["", [], [{"role": "user", "content": "hi"}], [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}], [{"type": "function_call", "call_id": "c1", "name": "get_weather",
                                                   "arguments": "{}"},
                                                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
              [{"type": "reasoning"}], [{"role": "wizard", "content": "x"}], [{"role": {}, "content": "x"}],
              [{"role": "user", "content": [{"type": "input_image"}]}], ["hi"]],
    "instructions": ["be brief", 3], "model": [MODEL, "other-model"], "max_output_tokens": [1, 0, 64, "4"],
    "temperature": [0, 1.5, 3], "top_p": [0.5, 0, 2], "text": [{"format": {"type": "text"}}, {"format": {
        "type": "json_schema", "name": "answer", "schema": {"type": "object"}}}, {"format": {"type": "json_object"}},
        {"verbosity": "low"}, {"verbosity": "loud"}, {"format": "json"}, {"bogus": 1}],
    "tools": [[FLAT_TOOL], [], [{"type": "web_search"}], [{**FLAT_TOOL, "bogus": 1}]],
    "tool_choice": ["auto", "required", "none", "sometimes", {"type": "function", "name": "get_weather"},
                    {"type": "allowed_tools"}],
    "parallel_tool_calls": [True, "false"], "metadata": [{"a": "b"}, {"a": 1}], "user": ["u"],
    "service_tier": ["flex", "ultrafast"], "store": [True, False, "yes"], "background": [True, False, 0],
    "stream": [True, False, "true"], "previous_response_id": ["resp_nothing", HUGE, 5],
    "include": [[], ["reasoning.encrypted_content"], ["message.output_text.logprobs"], ["bogus"], "bogus"],
    "reasoning": [{"effort": "low"}, {"summary": "auto"}, {"effort": "extreme"}, "x", {"bogus": 1}],
    "top_logprobs": [0, 20, 21, 2.0], "truncation": ["auto", "disabled", "bogus"],
    "prompt_cache_key": ["k", 1], "prompt_cache_retention": ["24h", "2h"],
    "prompt_cache_options": [{"mode": "explicit", "ttl": "12h"}, {"ttl": "1d"}], "safety_identifier": ["s"],
    "max_tool_calls": [1, -1], "stream_options": [{"include_obfuscation": False}, {"bogus": 1}],
    "access_programs": [{"cyber": "standard"}, {"cyber": "red"}], "conversation": ["c"], "prompt": [{"id": "p"}],
}
EMBEDDING = {"model": MODEL, "input": "hello"}
EMBEDDING_VALUES = {
    "input": ["", ["a", "b"], [1, 2], [[1, 2], [3]], [VOCAB_SIZE], [[VOCAB_SIZE]], [], [[]], ["a", [1]], [1.5],
              [True], ["a"] * 2049],
    "model": [MODEL, "other-model"], "encoding_format": ["float", "base64", "hex"],
    "dimensions": [EMBEDDING_SIZE, 4, 0, EMBEDDING_SIZE + 1, 4.0, "4"], "user": ["u", 1],
}
BATCH_VALUES = {
    "endpoint": ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/moderations"],
    "completion_window": ["24h", "1h", "24"], "metadata": [{"team": "a"}, {"team": 1}],
    "output_expires_after": [{"anchor": "created_at", "seconds": 3600}, {"anchor": "created_at", "seconds": 10},
                             {"anchor": "other", "seconds": 3600}, {"seconds": 3600}],
}
NOT_OBJECTS = st.sampled_from([
    b"", b"{", b"[]", b'"x"', b"1", b"null", b"\xff\xfe", b'{"model": "\xff"}', b'{"temperature": NaN}',
    b'{"max_tokens": Infinity}', b"[" * 100_000, b"{" * 1000, json.dumps(CHAT).encode("utf-16"), b'{"a":1}{"b":2}',
    b'{"model": "\\ud800"}', '{"model": "é"}'.encode("latin-1"), b'{"' + b"1" * 5000 + b'": 1}',
    b'{"max_tokens": ' + b"9" * 5000 + b"}"])


@st.composite
def mutated(draw, valid: dict, values: dict[str, list]) -> dict:
    """`valid` with one to three fields set to a near-valid or a wrong value, removed, or an unknown one added."""
    body = dict(valid)
    fields = sorted({*valid, *values})
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["near", "near", "wrong", "wrong", "remove", "unknown"]))
        name = draw(st.sampled_from(fields))
        if action == "remove":
            body.pop(name, None)
        elif action == "unknown":
            body[draw(UNKNOWN_FIELDS)] = draw(WRONG_VALUES)
        elif action == "near" and values.get(name):
            body[name] = draw(st.sampled_from(values[name]))
        else:
            body[name] = draw(WRONG_VALUES)
    return body


def payloads(valid: dict, values: dict[str, list]):
    """A body to POST: mostly a mutated object (sent as JSON), sometimes raw bytes that are no JSON object."""
    return st.one_of(mutated(valid, values), mutated(valid, values), mutated(valid, values), NOT_OBJECTS,
                     mutated(valid, values).flatmap(
                         lambda body: st.integers(0, 40).map(lambda cut: json.dumps(body).encode()[:cut])))


# ----- the gateway, its pretend worker, and jobs that end at once -----
def _result(request: GenerationRequest) -> GenerationResult:
    n = request.sampling.n
    vector = base64.b64encode(array("f", [0.5] * (request.dimensions or EMBEDDING_SIZE)).tobytes()).decode()
    return GenerationResult(
        text="ok", token_ids=[1], finish_reason="stop", model=MODEL,
        usage=Usage(prompt_tokens=1, completion_tokens=0 if request.embed else n),
        choices=[Choice(index=i, text="ok", token_ids=[1], finish_reason="stop") for i in range(n)] if n > 1 else None,
        embeddings=[vector] * len(request.embed) if request.embed else None)


@pytest.fixture(name="examples", params=[QUICK_EXAMPLES, pytest.param(EXAMPLES, marks=pytest.mark.slow)],
                ids=["quick", "corpus"])
def examples_fixture(request) -> int:
    """How many bodies each endpoint gets."""
    return request.param


@pytest.fixture(name="fuzz")
def fuzz_fixture(fake_redis, monkeypatch):
    """The gateway's TestClient, on a fakeredis where a worker serving MODEL (vocabulary and embeddings published)
    looks alive and every job submitted ends at once."""
    stats = WorkerStats(name="fuzz", host="h", pid=1, queues=keys.DEFAULT_QUEUE, model=MODEL, state="idle",
                        in_flight=0, free_slots=1, kv_usage=0.0, tokens_per_s=0.0, last_heartbeat=0.0,
                        vocab_size=VOCAB_SIZE, tasks="generate,embed", embedding_size=EMBEDDING_SIZE,
                        matryoshka_dimensions="any")
    fake_redis.hset(keys.worker_stats_key("fuzz"), mapping=stats.to_dict())
    fake_redis.sadd(keys.WORKERS_SET, "fuzz")
    submit_many = Client.submit_many

    def ended_at_once(self, requests, job_ids=None):
        requests = [GenerationRequest.model_validate(r) if isinstance(r, dict) else r for r in requests]
        ids = submit_many(self, requests, job_ids)
        for request, job_id in zip(requests, ids):
            result = _result(request)
            for event in (StreamEvent(type="start", execution_id=EXECUTION),
                          *(StreamEvent(type="token", execution_id=EXECUTION, text="ok", token_ids=[1], choice=i)
                            for i in range(request.sampling.n)),
                          StreamEvent(type="done", execution_id=EXECUTION, finish_reason="stop", usage=result.usage,
                                      result=result)):
                self.connection.xadd(keys.stream_key(job_id), event.to_fields())
        return ids

    monkeypatch.setattr(Client, "submit_many", ended_at_once)
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    config = GatewayConfig(api_keys=ApiKeys([KEY]), max_queue_length=None)
    with TestClient(create_app(config, fake_redis, aconnection)) as http:
        yield http, fake_redis


# ----- the checks of one example -----
def stored(connection) -> tuple[int, int, int]:
    """(job keys, jobs queued, file keys): what enqueuing a job or storing a file changes."""
    names = connection.keys()
    queued = sum(connection.llen(name) for name in names if name.startswith(b"rq:queue:"))
    return (sum(name.startswith(b"rq:job:") for name in names), queued,
            sum(name.startswith(keys.FILE_PREFIX.encode()) for name in names))


def forget_jobs(connection) -> None:
    """Drop the jobs accepted bodies enqueued, their streams and results (this test's own fakeredis), so that each
    example counts a few keys."""
    for pattern in JOB_PATTERNS:
        for key in connection.keys(pattern):
            connection.delete(key)


def names_a_sent_field(param: str, body: dict, required: tuple[str, ...]) -> bool:
    if param in body or param in required or param in {k.partition("[")[0] for k in body}:  # a form's expires_after
        return True
    cut = param.removesuffix("...")  # a long field name is named by its prefix (errors.short_name)
    return cut != param and len(cut) == MAX_QUOTED_CHARS and any(k.startswith(cut) for k in body)


class Corpus:
    """An endpoint's figures: bodies sent, answers by class, jobs enqueued for refused bodies, the longest message."""

    def __init__(self, name: str, examples: int) -> None:
        self.name, self.examples, self.counts, self.longest = name, examples, Counter(), 0

    def report(self) -> None:
        c = self.counts
        print(f"\n{self.name}: {c['sent']} sent, {c['2xx']} 2xx, {c['4xx']} 4xx, {c['5xx']} 5xx, "
              f"{c['refused_enqueued']} jobs enqueued for refused bodies, longest message {self.longest} chars")
        assert c["sent"] >= self.examples and c["5xx"] == 0 and c["refused_enqueued"] == 0
        assert c["2xx"] and c["4xx"]  # both sides of the line were reached


def send(http, connection, corpus: Corpus, method: str, url: str, body=None, required: tuple[str, ...] = (),
         creates: bool = False, **kwargs):
    """One request, checked; `body` is the object (or the form) sent, if one was, and `creates` whether an accepted
    one enqueues a job or stores a file."""
    before = stored(connection)
    response = http.request(method, url, **kwargs)
    corpus.counts["sent"] += 1
    status = response.status_code
    corpus.counts[f"{status // 100}xx"] += 1
    assert status < 500, (method, url[:200], status, response.text[:500])
    if status >= 400:
        error = response.json()["error"]
        message, param = error["message"], error["param"]
        corpus.longest = max(corpus.longest, len(message))
        assert len(message) <= MAX_MESSAGE_CHARS and LONGEST_QUOTE not in message, message[:300]
        enqueued = stored(connection) != before
        corpus.counts["refused_enqueued"] += enqueued
        assert not enqueued, (url, message)
        if param is not None and isinstance(body, dict):
            assert names_a_sent_field(param, body, required), (param, sorted(body)[:10], message[:300])
            assert param in message or param.removesuffix("...") in message, (param, message[:300])
    elif creates:
        assert stored(connection) != before, body
        forget_jobs(connection)
    if corpus.counts["sent"] % HEALTH_EVERY == 0:
        assert http.get("/health").status_code == 200
    return response


def post_json(http, connection, corpus: Corpus, url: str, payload, required: tuple[str, ...]):
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return send(http, connection, corpus, "POST", url, payload, required, creates=True, content=content,
                headers=JSON_HEADERS)


# ----- one test per endpoint -----
@pytest.mark.parametrize("url, valid, values, required", [
    ("/v1/chat/completions", CHAT, CHAT_VALUES, ("messages",)),
    ("/v1/completions", COMPLETION, COMPLETION_VALUES, ("prompt",)),
    ("/v1/responses", RESPONSE, RESPONSE_VALUES, ("input",)),
    ("/v1/embeddings", EMBEDDING, EMBEDDING_VALUES, ("input",)),
], ids=["chat", "completions", "responses", "embeddings"])
def test_generated_bodies_get_a_4xx_or_an_answer_never_a_5xx(fuzz, examples, url, valid, values, required):
    http, connection = fuzz
    corpus = Corpus(url, examples)

    @settings(FUZZ, max_examples=examples)
    @given(payload=payloads(valid, values))
    def example(payload):
        post_json(http, connection, corpus, url, payload, required)

    example()
    corpus.report()
    assert http.get("/health").status_code == 200


# ----- files, batches, and the routes of an id -----
BATCH_FILE = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": CHAT}) for i in range(2)).encode() + b"\n"
FORM_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]", "bogus", HUGE[:3000])
FORM_VALUES = st.one_of(st.sampled_from(["batch", "assistants", "fine-tune", "", "bogus", "created_at", "3600",
                                         "10", "-1", "99999999999", "\x00", HUGE[:900], HUGE[:2000]]),
                        st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=8))
FILE_CONTENTS = st.sampled_from([BATCH_FILE, b"", b"\xff\xfe\x00", b"not json\n", b"{}\n", BATCH_FILE * 3, None])
RAW_UPLOADS = st.sampled_from([
    (b"", "multipart/form-data; boundary=xyz"), (b"--xyz\r\nbogus", "multipart/form-data; boundary=xyz"),
    (b"--xyz--\r\n", "multipart/form-data; boundary=xyz"), (BATCH_FILE, "multipart/form-data"),
    (BATCH_FILE, "application/json"), (b"purpose=batch", "application/x-www-form-urlencoded"),
    (b'--xyz\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc', "multipart/form-data; boundary=xyz"),
    (b"--" + b"x" * 100 + b"\r\n", "multipart/form-data; boundary=" + "x" * 100)])


@st.composite
def uploads(draw) -> tuple[dict, dict]:
    """(what was sent, by field name; the request's keyword arguments): a form, mostly, or a raw body."""
    if draw(st.integers(0, 4)) == 0:
        content, content_type = draw(RAW_UPLOADS)
        return {}, {"content": content, "headers": {**HEADERS, "Content-Type": content_type}}
    data = {"purpose": "batch"}
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(FORM_FIELDS))
        if draw(st.booleans()):
            data[name] = draw(FORM_VALUES)
        else:
            data.pop(name, None)
    content = draw(FILE_CONTENTS)
    sent = {**data, **({} if content is None else {"file": content})}
    files = None if content is None else {"file": ("in.jsonl", content)}
    return sent, {"data": data, "files": files, "headers": HEADERS}


def test_generated_uploads_get_a_4xx_or_a_file_never_a_5xx(fuzz, examples):
    http, connection = fuzz
    corpus = Corpus("/v1/files", examples)

    @settings(FUZZ, max_examples=examples)
    @given(upload=uploads())
    def example(upload):
        sent, request = upload
        send(http, connection, corpus, "POST", "/v1/files", sent, ("file", "purpose"), creates=True, **request)

    example()
    corpus.report()
    assert http.get("/health").status_code == 200


def test_generated_batches_get_a_4xx_or_a_batch_never_a_5xx(fuzz, examples):
    http, connection = fuzz
    corpus = Corpus("/v1/batches", examples)
    file_id = upload_batch_file(http)
    values = {**BATCH_VALUES, "input_file_id": [file_id, "file-nothing", HUGE, "", f"{file_id}x"]}
    valid = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}

    @settings(FUZZ, max_examples=examples)
    @given(payload=payloads(valid, values))
    def example(payload):
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        send(http, connection, corpus, "POST", "/v1/batches", payload, ("input_file_id", "endpoint"), content=content,
             headers=JSON_HEADERS)  # an accepted batch may enqueue nothing: a line of another endpoint fails

    example()
    corpus.report()
    assert http.get("/health").status_code == 200


ID_ROUTES = [("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"), ("POST", "/v1/responses/{}/cancel"),
             ("GET", "/v1/responses/{}/input_items"), ("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"),
             ("DELETE", "/v1/files/{}"), ("GET", "/v1/batches/{}"), ("POST", "/v1/batches/{}/cancel"),
             ("GET", "/v1/models/{}"), ("GET", "/v1/batches"), ("GET", "/v1/responses/{}?stream=true")]
QUERY = st.dictionaries(st.sampled_from(["limit", "after", "order", "starting_after", "stream"]),
                        st.sampled_from(["1", "0", "100", "101", "-1", "asc", "desc", "true", "x", HUGE[:20_000]])
                        | st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=6), max_size=3)


def upload_batch_file(http) -> str:
    uploaded = http.post("/v1/files", headers=HEADERS, files={"file": ("in.jsonl", BATCH_FILE)},
                         data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    return uploaded.json()["id"]


def test_generated_ids_get_a_4xx_or_their_object_never_a_5xx(fuzz, examples):
    http, connection = fuzz
    corpus = Corpus("the routes of an id", examples)
    file_id = upload_batch_file(http)
    batch_id = http.post("/v1/batches", headers=HEADERS, json={"input_file_id": file_id,
                                                               "endpoint": "/v1/chat/completions"}).json()["id"]
    response = http.post("/v1/responses", headers=HEADERS, json=RESPONSE)
    assert response.status_code == 200, response.text
    known = [file_id, batch_id, f"{batch_id}_output", f"{batch_id}_errors", response.json()["id"], MODEL]
    ids = st.one_of(st.sampled_from([*known, "", "x", "..", "resp_" + "a" * 64, "file-abc", "batch_x_output",
                                     HUGE[:60_000]]),
                    st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=30))

    @settings(FUZZ, max_examples=examples)
    @given(route=st.sampled_from(ID_ROUTES), object_id=ids, query=QUERY)
    def example(route, object_id, query):
        method, path = route
        url = path.format(quote(object_id, safe=""))
        send(http, connection, corpus, method, url, headers=HEADERS, params=query)

    example()
    corpus.report()
    assert http.get("/health").status_code == 200
