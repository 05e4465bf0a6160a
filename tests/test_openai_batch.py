import json

import pytest

from batcher.openai.batch_lines import BatchLineError, parse_batch_line


def line(body, url="/v1/completions", **extra):
    return json.dumps({"custom_id": "c1", "method": "POST", "url": url, "body": body, **extra})


def test_completion_with_sampling_fields():
    cid, req = parse_batch_line(line({"prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                                      "top_k": 3, "seed": 1, "stop": "\n", "ignore_eos": True}))
    assert cid == "c1" and req.prompt == "hi"
    s = req.sampling
    assert ((s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.ignore_eos)
            == (7, 0.5, 0.9, 3, 1, ["\n"], True))


CHAT = "/v1/chat/completions"


def test_null_means_the_default_for_every_field():
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs",
                               "service_tier", "user", "store", "response_format", "max_completion_tokens")}
    _, req = parse_batch_line(line({"prompt": "hi", **nulls}))
    _, plain = parse_batch_line(line({"prompt": "hi"}))
    assert req == plain
    with pytest.raises(BatchLineError, match="unsupported body fields: frequency_penalti"):
        parse_batch_line(line({"prompt": "hi", "frequency_penalti": None}))  # an unknown field stays refused


def test_content_parts_and_the_developer_role_read_as_text_and_system():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "name": "ann",
                 "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                {"role": "system", "content": "plain"}]
    _, req = parse_batch_line(line({"messages": messages}, url=CHAT))
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "Be brief."), ("user", "one\ntwo"), ("assistant", "ok"), ("system", "plain")]


def test_fields_that_mean_nothing_here_are_accepted_and_ignored():
    ignored = {"user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k", "store": True,
               "parallel_tool_calls": False, "reasoning_effort": "low"}
    _, req = parse_batch_line(line({"messages": [{"role": "user", "content": "x"}], **ignored}, url=CHAT))
    assert req == parse_batch_line(line({"messages": [{"role": "user", "content": "x"}]}, url=CHAT))[1]


def test_token_id_prompt_and_chat():
    assert parse_batch_line(line({"prompt": [1, 2, 3]}))[1].prompt_token_ids == [1, 2, 3]
    req = parse_batch_line(line({"messages": [{"role": "user", "content": "x"}]}, url="/v1/chat/completions"))[1]
    assert req.messages[0].content == "x"


@pytest.mark.parametrize("raw,reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (line({"prompt": "x"}, url="/v1/embeddings"), "url must be"),
    (line({"prompt": "x", "max_tokens": -1}), "max_tokens"),
    (line({"prompt": "x", "temperature": "hot"}), "temperature"),
    (line({"prompt": "x", "logprobs": 6}), "logprobs must be an integer from 0 to 5"),
    (line({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, url="/v1/chat/completions"),
     "top_logprobs needs logprobs: true"),
    (line({}), "exactly one of"),
    (line({"prompt": [1, -5]}), "token ids"),
    (line({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, url=CHAT),
     r"messages\[0\].content: only text parts are read .*'image_url'"),
    (line({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, url=CHAT), "only text parts"),
    (line({"messages": [{"role": "tool", "content": "x"}]}, url=CHAT), "role"),
])
def test_bad_lines_give_readable_reasons(raw, reason):
    with pytest.raises(BatchLineError, match=reason):
        parse_batch_line(raw)
