"""`batcher run` end to end on a tiny model: results in input order, bad lines as error lines, usage as OpenAI
reports it (with the prompt tokens found in the prefix cache)."""

import json

from click.testing import CliRunner
from openai.types import CompletionUsage

from rqbatcher.cli import main
from tests.engine_helpers import reference_tokens

DOCUMENT = list(range(20, 40))  # one whole block of 16 tokens, and 4 more


def test_run_writes_results_in_order_and_survives_bad_lines(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen2")
    lines = [
        {"custom_id": "long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": DOCUMENT + [5, 6, 7, 8], "max_tokens": 12, "ignore_eos": True}},
        "this is not json",
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": list(range(3, 200)), "max_tokens": 4}},
        {"custom_id": "short", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": [9, 10], "max_tokens": 2, "ignore_eos": True}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "seed": 7,
                  "temperature": 0.8}},
        {"custom_id": "same-document", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": DOCUMENT + [11], "max_tokens": 2, "ignore_eos": True}},
        {"custom_id": "response", "method": "POST", "url": "/v1/responses",
         "body": {"input": "hello", "instructions": "Be brief.", "max_output_tokens": 3}},
        {"custom_id": "embedding", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello"}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    dst = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(dst),
                                       "--max-model-len", "128", "--max-num-batched-tokens", "8", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["long", None, "too-long", "short", "chat", "same-document", "response",
                                           "embedding"]
    long = out[0]["response"]["body"]
    assert long["choices"][0]["token_ids"] == reference_tokens(model, DOCUMENT + [5, 6, 7, 8], 12)
    assert long["choices"][0]["finish_reason"] == "length"
    usage = CompletionUsage.model_validate(long["usage"])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (24, 12, 36)
    assert usage.prompt_tokens_details.cached_tokens == 0
    same = out[5]["response"]["body"]
    assert CompletionUsage.model_validate(same["usage"]).prompt_tokens_details.cached_tokens == 16
    assert same["choices"][0]["token_ids"] == reference_tokens(model, DOCUMENT + [11], 2)
    assert "not valid JSON" in out[1]["error"]["message"] and out[1]["response"] is None
    assert "max_model_len" in out[2]["error"]["message"]
    assert out[3]["response"]["body"]["choices"][0]["token_ids"] == reference_tokens(model, [9, 10], 2)
    chat = out[4]["response"]["body"]  # a chat line is answered as a chat completion
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 3
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    response = out[6]["response"]["body"]  # a responses line is answered as a response object
    assert response["object"] == "response" and response["status"] in ("completed", "incomplete")
    assert response["output"][0]["type"] == "message" and response["usage"]["output_tokens"] <= 3
    assert "embed" in out[7]["error"]["message"]  # a causal LM's worker generates unless told --task embed
    assert "5 succeeded, 3 failed" in result.output
