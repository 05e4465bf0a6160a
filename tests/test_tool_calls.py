"""Tool calls: the request's checks, the prompt a template is given, the grammar on a real tiny model (every call
it returns validates, over 24 tool schemas, greedy and sampled), and the calls read back, whole or streamed."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from pydantic import ValidationError

from rqbatcher.openai.generation_answer import response_body
from rqbatcher.openai.generation_body import CHAT_URL, BodyError, parse_body
from rqbatcher.schema import GenerationRequest, GenerationResult, Usage
from rqbatcher.tools.calls import CallReader, call_id, read_answer
from rqbatcher.tools.grammar import MAX_CALLS_PER_ANSWER, call_text, closed_objects
from rqbatcher.tools.prompt import chat_inputs, template_reads_tools
from tests.engine_helpers import engine_for, run_all
from tests.tiny_models import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, build_tool_model

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [  # 24 argument schemas: scalars, bounds, enums, nesting, arrays, optional fields, unions, refs
    {**OBJ, "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
    {**OBJ, "properties": {"count": {"type": "integer"}}, "required": ["count"]},
    {**OBJ, "properties": {"ratio": {"type": "number"}}, "required": ["ratio"]},
    {**OBJ, "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
    {**OBJ, "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    {**OBJ, "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]},
    {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
     "required": ["tags"]},
    {**OBJ, "properties": {"point": {**OBJ, "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                     "required": ["x", "y"]}}, "required": ["point"]},
    {**OBJ, "properties": {"a": {"type": "string", "maxLength": 8}, "b": {"type": "integer"}}, "required": ["a"]},
    {**OBJ, "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}}, "required": ["id"]},
    {**OBJ, "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}},
     "required": ["v"]},
    {**OBJ, "properties": {"v": {"type": ["integer", "null"]}}, "required": ["v"]},
    {**OBJ, "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"]},
    {**OBJ, "properties": {"items": {"type": "array", "items": {**OBJ, "properties": {"q": {"type": "integer"}},
                                                                "required": ["q"]}, "maxItems": 2}},
     "required": ["items"]},
    {"type": "object", "properties": {}},
    {**OBJ, "properties": {"price": {"type": "number", "minimum": 0}}, "required": ["price"]},
    {**OBJ, "properties": {"mode": {"const": "fast"}}, "required": ["mode"]},
    {**OBJ, "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6}}, "required": ["s"]},
    {**OBJ, "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2}},
     "required": ["m"]},
    {**OBJ, "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                                    "items": False}}, "required": ["pair"]},
    {**OBJ, "$defs": {"loc": {**OBJ, "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
     "properties": {"at": {"$ref": "#/$defs/loc"}}, "required": ["at"]},
    {**OBJ, "properties": {"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["k"]},
    {**OBJ, "properties": {"e": {"type": "string", "enum": ["x", "y z", "w"]}, "opt": {"type": "boolean"}},
     "required": ["e"]},
    {**OBJ, "properties": {"deep": {**OBJ, "properties": {"deeper": {**OBJ, "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}}, "required": ["deeper"]}}, "required": ["deep"]},
]
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}",
                                           "parameters": schema}} for i, schema in enumerate(SCHEMAS)]
ASK = [{"role": "user", "content": "Please call a tool."}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("plain-model"), CHAT_TEMPLATE)


def chat(tools, tool_choice=None, messages=ASK, parallel=True, **sampling) -> GenerationRequest:
    body = {"messages": messages, "tools": tools, "sampling": {"max_tokens": 200, **sampling},
            "parallel_tool_calls": parallel}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return GenerationRequest.model_validate(body)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def answer_of(out, request, chat_format=None) -> dict:
    result = GenerationResult(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason,
                              usage=Usage(prompt_tokens=1, completion_tokens=len(out.token_ids)),
                              chat_format=chat_format)
    return response_body(result, CHAT_URL, request_id="job-1", request=request)["choices"][0]


def answers(engine, requests: dict[str, GenerationRequest]) -> dict[str, dict]:
    """Each request run to its end on `engine`, answered as the chat endpoint answers it (in the engine's format)."""
    for request_id, request in requests.items():
        engine.add(request_id, request)
    finals = run_all(engine)
    return {request_id: answer_of(finals[request_id], request, engine.chat_format)
            for request_id, request in requests.items()}


def assert_calls_validate(choice: dict, tools: list[dict]) -> list[dict]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = choice["message"].get("tool_calls") or []
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return calls


# ----- on a real tiny model -----
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "sampled"])
def test_required_and_named_tools_give_calls_whose_arguments_validate(tool_model, sampling):
    engine = engine_for(tool_model, max_num_seqs=16, max_num_batched_tokens=2048, kv_cache_bytes=1 << 27)
    requests = {}
    for i, tool in enumerate(TOOLS):  # one or two tools a request: the tiny tokenizer spends ~200 tokens on each
        requests[f"required-{i}"] = chat([tool], "required", parallel=i % 4 == 0, **sampling)
        requests[f"named-{i}"] = chat([tool, TOOLS[(i + 1) % len(TOOLS)]], named(f"tool_{i}"), parallel=False,
                                      **sampling)
    for request_id, choice in answers(engine, requests).items():
        calls = assert_calls_validate(choice, TOOLS)
        assert calls and choice["message"]["content"] is None, (request_id, choice)
        assert {c["function"]["name"] for c in calls} == {f"tool_{request_id.split('-')[1]}"}
        if choice["finish_reason"] != "length":
            assert choice["finish_reason"] == "tool_calls"


def test_auto_answers_text_or_calls_that_validate_and_none_answers_text(plain_model):
    engine = engine_for(plain_model, max_num_seqs=16, max_num_batched_tokens=2048, kv_cache_bytes=1 << 27)
    requests = {f"auto-{seed}": chat(TOOLS[seed:seed + 2], temperature=1.0, seed=seed, max_tokens=60)
                for seed in range(12)}
    requests["none"] = chat(TOOLS[:2], "none")
    answered = answers(engine, requests)
    for choice in answered.values():
        calls = assert_calls_validate(choice, TOOLS)
        if not calls:
            assert "<tool_call>" not in (choice["message"]["content"] or ""), choice
    assert answered["none"]["message"].get("tool_calls") is None


def test_parallel_calls_are_bounded_and_one_call_ends_the_answer_without_them(tool_model):
    engine = engine_for(tool_model, max_num_seqs=4, max_num_batched_tokens=2048, kv_cache_bytes=1 << 26)
    noop = [{"type": "function", "function": {"name": "noop"}}]
    engine.add("many", chat(noop, "required", max_tokens=2000, ignore_eos=False))
    engine.add("one", chat(noop, "required", parallel=False, max_tokens=2000))
    finals = run_all(engine)
    assert finals["one"].text == call_text("noop", "{}") and finals["one"].finish_reason == "stop"
    assert finals["many"].text.count("<tool_call>") <= MAX_CALLS_PER_ANSWER
    assert finals["many"].finish_reason == "stop"


def test_objects_that_list_their_properties_are_closed_to_others_and_the_schema_is_left_as_given():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}},
                                               "e": {"type": "object", "additionalProperties": True}},
              "$defs": {"f": {"anyOf": [{"properties": {"g": {}}}, {"type": "string"}]}},
              "patternProperties": {"^x": {"type": "integer"}}}
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before and "additionalProperties" not in closed  # patternProperties decide
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["e"]["additionalProperties"] is True
    assert closed["$defs"]["f"]["anyOf"][0]["additionalProperties"] is False


# ----- the prompt -----
def conversation():
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "tool_0", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]


def test_a_template_with_tools_gets_them_and_the_calls_and_results_in_transformers_shape():
    request = chat(TOOLS[:2], messages=conversation())
    assert template_reads_tools(TOOLS_CHAT_TEMPLATE) and not template_reads_tools(CHAT_TEMPLATE)
    assert template_reads_tools({"default": CHAT_TEMPLATE, "tool_use": TOOLS_CHAT_TEMPLATE})
    messages, tools = chat_inputs(request, template_has_tools=True)
    assert [t["function"]["name"] for t in tools] == ["tool_0", "tool_1"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "tool_0", "arguments": {"city": "Oslo"}}
    assert messages[3] == {"role": "tool", "content": "-3 C", "tool_call_id": "c1", "name": "tool_0"}
    assert chat_inputs(request.model_copy(update={"tool_choice": "none"}), True)[1] is None


def test_a_template_without_tools_gets_the_fallback_prompt_and_roles_that_alternate():
    messages, tools = chat_inputs(chat(TOOLS[:2], messages=conversation()), template_has_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert json.dumps(TOOLS[0]) in messages[0]["content"] and messages[0]["content"].endswith("Be brief.")
    assert messages[2]["content"] == call_text("tool_0", '{"city": "Oslo"}')
    assert messages[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    later = [*conversation(), {"role": "user", "content": "And tomorrow?"}]
    assert chat_inputs(chat(TOOLS[:2], messages=later), False)[0][-1]["content"].endswith("</tool_response>\n"
                                                                                          "And tomorrow?")


# ----- reading calls back -----
def test_a_streamed_answer_in_any_pieces_gives_the_calls_of_the_whole_answer():
    text = call_text("tool_1", '{"count":12}') + call_text("tool_0", '{"city":"a}\\"b"}')
    whole_content, whole = read_answer(text, "job-9")
    assert whole_content is None and [(c.name, c.arguments) for c in whole] == [
        ("tool_1", '{"count":12}'), ("tool_0", '{"city":"a}\\"b"}')]
    rng = random.Random(0)
    for _ in range(50):
        reader, cuts = CallReader("job-9"), sorted(rng.sample(range(1, len(text)), 6))
        deltas = []
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            content, new = reader.feed(piece)
            assert content == ""
            deltas += new
        deltas += reader.finish()[1]
        streamed: dict[int, dict] = {}
        for d in deltas:
            item = streamed.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            item["arguments"] += d.arguments
        assert [(s["id"], s["name"], s["arguments"]) for s in streamed.values()] == [
            (c.id, c.name, c.arguments) for c in whole]
    assert whole[1].id == call_id("job-9", 0, 1) != call_id("job-9", 1, 1)


def test_text_is_content_and_a_call_cut_short_is_left_out_of_a_whole_answer():
    reader = CallReader("j")
    assert reader.feed("<tool") == ("", [])  # may still open a call
    assert reader.feed("box is not a call") == ("<toolbox is not a call", [])
    assert read_answer("<tool_call>\nrest", "j", reads_calls=False) == ("<tool_call>\nrest", [])
    cut = call_text("a", '{"x":1}') + call_text("b", '{"y":2}')[:-20]
    content, calls = read_answer(cut, "j")
    assert content is None and [c.name for c in calls] == ["a"]
    closed = call_text("a", '{"x":1}')[:-5]  # cut inside the end tag: the arguments are whole
    assert [(c.name, c.arguments) for c in read_answer(closed, "j")[1]] == [("a", '{"x":1}')]
    reader = CallReader("j")
    streamed = reader.feed(closed)[1] + reader.finish()[1]
    assert "".join(d.arguments for d in streamed) == '{"x":1}'


# ----- bad requests never reach a worker -----
@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tool_choice": named("missing")}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "no id"}]}, "messages"),
])
def test_bad_tools_choices_and_results_are_refused_naming_the_field(change, param):
    body = {"model": "m", "messages": ASK, "tools": TOOLS[:2], **change}
    with pytest.raises(BodyError) as caught:
        parse_body(body, CHAT_URL)
    assert caught.value.param == param, str(caught.value)


def test_a_conversation_with_results_and_openai_message_shapes_is_read():
    messages = [*conversation(), {"role": "assistant", "content": "It is cold.", "refusal": None, "annotations": [],
                                  "tool_calls": []}]
    request = parse_body({"model": "m", "messages": messages, "tools": TOOLS[:1], "tool_choice": "auto",
                          "parallel_tool_calls": False}, CHAT_URL)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert request.messages[2].tool_calls[0].function.name == "tool_0" and not request.parallel_tool_calls
    with pytest.raises(ValidationError):
        GenerationRequest.model_validate({"prompt": "x", "tools": TOOLS[:1]})  # tools go with messages
