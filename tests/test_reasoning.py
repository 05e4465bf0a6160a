"""Reasoning output: the markers found from a model's tokenizer and template, the reasoning split from the answer
(whole and streamed), a constrained answer that starts after the reasoning on a real tiny model, and the answer
through the gateway as the `openai` SDK reads it (chat `reasoning_content`, Responses' reasoning item)."""

from __future__ import annotations

import json
import random
import threading

import jsonschema
import openai
import pytest
from fakeredis import aioredis
from starlette.testclient import TestClient
from tokenizers import AddedToken

from rqbatcher.gateway.app import GatewayConfig, create_app
from rqbatcher.gateway.auth import ApiKeys
from rqbatcher.jobs import keys
from rqbatcher.openai.generation_answer import response_body
from rqbatcher.openai.generation_body import CHAT_URL, BodyError, parse_body
from rqbatcher.openai.responses.responses_body import parse_responses_body
from rqbatcher.reasoning import (
    MAX_REASONING_SHARE,
    THINK,
    THINK_IN_PROMPT,
    ReasoningSplitter,
    after_reasoning,
    split_answer,
)
from rqbatcher.schema import ChatFormat, GenerationRequest, GenerationResult, SamplingParams, Usage
from rqbatcher.workers.engine.reasoning_probe import reasoning_format_of, special_marker_ids
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.engine_helpers import engine_for, run_all
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture, wait_for  # noqa: F401
from tests.tiny_models import CHAT_TEMPLATE, LONG_CONTEXT, build_tiny_model, build_tokenizer

# Qwen3's published template in short: turns in <|im_start|>...<|im_end|>, an earlier answer without its reasoning,
# and `enable_thinking: false` writing an empty reasoning block after the generation prompt
QWEN3_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# DeepSeek-R1 distills' manner: the generation prompt opens the reasoning
R1_TEMPLATE = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
MARKERS = ("<think>", "</think>")
ANSWER = {"type": "object", "properties": {"mood": {"enum": ["calm", "glad", "grim"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "word": {"type": "string", "maxLength": 4}},
          "required": ["mood", "score", "word"], "additionalProperties": False}
ASK = [{"role": "user", "content": "How do you feel?"}]
ANSWER_TOKENS = 128  # the tiny vocabulary spells JSON in many tokens: half is the reasoning's, half the answer's
MODEL = "tiny-thinker"
KEY = {"Authorization": "Bearer key-a"}


def thinking_tokenizer(template: str = QWEN3_TEMPLATE, markers: bool = True, special: bool = False):
    """The tiny tokenizer with Qwen's turn tokens (special) and, with `markers`, `<think>` and `</think>` as added
    tokens, not special as Qwen3's tokenizer has them (or `special`, which decoding leaves out unless kept)."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if markers:
        tokenizer.add_tokens([AddedToken(m, special=special, normalized=False) for m in MARKERS], special)
    tokenizer.chat_template = template
    return tokenizer


def build_thinking_model(path, template: str, special: bool = False):
    """A tiny random Qwen3 with `template` and the marker tokens (its vocabulary grown to hold them), and room for
    the tool prompt."""
    tokenizer = thinking_tokenizer(template, special=special)
    build_tiny_model("qwen3", path, vocab_size=len(tokenizer), max_position_embeddings=LONG_CONTEXT)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return build_thinking_model(tmp_path_factory.mktemp("qwen3-thinking"), QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def r1_model(tmp_path_factory):
    return build_thinking_model(tmp_path_factory.mktemp("r1-thinking"), R1_TEMPLATE)


# ----- the markers -----
def test_the_probe_names_each_format_from_the_tokenizer_and_template():
    assert reasoning_format_of(thinking_tokenizer(QWEN3_TEMPLATE)) == THINK
    assert reasoning_format_of(thinking_tokenizer(R1_TEMPLATE)) == THINK_IN_PROMPT
    assert reasoning_format_of(thinking_tokenizer(CHAT_TEMPLATE)) is None  # a template that never thinks
    assert reasoning_format_of(thinking_tokenizer(QWEN3_TEMPLATE, markers=False)) is None  # markers not tokens
    assert reasoning_format_of(build_tokenizer()) is None
    assert special_marker_ids(thinking_tokenizer(), THINK) == ()  # Qwen3's markers decode as text anyway
    special = thinking_tokenizer(R1_TEMPLATE, special=True)
    assert reasoning_format_of(special) == THINK_IN_PROMPT
    assert special_marker_ids(special, THINK_IN_PROMPT) == tuple(special.convert_tokens_to_ids(list(MARKERS)))


def test_markers_that_are_special_tokens_are_kept_in_the_text(tmp_path):
    model_dir = build_thinking_model(tmp_path, R1_TEMPLATE, special=True)
    engine = engine_for(model_dir, max_num_seqs=2, max_num_batched_tokens=1024, kv_cache_bytes=1 << 24)
    engine.add("kept", GenerationRequest(messages=ASK, choice=["yes", "no"],
                                         sampling=SamplingParams(max_tokens=16)))
    reasoning, content = split_answer(run_all(engine)["kept"].text, THINK_IN_PROMPT)
    assert reasoning is not None and content in ("yes", "no")


# ----- the split -----
SPLITS = [  # (format, thinking, text, reasoning, content)
    (THINK, True, "<think>\nLet me see.\n</think>\n\nIt is 4.", "Let me see.\n", "It is 4."),
    (THINK, True, "It is 4, no thinking.", None, "It is 4, no thinking."),
    (THINK, True, "<thin is not a marker", None, "<thin is not a marker"),
    (THINK, True, "<think>\ncut short by max_tokens </thi", "cut short by max_tokens </thi", ""),
    (THINK, True, "<think></think>{\"a\":1}", "", "{\"a\":1}"),
    (THINK_IN_PROMPT, True, "Hmm, 2+2.\n</think>\n\n4 < 5 and </b> stays", "Hmm, 2+2.\n", "4 < 5 and </b> stays"),
    (THINK_IN_PROMPT, True, "never closed", "never closed", ""),
    (THINK_IN_PROMPT, False, "thinking off: all content </think> x", None, "thinking off: all content </think> x"),
    (None, True, "<think>a model that does not think</think>", None, "<think>a model that does not think</think>"),
]


@pytest.mark.parametrize("fmt, thinking, text, reasoning, content", SPLITS)
def test_hand_written_answers_split_the_same_whole_and_streamed_in_any_pieces(fmt, thinking, text, reasoning,
                                                                              content):
    assert split_answer(text, fmt, thinking) == (reasoning, content)
    for seed in range(20):
        rng, splitter, parts, at = random.Random(seed), ReasoningSplitter(fmt, thinking), [], 0
        while at < len(text):
            size = rng.randint(0 if seed % 2 else 1, 4)
            parts.append(splitter.feed(text[at:at + size]))
            at += size
        parts.append(splitter.finish())
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning or "", content)
        assert splitter.reasoned == (reasoning is not None)


def test_a_grammar_starts_after_the_reasoning_only_where_the_model_thinks():
    chat = GenerationRequest(messages=ASK, regex="[0-9]+")
    assert chat.grammar() == chat.grammar(None) and "reasoning" not in chat.grammar()
    wrapped = json.loads(chat.grammar(THINK_IN_PROMPT))["grammars"]
    assert wrapped[0]["lark_grammar"].startswith("start: reasoning </think>") and wrapped[1]["name"] == "answer"
    assert "<think> reasoning" in json.loads(chat.grammar(THINK))["grammars"][0]["lark_grammar"]
    off = GenerationRequest(messages=ASK, regex="[0-9]+", chat_template_kwargs={"enable_thinking": False})
    assert off.grammar(THINK) == chat.grammar()
    assert GenerationRequest(prompt="a completion", regex="[0-9]+").grammar(THINK) == chat.grammar()
    assert GenerationRequest(messages=ASK).grammar(THINK) is None  # free text needs no grammar
    budget = int(SamplingParams().max_tokens * MAX_REASONING_SHARE)
    assert f"max_tokens={budget}" in after_reasoning(chat.grammar(), THINK, SamplingParams().max_tokens)


# ----- the request's switch -----
def test_reasoning_effort_and_template_kwargs_reach_the_template_and_bad_ones_are_refused():
    body = {"messages": ASK, "reasoning_effort": "none"}
    assert parse_body(body, CHAT_URL).chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    body = {"messages": ASK, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": True}}
    assert parse_body(body, CHAT_URL).chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": True}
    assert parse_body({"messages": ASK}, CHAT_URL).chat_template_kwargs == {}
    for bad in ({"add_generation_prompt": False}, {"not a name": 1}, {"x": [1]}, ["enable_thinking"]):
        with pytest.raises(BodyError) as refused:
            parse_body({"messages": ASK, "chat_template_kwargs": bad}, CHAT_URL)
        assert refused.value.param == "chat_template_kwargs"
    request = parse_responses_body({"input": "hi", "reasoning": {"effort": "none", "summary": "auto"}})
    assert request.chat_template_kwargs["enable_thinking"] is False
    thought = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "."}]}
    again = parse_responses_body({"input": [{"role": "user", "content": "hi"}, thought]})
    assert [m.role for m in again.messages] == ["user"]  # an earlier turn's reasoning is dropped, as templates do
    with pytest.raises(BodyError) as refused:
        parse_responses_body({"input": [thought]})
    assert refused.value.param == "input"


def test_a_whole_answer_and_a_batch_line_keep_the_reasoning_apart():
    result = GenerationResult(text="<think>\nWhy.\n</think>\n\nBecause.", token_ids=[1], finish_reason="stop",
                              usage=Usage(prompt_tokens=1, completion_tokens=1),
                              chat_format=ChatFormat(reasoning=THINK))
    request = GenerationRequest(messages=ASK)
    message = response_body(result, CHAT_URL, "job", request=request)["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"], message["reasoning"]) == ("Because.", "Why.\n", "Why.\n")
    off = GenerationRequest(messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert "reasoning" not in response_body(result, CHAT_URL, "job", request=off)["choices"][0]["message"]


# ----- a real tiny model: the grammar after the reasoning -----
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_answer_follows_the_reasoning_and_validates(qwen3_model, r1_model, temperature):
    """An untrained model: the grammar bounds its reasoning and makes it close it, then write JSON that
    validates. With thinking off the JSON comes at once."""
    schema = {"type": "json_schema", "json_schema": {"name": "mood", "schema": ANSWER}}
    for model_dir, fmt in ((r1_model, THINK_IN_PROMPT), (qwen3_model, THINK)):
        engine = engine_for(model_dir, max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_bytes=1 << 25)
        assert engine.chat_format.reasoning == fmt
        requests = {f"{i}": GenerationRequest(messages=ASK, response_format=schema, sampling=SamplingParams(
            max_tokens=ANSWER_TOKENS, temperature=temperature, seed=i)) for i in range(4)}
        requests["off"] = requests["0"].model_copy(update={"chat_template_kwargs": {"enable_thinking": False}})
        for request_id, request in requests.items():
            engine.add(request_id, request)
        finals, reasoned = run_all(engine), []
        for request_id, out in finals.items():
            thinking = request_id != "off"
            reasoning, content = split_answer(out.text, fmt, thinking)
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(content), ANSWER)
            if fmt == THINK_IN_PROMPT and thinking:
                close = engine.loaded.tokenizer.convert_tokens_to_ids("</think>")  # the marker is one token
                assert reasoning is not None and out.token_ids.index(close) <= ANSWER_TOKENS * MAX_REASONING_SHARE
            if not thinking:
                assert reasoning is None and out.text == content
            reasoned.append(reasoning is not None)
        assert any(reasoned) and len(finals) == len(requests)  # Qwen3's manner: reasoning is the model's to open


def test_a_tool_call_follows_the_reasoning(r1_model):
    tool = {"type": "function", "function": {"name": "rate", "parameters": ANSWER}}
    engine = engine_for(r1_model, max_num_seqs=4, max_num_batched_tokens=1024, kv_cache_bytes=1 << 25)
    request = GenerationRequest(messages=ASK, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                sampling=SamplingParams(max_tokens=2 * ANSWER_TOKENS))
    engine.add("call", request)
    out = run_all(engine)["call"]
    result = GenerationResult(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                              usage=Usage(prompt_tokens=1, completion_tokens=1), chat_format=engine.chat_format)
    choice = response_body(result, CHAT_URL, "job", request=request)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"], out.text
    [call] = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), ANSWER)


# ----- through the gateway, as the SDK reads it -----
@pytest.fixture
def sdk(fake_redis, keep_signal_handlers, r1_model):
    """The openai SDK on the gateway in-process, and a worker thread serving the tiny R1-like model."""
    engine = engine_for(r1_model, max_num_seqs=4, max_num_batched_tokens=1024, kv_cache_bytes=1 << 25)
    worker = JobWorker(keys.priority_queue_names([keys.DEFAULT_QUEUE], model=MODEL), engine, connection=fake_redis,
                       model_name=MODEL, lease_s=5)
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    wait_for(lambda: fake_redis.exists(keys.worker_stats_key(worker.name)), 30, "the worker's stats")
    aconnection = aioredis.FakeRedis(server=fake_redis.connection_pool.connection_kwargs["server"])
    config = GatewayConfig(api_keys=ApiKeys(["key-a"]))
    try:
        with TestClient(create_app(config, fake_redis, aconnection)) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="key-a", http_client=http, max_retries=0)
    finally:
        worker.request_stop(None, None)
        thread.join(30)


def test_the_sdk_reads_the_reasoning_of_chat_answers_and_responses(sdk):
    fmt = {"type": "json_schema", "json_schema": {"name": "mood", "schema": ANSWER}}
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=ANSWER_TOKENS)
    message = answer.choices[0].message
    jsonschema.validate(json.loads(message.content), ANSWER)
    assert message.reasoning_content == message.reasoning and message.reasoning_content
    assert "</think>" not in message.content + message.reasoning_content
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=ANSWER_TOKENS,
                                              stream=True, temperature=0))
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    greedy = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=ANSWER_TOKENS,
                                         temperature=0).choices[0].message
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in streamed) == greedy.reasoning_content
    assert "".join(d.content or "" for d in streamed) == greedy.content
    text = {"format": {"type": "json_schema", "name": "mood", "schema": ANSWER}}
    response = sdk.responses.create(model=MODEL, input="How do you feel?", text=text, max_output_tokens=ANSWER_TOKENS,
                                    temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == greedy.reasoning_content and response.output[0].summary == []
    assert response.output_text == greedy.content
    stored = sdk.responses.retrieve(response.id)  # the stored response keeps its reasoning
    assert [item.type for item in stored.output] == ["reasoning", "message"] and stored.output == response.output
    events = list(sdk.responses.create(model=MODEL, input="How do you feel?", text=text,
                                       max_output_tokens=ANSWER_TOKENS, temperature=0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == greedy.reasoning_content
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning", "message"] and [e.output_index for e in done] == [0, 1]
    assert events[-1].response.output[0].content[0].text == deltas
    quiet = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=ANSWER_TOKENS,
                                        reasoning_effort="none").choices[0].message
    assert getattr(quiet, "reasoning_content", None) is None
    jsonschema.validate(json.loads(quiet.content), ANSWER)
