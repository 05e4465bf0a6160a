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
])
def test_bad_lines_give_readable_reasons(raw, reason):
    with pytest.raises(BatchLineError, match=reason):
        parse_batch_line(raw)
