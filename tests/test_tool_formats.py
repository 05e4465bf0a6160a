"""Tool-call formats by model family (batcher/tools/formats.py): the worker finds each family's format from its chat
template and tokenizer, the grammar makes an untrained tiny model write valid calls in it (its markers as the
special tokens the family has), and hand-written answers of each family read back into the same calls, whole or
streamed in any pieces. The templates below are our own, written after each family's published format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rqbatcher.client import Client
from rqbatcher.gateway.completions import Chunks, UsageOptions
from rqbatcher.jobs import keys
from rqbatcher.openai.generation_answer import response_body
from rqbatcher.openai.generation_body import CHAT_URL
from rqbatcher.schema import ChatFormat, GenerationRequest, GenerationResult, StreamEvent, Usage
from rqbatcher.tools.calls import CallReader, call_id, read_answer
from rqbatcher.tools.formats import FORMATS, tool_format
from rqbatcher.workers.engine.detokenize import IncrementalDetokenizer
from rqbatcher.workers.engine.tool_format_probe import served_tool_format, tool_format_name
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.engine_helpers import engine_for, run_all
from tests.fake_engine import FakeEngine
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401
from tests.test_tool_calls import SCHEMAS, TOOLS, answers, assert_calls_validate, chat, named
from tests.tiny_models import (
    CHAT_TEMPLATE,
    LONG_CONTEXT,
    TOOLS_CHAT_TEMPLATE,
    VOCAB_SIZE,
    build_tiny_model,
    build_tokenizer,
)

# Qwen2.5's manner: <tool_call> tags (special tokens here) around {"name", "arguments"}, calls one a line
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant{% if m['content'] %}\n{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}\n<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1's: the tools in the first user turn, a call as {"name", "parameters"}, a result from `ipython`
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "<|eot_id|>{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'user' and tools and loop.first %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}.Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "{{ m['content'] }}<|eot_id|>"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": "
    "{{ c['function']['arguments'] | tojson }}}{% endfor %}<|eot_id|>"
    "{% elif m['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral's (tekken): [AVAILABLE_TOOLS] before the asking turn, calls as one [TOOL_CALLS] list
MISTRAL_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}{% if tools and loop.last or tools and loop.first %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS][{% for c in m['tool_calls'] %}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}, "
    "\"id\": \"{{ c['id'] }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
# Newer Mistral tokenizers' (with [ARGS]): each call as [TOOL_CALLS]name[ARGS]{arguments}
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "[TOOL_CALLS][{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}, \"id\": \"{{ c['id'] }}\"}{% if not loop.last %}, {% endif %}"
    "{% endfor %}]",
    "{% for c in m['tool_calls'] %}[TOOL_CALLS]{{ c['function']['name'] }}[ARGS]"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}")
VOCAB_PADDING = 16  # the model's vocabulary is wider than the tokenizer's, as real models pad theirs
MISTRAL_SPECIAL = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]"]
FAMILY_MODELS = {  # format -> (architecture, template, special tokens)
    "hermes": ("qwen2", QWEN_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]),
    "llama3_json": ("llama", LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                               "<|eot_id|>", "<|python_tag|>"]),
    "mistral": ("mistral", MISTRAL_TEMPLATE, MISTRAL_SPECIAL),
    "mistral_args": ("llama", MISTRAL_ARGS_TEMPLATE, [*MISTRAL_SPECIAL, "[ARGS]"]),
}


def family_tokenizer(name: str):
    _, template, special = FAMILY_MODELS[name]
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = template
    return tokenizer


def build_family_model(name: str, path: Path) -> Path:
    tokenizer = family_tokenizer(name)
    build_tiny_model(FAMILY_MODELS[name][0], path, vocab_size=len(tokenizer) + VOCAB_PADDING,
                     max_position_embeddings=LONG_CONTEXT)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILY_MODELS))
def family_model(request, tmp_path_factory):
    return request.param, build_family_model(request.param, tmp_path_factory.mktemp(f"tools-{request.param}"))


# ----- the worker finds the format -----
def test_the_probe_finds_each_family_and_the_fallback_for_a_template_without_tools():
    for name in FAMILY_MODELS:
        tokenizer = family_tokenizer(name)
        assert tool_format_name(tokenizer) == name
        served = served_tool_format(tokenizer, name)
        assert served.special_ids and all(tokenizer.convert_tokens_to_ids(m) == i
                                          for m, i in served.special_ids.items())
    plain = build_tokenizer()
    assert tool_format_name(plain) == "batcher"  # CHAT_TEMPLATE reads no tools
    plain.chat_template = TOOLS_CHAT_TEMPLATE  # Hermes' text, with <tool_call> as plain text
    assert tool_format_name(plain) == "hermes" and served_tool_format(plain, "hermes").special_ids == {}
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools | length }}"
    assert tool_format_name(plain) == "batcher"  # reads tools, writes no call
    assert tool_format(None) is tool_format("no-such-format") is FORMATS["batcher"]


def test_the_detokenizer_keeps_only_the_call_markers_it_is_told_to():
    tokenizer = family_tokenizer("hermes")
    ids = tokenizer.encode("<|im_start|><tool_call>\n{}\n</tool_call><|im_end|>")
    marker_ids = tuple(served_tool_format(tokenizer, "hermes").special_ids.values())
    kept, dropped = IncrementalDetokenizer(tokenizer, [], kept=marker_ids), IncrementalDetokenizer(tokenizer, [])
    for token in ids:
        kept.push(token)
        dropped.push(token)
    assert kept.text + kept.flush() == "<tool_call>\n{}\n</tool_call>" and dropped.text == "\n{}\n"


# ----- an untrained model writes valid calls in its family's format -----
def test_required_named_and_auto_calls_validate_in_each_family_format(family_model):
    name, path = family_model
    engine = engine_for(path, max_num_seqs=16, max_num_batched_tokens=4096, kv_cache_bytes=1 << 27)
    assert engine.chat_format.tools == name and engine.grammars.tool_format.special_ids
    requests = {}
    for i, tool in enumerate(TOOLS):  # greedy under `required`, sampled (a seed each) under a named tool
        requests[f"required-{i}"] = chat([tool], "required", parallel=i % 6 == 0)
        requests[f"named-{i}"] = chat([tool, TOOLS[(i + 1) % len(TOOLS)]], named(f"tool_{i}"), parallel=False,
                                      temperature=1.0, seed=i)
    auto = {f"auto-{seed}": chat(TOOLS[seed:seed + 2], temperature=1.0, seed=seed, max_tokens=40) for seed in range(6)}
    answered = answers(engine, {**requests, **auto})
    for request_id in auto:  # text that never opens a call, or calls that validate
        choice = answered.pop(request_id)
        content = choice["message"]["content"]
        if not assert_calls_validate(choice, TOOLS) and content is not None:  # else: a call cut by max_tokens
            assert read_answer(content, "j", chat_format=engine.chat_format) == (content, []), (name, choice)
    for request_id, choice in answered.items():
        calls = assert_calls_validate(choice, TOOLS)
        assert calls and choice["message"]["content"] is None, (name, request_id, choice)
        assert {c["function"]["name"] for c in calls} == {f"tool_{request_id.split('-')[1]}"}
    assert len(SCHEMAS) >= 20
    engine.add("tokens", chat(TOOLS[:1], "required", parallel=False))
    written = set(run_all(engine)["tokens"].token_ids)  # the markers are the family's special tokens, as trained
    fmt = engine.grammars.tool_format
    assert {i for m, i in fmt.special_ids.items() if m in fmt.call_text("f", "{}")} <= written


# ----- hand-written answers of each family read back -----
ONE = [("get_weather", {"city": "Paris", "unit": "c"})]
SEVERAL = [("get_weather", {"city": "Oslo"}), ("search", {"q": "a } \" ] tricky", "n": [1, {"k": None}]}),
           ("noop", {})]
HANDWRITTEN = {  # (format, answer text, calls it holds)
    "hermes-one": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
                             "</tool_call>", ONE),
    "hermes-several": ("hermes", "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n'
                                         "</tool_call>\n" for n, a in SEVERAL), SEVERAL),
    "llama3-one": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', ONE),
    "llama3-tagged": ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                                     '"unit": "c"}}', ONE),
    "llama3-several": ("llama3_json", "; ".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}'
                                                for n, a in SEVERAL), SEVERAL),
    "llama3-lines": ("llama3_json", "\n".join(f'{{"name": "{n}", "parameters": {json.dumps(a)}}}'
                                              for n, a in SEVERAL), SEVERAL),
    "mistral-one": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
                    ONE),
    "mistral-several": ("mistral", "[TOOL_CALLS] [" + ", ".join(
        f'{{"name": "{n}", "arguments": {json.dumps(a)}, "id": "abcdefgh{i}"}}' for i, (n, a) in enumerate(SEVERAL))
        + "]", SEVERAL),
    "mistral-args": ("mistral_args", "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in SEVERAL), SEVERAL),
    "batcher-several": ("batcher", "".join(FORMATS["batcher"].call_text(n, json.dumps(a)) for n, a in SEVERAL),
                        SEVERAL),
}
TEXTS = {"hermes": "It is sunny in <b>Paris</b> {\"name\": 1}.", "llama3_json": 'Sunny. {"name": "x"} is text here.',
         "mistral": "[TOOL] no call [here]", "mistral_args": "[ARGS] is no call", "batcher": "<tool> is not it"}


def streamed(text: str, chat_format: ChatFormat, rng: random.Random) -> tuple[str, list[dict]]:
    """The answer fed in random pieces: its content, and the calls its deltas build."""
    reader, content, built = CallReader("job-7", 0, True, chat_format), "", {}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    deltas = []
    for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
        more, new = reader.feed(piece)
        content, deltas = content + more, deltas + new
    more, new = reader.finish()
    for delta in deltas + new:
        first = delta.index not in built  # a call's first piece names it, and only that one
        assert (delta.id is not None and delta.name is not None) == first, delta
        call = built.setdefault(delta.index, {"id": delta.id, "name": delta.name, "arguments": ""})
        call["arguments"] += delta.arguments
    return content + more, list(built.values())


@pytest.mark.parametrize("case", sorted(HANDWRITTEN))
def test_handwritten_calls_of_each_family_read_the_same_whole_and_streamed(case):
    name, text, expected = HANDWRITTEN[case]
    chat_format = ChatFormat(tools=name)
    content, calls = read_answer(text, "job-7", chat_format=chat_format)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert [c.id for c in calls] == [call_id("job-7", 0, i) for i in range(len(expected))]
    rng = random.Random(case)
    for _ in range(30):
        streamed_content, streamed_calls = streamed(text, chat_format, rng)
        assert streamed_content == ""
        assert [(c["id"], c["name"], c["arguments"]) for c in streamed_calls] == [
            (c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_without_a_call_marker_is_content_in_each_family(name):
    text, chat_format = TEXTS[name], ChatFormat(tools=name)
    assert read_answer(text, "j", chat_format=chat_format) == (text, [])
    rng = random.Random(name)
    for _ in range(20):
        assert streamed(text, chat_format, rng) == (text, [])


def test_text_before_a_marked_call_is_content_and_a_cut_call_is_left_out():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    content, calls = read_answer(text + '<tool_call>\n{"name": "noop", "arguments": {"a": [1, ', "j",
                                 chat_format=ChatFormat(tools="hermes"))
    assert content == "Let me check." and [(c.name, c.arguments) for c in calls] == [("get_weather",
                                                                                       '{"city": "Oslo"}')]
    content, calls = streamed(text, ChatFormat(tools="hermes"), random.Random(3))
    assert content == "Let me check.\n" and [c["name"] for c in calls] == ["get_weather"]
    bad_escape = '<tool_call>\n{"name": "a\\q", "arguments": {}}\n</tool_call>'  # kept as written, not a crash
    assert [c.name for c in read_answer(bad_escape, "j", chat_format=ChatFormat(tools="hermes"))[1]] == ["a\\q"]


# ----- the readers take the worker's format -----
def test_a_stream_reads_calls_in_the_format_its_start_event_names():
    request = chat(TOOLS[:1])
    chunks = Chunks(CHAT_URL, "job-7", 0, "m", UsageOptions(), "default", request)
    chunks.read_as(StreamEvent(type="start", chat_format=ChatFormat(tools="mistral")).chat_format)
    _, text, expected = HANDWRITTEN["mistral-several"]
    sent = [chunks.text(text[i:i + 7]) for i in range(0, len(text), 7)] + chunks.finish([("stop", None)])
    deltas = [json.loads(chunk[len(b"data: "):]) for chunk in sent if chunk is not None]
    pieces = [call for d in deltas for c in d["choices"] for call in c["delta"].get("tool_calls", [])]
    assert [p["function"]["name"] for p in pieces if "id" in p] == [n for n, _ in expected]
    assert deltas[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(c["delta"].get("content") is None for d in deltas for c in d["choices"])


def test_a_whole_answer_reads_calls_in_the_format_its_result_carries():
    _, text, expected = HANDWRITTEN["llama3-several"]
    result = GenerationResult(text=text, token_ids=[], finish_reason="stop",
                              usage=Usage(prompt_tokens=1, completion_tokens=9),
                              chat_format=ChatFormat(tools="llama3_json"))
    choice = response_body(result, CHAT_URL, request_id="job-7", request=chat(TOOLS[:1]))["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [n for n, _ in expected]
    fallback = response_body(result.model_copy(update={"chat_format": None}), CHAT_URL, request_id="job-7",
                             request=chat(TOOLS[:1]))["choices"][0]
    assert fallback["message"]["content"] == text and "tool_calls" not in fallback["message"]


def test_the_fallback_format_still_serves_a_template_without_tools(tmp_path):
    path = build_tiny_model("llama", tmp_path, max_position_embeddings=LONG_CONTEXT)
    engine = engine_for(path, max_num_seqs=4, kv_cache_bytes=1 << 26)
    assert engine.chat_format.tools == "batcher" and tool_format_name(engine.loaded.tokenizer) == "batcher"
    assert CHAT_TEMPLATE == engine.loaded.tokenizer.chat_template and VOCAB_SIZE == len(engine.loaded.tokenizer)
    choice = answers(engine, {"one": chat(TOOLS[:1], "required", parallel=False)})["one"]
    assert [c["function"]["name"] for c in assert_calls_validate(choice, TOOLS)] == ["tool_0"]
    assert isinstance(GenerationRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS[:1]}).grammar(), str)


@pytest.mark.usefixtures("keep_signal_handlers")
def test_the_worker_names_its_format_on_a_chat_jobs_start_event_and_result(fake_redis):
    engine = FakeEngine()
    engine.chat_format = ChatFormat(tools="mistral")
    client = Client(fake_redis, queue="w", result_ttl=600)
    chat_id, text_id = client.submit_many([{"messages": [{"role": "user", "content": "hi"}],
                                            "sampling": {"max_tokens": 2}},
                                           {"prompt": "hi", "sampling": {"max_tokens": 2}}])
    assert JobWorker(keys.priority_queue_names(["w"]), engine, connection=fake_redis).work(burst=True)
    starts = {job_id: StreamEvent.from_fields(fake_redis.xrange(keys.stream_key(job_id))[0][1])
              for job_id in (chat_id, text_id)}
    assert starts[chat_id].type == "start" and starts[chat_id].chat_format == engine.chat_format
    assert starts[text_id].chat_format is None  # a completion is read as text
    assert client.result(chat_id, timeout=5).chat_format == engine.chat_format
    assert client.result(text_id, timeout=5).chat_format is None
