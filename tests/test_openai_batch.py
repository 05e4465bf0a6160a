import json

import pytest

from rqbatcher.openai.batch_lines import BatchLineError, parse_batch_line
from rqbatcher.openai.generation_body import BodyError, parse_body


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
    ignored = {"safety_identifier": "s", "prompt_cache_key": "k", "store": True,
               "verbosity": "low", "prediction": {"type": "content", "content": "x"}, "modalities": ["text"]}
    _, req = parse_batch_line(line({"messages": [{"role": "user", "content": "x"}], **ignored}, url=CHAT))
    assert req == parse_batch_line(line({"messages": [{"role": "user", "content": "x"}]}, url=CHAT))[1]


def test_openai_sampling_fields_metadata_and_user_are_kept_for_the_worker():
    fields = {"frequency_penalty": 0.5, "presence_penalty": -1, "logit_bias": {"17": -100, "3": 2.5},
              "metadata": {"team": "search"}, "user": "u-1"}
    _, req = parse_batch_line(line({"messages": [{"role": "user", "content": "x"}], **fields}, url=CHAT))
    s = req.sampling
    assert (s.frequency_penalty, s.presence_penalty, s.logit_bias) == (0.5, -1.0, {17: -100.0, 3: 2.5})
    assert (req.metadata, req.user) == ({"team": "search"}, "u-1")
    for seed in (-(2**63), -1, 2**64 - 1):  # clients send any int64 (and some a uint64)
        assert parse_batch_line(line({"prompt": "x", "seed": seed}))[1].sampling.seed == seed
    _, completion = parse_batch_line(line({"prompt": "x", "echo": True, "best_of": 3, "n": 2}))
    assert completion.echo and (completion.sampling.best_of, completion.sampling.n) == (3, 2)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # the prompt alone goes with echo or prompt_logprobs
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"prompt": "x", "metadata": {"k": 1}}, "metadata"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),  # a completions field
])
def test_fields_that_cannot_be_honoured_are_refused_naming_them(body, param):
    with pytest.raises(BodyError) as refused:
        parse_body(body, CHAT if "messages" in body else "/v1/completions")
    assert refused.value.param == param, str(refused.value)


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
    (line({}), "prompt is required"),
    (line({"prompt": [1, -5]}), "token ids"),
    (line({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, url=CHAT),
     r"messages\[0\].content: only text parts are read .*'image_url'"),
    (line({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, url=CHAT), "only text parts"),
    (line({"messages": [{"role": "tool", "content": "x"}]}, url=CHAT), "tool_call_id"),
    (line({"messages": [{"role": "critic", "content": "x"}]}, url=CHAT), "role"),
])
def test_bad_lines_give_readable_reasons(raw, reason):
    with pytest.raises(BatchLineError, match=reason):
        parse_batch_line(raw)
