"""guidellm (vLLM's load generator, a client we did not write) against a real `batcher serve` process, a real
`batcher worker` on a tiny model and the real Redis: a short concurrent run in each request format, chat
completions and text completions, with no error and tokens in every answer.

guidellm runs as its CLI, in its own process, exactly as a user would run it; its JSON report is the evidence.
Nothing may be downloaded: the tokenizer is the tiny model's own (trained locally), the Hub is offline, every
proxy variable points at a closed port (only 127.0.0.1 goes direct) and the Hugging Face cache is a fresh folder
that must stay without a `hub` download."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import test_gateway
from tests.e2e.test_gateway import KEY_A, MODEL
from tests.reliability.support import free_port

gateway, workers = test_gateway.gateway, test_gateway.workers  # the module's own worker and gateway

pytestmark = pytest.mark.timeout(300)
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 2, 16, 8
RUN_S = 120  # guidellm imports torch, datasets and transformers before its first request (~10 s on 2 cores)


def guidellm_command(target: str, request_format: str, tokenizer: Path, report: Path) -> list[str]:
    """`guidellm run`: a concurrent profile of STREAMS streams, REQUESTS requests of synthetic text, greedy (its
    prompts are seeded: the same every run)."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={target},model={MODEL},api_key={KEY_A},"
                         f"request_format={request_format},extras.body.temperature=0",
            "--profile", f"kind=concurrent,streams={STREAMS}",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def offline_env(hf_home: Path) -> dict[str, str]:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: any outside request fails at once
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(hf_home), "HTTP_PROXY": closed, "HTTPS_PROXY": closed, "ALL_PROXY": closed,
            "http_proxy": closed, "https_proxy": closed, "all_proxy": closed,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("request_format, id_prefix", [("/v1/chat/completions", "chatcmpl-"),
                                                       ("/v1/completions", "cmpl-")], ids=["chat", "text"])
def test_a_guidellm_run_gets_every_request_answered_with_tokens(gateway, tiny_model_dir, tmp_path, request_format,
                                                               id_prefix):
    base, _, _ = gateway
    field = "messages" if request_format == "/v1/chat/completions" else "prompt"
    report, hf_home = tmp_path / "guidellm.json", tmp_path / "hf-home"
    done = subprocess.run(guidellm_command(base, request_format, tiny_model_dir("llama"), report),
                          env=offline_env(hf_home), capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0 and report.exists(), done.stdout[-3000:] + done.stderr[-3000:]

    [benchmark] = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (REQUESTS, 0, 0), done.stdout[-3000:]
    assert benchmark["config"]["strategy"]["streams"] == STREAMS
    requests = benchmark["requests"]["successful"]
    assert len(requests) == REQUESTS and not benchmark["requests"]["errored"]
    for request in requests:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] and body["ignore_eos"] and sorted({"messages", "prompt"} & set(body)) == [field]
        assert request["response_id"].startswith(id_prefix)  # it reached the endpoint of its format
        limit = body["max_tokens" if field == "prompt" else "max_completion_tokens"]
        assert (body["temperature"], limit) == (0, OUTPUT_TOKENS)
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS  # the usage that the stream reported
        assert request["input_metrics"]["text_tokens"] >= PROMPT_TOKENS
        # A random tiny model may write tokens with no text (</s>, half a character): guidellm then sees no first
        # token, and leaves the request out of its TTFT (it is still a success, with its usage)
        timings = request["info"]["timings"]
        if request["output"]:
            assert timings["request_start"] < timings["first_token_iteration"] <= timings["last_token_iteration"]
    ttft = benchmark["metrics"]["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == sum(1 for r in requests if r["output"]) > 0 and ttft["min"] > 0
    assert not (hf_home / "hub").exists() or not any((hf_home / "hub").iterdir())  # nothing was downloaded
