"""Prompt logprobs (`GenerationRequest.prompt_logprobs`, echo with logprobs) and `max_tokens` 0: the engine's numbers
against a plain transformers forward, and the OpenAI and vLLM shapes the gateway and batch lines give them."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fakeredis import aioredis
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys
from rqbatcher.jobs import keys
from rqbatcher.openai.batch_lines import parse_batch_line, success_line
from rqbatcher.openai.generation_answer import response_body
from rqbatcher.openai.generation_body import BodyError, parse_body
from rqbatcher.schema import GenerationRequest, GenerationResult, SamplingParams, TokenLogprob, TopLogprob, Usage
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.engine_helpers import engine_for, random_prompts, run_all
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401

ATOL = 1e-4
TOP = 3


def reference_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """log_softmax of a plain fp32 transformers forward: row i predicts prompt token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def asking(prompt: list[int], max_tokens: int = 2, k: int = TOP) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt, prompt_logprobs=k,
                             sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def assert_matches(entries: list[TokenLogprob | None], prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        row, entry = reference[i - 1], entries[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=ATOL), i
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(k)
        assert [t.token_id for t in entry.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=ATOL)


@pytest.mark.parametrize("budget", [4096, 7, 2], ids=["whole", "chunked", "one-token-chunks"])
def test_prompt_logprobs_equal_a_plain_forward(tiny_model_dir, budget):
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, max_num_batched_tokens=budget, max_num_seqs=4)
    prompt = random_prompts(1, seed=3, min_len=30, max_len=40)[0]
    # decoding beside it: with a budget of 2, each step gives the prompt a chunk of one token (a decode-sized row)
    engine.add("other", GenerationRequest(prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=60,
                                                                                         ignore_eos=True)))
    engine.step()
    engine.add("asks", asking(prompt))
    outs = run_all(engine)
    assert_matches(outs["asks"].prompt_logprobs, prompt, reference_logprobs(model_dir, prompt), TOP)
    result = outs["asks"].to_result()
    assert result.prompt_token_ids == prompt and len(result.token_ids) == 2
    assert outs["other"].prompt_logprobs is None and outs["other"].to_result().prompt_token_ids is None


def test_a_job_that_asks_leaves_the_others_of_its_steps_unchanged(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompt, other = random_prompts(2, seed=11, min_len=20, max_len=30)
    plain = GenerationRequest(prompt_token_ids=other, sampling=SamplingParams(max_tokens=6, logprobs=2,
                                                                              ignore_eos=True))
    beside_plain, beside_asking = engine_for(model_dir), engine_for(model_dir)
    beside_plain.add("first", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=6,
                                                                                                 ignore_eos=True)))
    beside_asking.add("first", asking(prompt, max_tokens=6))
    for engine in (beside_plain, beside_asking):
        engine.add("other", plain)
    expected, got = run_all(beside_plain)["other"], run_all(beside_asking)["other"]
    assert got.token_ids == expected.token_ids and got.logprobs == expected.logprobs


def test_a_cached_prefix_is_computed_again_for_a_job_that_asks(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, block_size=4, prefix_caching=True)
    prompt = random_prompts(1, seed=5, min_len=33, max_len=33)[0]
    engine.add("warm", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)))
    run_all(engine)
    engine.add("asks", asking(prompt, k=0))
    out = run_all(engine)["asks"]
    assert out.num_cached_tokens == 0
    assert_matches(out.prompt_logprobs, prompt, reference_logprobs(model_dir, prompt), 0)
    engine.add("again", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=1)))
    assert run_all(engine)["again"].num_cached_tokens == 32  # the others still read it


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_max_tokens_0_ends_after_the_prefill_with_no_token(tiny_model_dir, prompt_len):
    model_dir = tiny_model_dir("llama")
    engine = engine_for(model_dir, max_num_batched_tokens=4)
    prompt = random_prompts(1, seed=7, min_len=prompt_len, max_len=prompt_len)[0]
    engine.add("zero", asking(prompt, max_tokens=0, k=1))
    engine.add("echo", GenerationRequest(prompt="The quick fox", echo=True, sampling=SamplingParams(max_tokens=0)))
    outs = run_all(engine)
    for out in outs.values():
        assert (out.token_ids, out.text, out.finish_reason) == ([], "", "length")
    assert_matches(outs["zero"].prompt_logprobs, prompt, reference_logprobs(model_dir, prompt), 1)
    assert outs["echo"].prompt_logprobs is None
    assert not engine.has_work() and engine.stats().kv_cache_usage == 0


def test_max_tokens_0_needs_echo_or_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens 0"):
        GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=0))
    with pytest.raises(BodyError) as caught:
        parse_body({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "/v1/chat/completions")
    assert caught.value.param == "max_tokens"
    with pytest.raises(BodyError) as caught:
        parse_body({"prompt": "hi", "prompt_logprobs": 21}, "/v1/completions")
    assert caught.value.param == "prompt_logprobs"


# ----- the shapes -----
PROMPT_IDS = [10, 11, 12]
PROMPT_ENTRIES = [None,
                  TokenLogprob(token=" b", logprob=-1.5, rank=2, top_logprobs=[
                      TopLogprob(token=" a", logprob=-0.5, token_id=20), TopLogprob(token=" b", logprob=-1.5,
                                                                                    token_id=11)]),
                  TokenLogprob(token="c", logprob=-0.25, rank=1, top_logprobs=[
                      TopLogprob(token="c", logprob=-0.25, token_id=12), TopLogprob(token="d", logprob=-2.0,
                                                                                    token_id=13)])]


def result_with(max_tokens: int) -> GenerationResult:
    generated = [TokenLogprob(token="!", logprob=-0.75, top_logprobs=[TopLogprob(token="!", logprob=-0.75),
                                                                       TopLogprob(token="?", logprob=-1.0)])]
    return GenerationResult(text="!"[:max_tokens], token_ids=[33][:max_tokens], finish_reason="length",
                            usage=Usage(prompt_tokens=3, completion_tokens=max_tokens),
                            logprobs=generated[:max_tokens], prompt_token_ids=PROMPT_IDS,
                            prompt_logprobs=PROMPT_ENTRIES)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_answers_the_legacy_shape(max_tokens):
    body = {"prompt": "a bc", "echo": True, "logprobs": 2, "max_tokens": max_tokens}
    request = parse_body(body, "/v1/completions")
    assert (request.prompt_logprobs, request.sampling.logprobs, request.sampling.max_tokens) == (2, 2, max_tokens)
    choice = response_body(result_with(max_tokens), request=request)["choices"][0]
    assert choice["text"] == "a bc" + "!" * max_tokens
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["a", " b", "c", "!"][:3 + max_tokens]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -0.75][:3 + max_tokens]
    assert logprobs["top_logprobs"] == [None, {" a": -0.5, " b": -1.5}, {"c": -0.25, "d": -2.0},
                                        {"!": -0.75, "?": -1.0}][:3 + max_tokens]
    assert logprobs["text_offset"] == [0, 1, 3, 4][:3 + max_tokens]


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_answer_vllms_shape(url):
    body = {"prompt_logprobs": 1, "max_tokens": 1}
    body.update({"prompt": "a bc"} if url == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    request = parse_body(body, url)
    assert request.prompt_logprobs == 1 and request.sampling.logprobs is None
    body = response_body(result_with(1), url, request=request)
    where = body["choices"][0] if url == "/v1/completions" else body  # vLLM's places: each choice, the chat answer
    assert where["prompt_logprobs"] == [
        None,
        {11: {"logprob": -1.5, "rank": 2, "decoded_token": " b"}, 20: {"logprob": -0.5, "rank": 1,
                                                                        "decoded_token": " a"}},
        {12: {"logprob": -0.25, "rank": 1, "decoded_token": "c"}}]
    assert list(where["prompt_logprobs"][1]) == [11, 20]  # the prompt token first, then the likeliest


# ----- through the gateway, on a worker running the real engine -----
MODEL = "tiny-llama"
KEY = {"Authorization": "Bearer key"}
PROMPT = "The quick brown fox jumps"


@pytest.fixture
def served(tiny_model_dir, fake_redis, keep_signal_handlers):
    """(the gateway's HTTP client, the model's directory): a worker thread runs the tiny Llama in fp32."""
    model_dir = tiny_model_dir("llama")
    running = JobWorker(keys.priority_queue_names([keys.DEFAULT_QUEUE], model=MODEL), engine_for(model_dir),
                        connection=fake_redis, model_name=MODEL, lease_s=5)
    thread = threading.Thread(target=running.work, daemon=True)
    thread.start()
    wait_for(lambda: fake_redis.exists(keys.worker_stats_key(running.name)), 30, "the worker's stats")
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    try:
        with TestClient(create_app(GatewayConfig(api_keys=ApiKeys(["key"])), fake_redis, aconnection)) as http:
            yield http, model_dir
    finally:
        running.request_stop(None, None)
        thread.join(10)


def prompt_reference(model_dir) -> tuple[list[int], torch.Tensor]:
    ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    return ids, reference_logprobs(model_dir, ids)


def test_echo_with_logprobs_through_the_gateway_streamed_or_not(served):
    http, model_dir = served
    ids, reference = prompt_reference(model_dir)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0}
    answer = http.post("/v1/completions", headers=KEY, json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], answer.json()["usage"]["completion_tokens"]) == (
        PROMPT, "length", 0)
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == PROMPT and len(logprobs["tokens"]) == len(ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=ATOL)
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])  # keyed by text: equal texts merge

    streamed = http.post("/v1/completions", headers=KEY, json={**body, "max_tokens": 3, "stream": True})
    chunks = [json.loads(part[len("data: "):]) for part in streamed.text.split("\n\n")
              if part and part != "data: [DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=ATOL)
    later = [c["choices"][0] for c in chunks[1:] if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum(len(c["logprobs"]["tokens"]) for c in later) == 3
    assert later[0]["logprobs"]["text_offset"][0] == len(PROMPT)


def test_vllms_prompt_logprobs_through_the_gateway(served):
    http, model_dir = served
    ids, reference = prompt_reference(model_dir)
    answer = http.post("/v1/completions", headers=KEY, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                             "prompt_logprobs": 0})
    assert answer.status_code == 200, answer.text
    streamed = http.post("/v1/completions", headers=KEY, json={"model": MODEL, "prompt": PROMPT, "stream": True,
                                                               "prompt_logprobs": 0})
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "prompt_logprobs")
    entries = answer.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert list(entries[i]) == [str(ids[i])]
        assert entries[i][str(ids[i])]["logprob"] == pytest.approx(reference[i - 1, ids[i]].item(), abs=ATOL)


def test_a_batch_line_takes_the_same_body():
    line = json.dumps({"custom_id": "a", "url": "/v1/completions",
                       "body": {"prompt": "a bc", "echo": True, "logprobs": 2, "max_tokens": 0}})
    custom_id, request = parse_batch_line(line)
    assert (custom_id, request.prompt_logprobs, request.sampling.max_tokens) == ("a", 2, 0)
    shaped = success_line(custom_id, response_body(result_with(0), request=request))
    assert shaped["response"]["body"]["choices"][0]["logprobs"]["tokens"] == ["a", " b", "c"]
