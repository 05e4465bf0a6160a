"""`best_of` in the engine: best_of candidates seeded as n's choices are, the n of highest mean logprob returned best
first, nothing streamed before the end, logprobs only when asked, every candidate's tokens billed, and a failed
or cancelled candidate handled as one request; through a worker, the job's stream carries no candidate's token."""

from __future__ import annotations

import pytest

from rqbatcher.client import Client
from rqbatcher.jobs import keys
from rqbatcher.schema import GenerationRequest, SamplingParams, StreamEvent
from rqbatcher.workers.engine.choices import mean_logprob
from rqbatcher.workers.job_worker.worker import JobWorker
from tests.engine_helpers import engine_for, run_all
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401

PROMPT = list(range(20, 60))
MAX_TOKENS = 6


def sampled(n=1, best_of=None, seed=11, **extra) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        n=n, best_of=best_of, seed=seed, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra))


def candidates(model_dir, best_of: int) -> list[tuple[float, list[int]]]:
    """(score, tokens) of each candidate, in candidate order: the same request as n choices, with logprobs."""
    engine = engine_for(model_dir)
    engine.add("all", sampled(n=best_of, logprobs=0))
    final = run_all(engine)["all"]
    return [(sum(lp.logprob for lp in c.logprobs) / len(c.logprobs), c.token_ids) for c in final.choices]


def run_collecting(engine, request_id: str) -> tuple[list, object]:
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs, outputs[-1]


def test_the_n_best_candidates_by_mean_logprob_come_back_best_first(tiny_model_dir):
    scored = candidates(tiny_model_dir(), 4)
    assert len({tuple(tokens) for _, tokens in scored}) == 4
    expected = [tokens for _, tokens in sorted(scored, key=lambda c: c[0], reverse=True)[:2]]

    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=2, best_of=4))
    outputs, final = run_collecting(engine, "r")
    assert outputs == [final], "no candidate's tokens leave the engine before the end"
    assert final.new_token_ids == [] and final.delta_text == "" and final.new_logprobs is None
    assert [c.index for c in final.choices] == [0, 1] and [c.token_ids for c in final.choices] == expected
    assert all(c.logprobs is None for c in final.choices) and final.logprobs is None
    result = final.to_result()
    assert result.usage.completion_tokens == 4 * MAX_TOKENS and result.token_ids == expected[0]
    assert result.logprobs is None and len(result.choices) == 2

    engine.add("again", sampled(n=2, best_of=4))
    assert [c.token_ids for c in run_all(engine)["again"].choices] == expected, "a seeded request is reproducible"


def test_one_answer_of_several_candidates_is_the_best_with_its_logprobs_when_asked(tiny_model_dir):
    scored = candidates(tiny_model_dir(), 3)
    best_score, best_tokens = max(scored, key=lambda c: c[0])
    engine = engine_for(tiny_model_dir())
    engine.add("plain", sampled(best_of=3))
    engine.add("asked", sampled(best_of=3, logprobs=2))
    finals = run_all(engine)
    plain, asked = finals["plain"], finals["asked"]
    assert plain.choices is None and plain.token_ids == best_tokens and plain.logprobs is None
    assert plain.to_result().usage.completion_tokens == 3 * MAX_TOKENS
    assert asked.token_ids == best_tokens and len(asked.logprobs) == MAX_TOKENS
    assert all(len(lp.top_logprobs) == 2 for lp in asked.logprobs)
    assert mean_logprob(asked) == pytest.approx(best_score, abs=1e-4)


def test_the_answers_are_ranked_by_their_mean_logprob(tiny_model_dir):
    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=3, best_of=5, logprobs=0, seed=5))
    final = run_all(engine)["r"]
    scores = [sum(lp.logprob for lp in c.logprobs) / len(c.logprobs) for c in final.choices]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3
    assert final.to_result().usage.completion_tokens == 5 * MAX_TOKENS


def test_a_failed_candidate_fails_the_request_without_streaming_it(tiny_model_dir, monkeypatch):
    engine = engine_for(tiny_model_dir())
    engine.add("r", GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        best_of=3, seed=1, temperature=1.0, max_tokens=50, ignore_eos=True)))
    accept = engine._accept

    def failing(req, token, finished):
        if req.seq.request_id.endswith("#choice2") and len(req.seq.output_token_ids) == 3:
            raise RuntimeError("boom")
        return accept(req, token, finished)

    monkeypatch.setattr(engine, "_accept", failing)
    outputs, final = run_collecting(engine, "r")
    assert outputs == [final] and "boom" in final.error and final.new_token_ids == [] and final.choice == 0
    assert not engine.has_work()


def test_cancelling_returns_the_best_of_what_the_candidates_generated(tiny_model_dir):
    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=2, best_of=3))
    assert engine.step() == [] and engine.step() == []
    out = engine.abort("r")
    assert out.finish_reason == "cancelled" and len(out.choices) == 2 and out.new_token_ids == []
    assert all(c.finish_reason == "cancelled" and c.logprobs is None for c in out.choices)
    assert not engine.has_work() and engine.abort("r") is None


@pytest.mark.usefixtures("keep_signal_handlers")
def test_through_a_worker_the_stream_carries_no_candidate_token(tiny_model_dir, fake_redis):
    client = Client(fake_redis, queue="b")
    job_id = client.submit(sampled(n=2, best_of=3).model_dump(mode="json"))
    JobWorker(keys.priority_queue_names(["b"]), engine_for(tiny_model_dir()), connection=fake_redis).work(burst=True)
    result = client.result(job_id, timeout=10)
    assert len(result.choices) == 2 and result.usage.completion_tokens == 3 * MAX_TOKENS
    kinds = [StreamEvent.from_fields(f).type for _, f in fake_redis.xrange(keys.stream_key(job_id))]
    assert "token" not in kinds and kinds[-1] == "done"
