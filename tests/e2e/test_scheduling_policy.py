"""End to end: issue 43's scheduling contract under the default policy, with one real `batcher worker` (tiny model,
4 slots, no step-policy option), a real `batcher serve` with two API keys (two tenants) and the official `openai`
SDK. Bounds are derived from times measured in the same run, so that a loaded 2-core machine stretches both sides;
`python -m benchmarks.scheduling_matrix` measures the issue's figures on SmolLM2."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.gateway_pool import serving
from tests.e2e.test_interactive_latency import metric
from tests.e2e.test_urgency import sdk
from tests.jobs_support import wait_for
from tests.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.timeout(600)
QUEUE, TIGHT_QUEUE = "sched", "sched-tight"
MODEL = "tiny-sched"
KEY_A, KEY_B = "sk-sched-a", "sk-sched-b"
SLOTS = 4
BLOCK = 16  # the worker's KV block (its default)
FLOOD = 10 * SLOTS  # tenant A's requests at once: a backlog of many waves behind the slots
WAVE_TOKENS = 300  # each of A's requests runs for this many steps
B_STREAMS = 3
SIBLINGS = 6
DOCUMENT_BLOCKS = 24  # the shared document: longer than a step's share of the siblings' prompts
QUESTION_TOKENS = 20
HIT_SHARE = 0.99  # of the siblings' possible shared blocks
INFEASIBLE_TARGET_S = 0.0005
TIGHT_BUDGET = 4 * BLOCK


@pytest.fixture(scope="module")
def pool(e2e_redis, tiny_model_dir, tmp_path_factory):
    """The worker at its default step policy (no option)."""
    with serving(e2e_redis, tiny_model_dir("llama"), tmp_path_factory.mktemp("sched"), QUEUE, MODEL,
                 (KEY_A, KEY_B), SLOTS) as urls:
        yield urls


@pytest.fixture(scope="module")
def tight_pool(e2e_redis, tiny_model_dir, tmp_path_factory):
    """A worker whose step-time target is below any step's cost (infeasible) and whose token budget is a few
    blocks: a document takes many steps to prefill, and its siblings arrive meanwhile."""
    with serving(e2e_redis, tiny_model_dir("llama"), tmp_path_factory.mktemp("sched-tight"), TIGHT_QUEUE,
                 MODEL, (KEY_A, KEY_B), SLOTS,
                 "--step-time-target", str(INFEASIBLE_TARGET_S), "--max-num-batched-tokens", str(TIGHT_BUDGET)) as urls:
        yield urls


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def stream(client, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """(sent at, first text at, ended at), monotonic, of one streamed completion."""
    sent, first = time.monotonic(), None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True}):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.monotonic()
    return sent, first, time.monotonic()


@pytest.mark.parametrize("policy", ["pool", "tight_pool"])
def test_siblings_on_one_document_sent_at_once_compute_it_once(policy, request):
    """Several questions on one long document at once, while another request decodes (so that a prompt is cut into
    chunks): every one after the first finds the whole document in the prefix cache (it waits for the blocks
    another is prefilling, or joins them) instead of computing it again, at the default policy and under an
    infeasible target with a small budget alike."""
    base, metrics = request.getfixturevalue(policy)
    rng = random.Random(43 + len(policy))  # a document of each test's own: none is in the cache before
    document = tokens(DOCUMENT_BLOCKS * BLOCK, rng)
    prompts = [document + tokens(QUESTION_TOKENS, rng) for _ in range(SIBLINGS)]
    client = sdk(base, KEY_A)

    def ask(prompt: list[int]):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(SIBLINGS + 1) as threads:
        decoding = threads.submit(stream, sdk(base, KEY_B), tokens(8, rng), WAVE_TOKENS)
        wait_for(lambda: metric(metrics, "batcher_num_requests_running") >= 1, 60, "B's request to decode")
        answers = list(threads.map(ask, prompts))
        decoding.result(timeout=300)
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    possible = (SIBLINGS - 1) * DOCUMENT_BLOCKS
    assert sum(c // BLOCK for c in cached) >= HIT_SHARE * possible, (
        f"cached tokens per sibling {cached}: {sum(c // BLOCK for c in cached)} of {possible} shared blocks")


def test_each_of_a_tenants_consecutive_streams_starts_long_before_another_tenants_flood_drains(pool):
    """Tenant A floods the worker (many streamed requests, each on its own connection); tenant B then sends three
    streams one after another. Served first come first served, each of B's would wait for A's backlog ahead of it:
    at least as many waves of the slots, each as long as one of A's requests alone. Every one of B's starts within
    half that, before A's backlog has drained, not only the first (fairness per request, not per tenant once)."""
    base, metrics = pool
    a, b = sdk(base, KEY_A), sdk(base, KEY_B)
    prompt = tokens(8, random.Random(7))
    idle = [first - sent for sent, first, _ in (stream(b, prompt, 4) for _ in range(3))]
    sent, _, ended = stream(a, prompt, WAVE_TOKENS)
    alone_s = ended - sent
    answered: list[float] = []

    def ask_a(_) -> None:
        answered.append(stream(a, prompt, WAVE_TOKENS)[2])

    with ThreadPoolExecutor(FLOOD) as threads:
        flood = [threads.submit(ask_a, i) for i in range(FLOOD)]
        wait_for(lambda: metric(metrics, "batcher_num_requests_running") == SLOTS, 60, "A's flood to hold the slots")
        judged = []
        for _ in range(B_STREAMS):
            sent, first, _ = stream(b, prompt, 4)
            ahead = FLOOD - SLOTS - sum(at <= sent for at in answered)  # A's requests queued when B's was sent
            judged.append((first - sent, ahead, sum(sent < at <= first for at in answered)))
        for future in flood:
            future.result(timeout=300)
    for i, (ttft, ahead, answered_meanwhile) in enumerate(judged):
        fifo_s = ahead // SLOTS * alone_s  # first come first served: at least this long
        assert ahead >= SLOTS, f"B's stream {i + 1} found no backlog of A's to judge against: {judged}"
        assert answered_meanwhile < ahead, f"B's stream {i + 1} waited for A's whole backlog: {judged}"
        assert ttft <= max(idle) + fifo_s / 2, (
            f"B's stream {i + 1}: first token in {ttft:.2f} s; idle {max(idle):.2f} s, FIFO at least {fifo_s:.2f} s "
            f"(A's request alone {alone_s:.2f} s); all of B's (ttft, A's ahead, A's answered meanwhile): {judged}")
