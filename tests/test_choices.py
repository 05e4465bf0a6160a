"""`n` choices in the engine: one request, n sequences with their own seeds, one prompt computed once, reported
under the request's id, and ended, cancelled or failed as one."""

from __future__ import annotations

import pytest

from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.engine.choices import choice_seed
from tests.engine_helpers import engine_for, run_all

PROMPT = list(range(20, 60))  # two full blocks of 16, and 8 more


def sampled(n=1, seed=11, max_tokens=6, **extra) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **extra))


def test_each_choice_is_the_request_alone_with_its_derived_seed_and_the_prompt_is_computed_once(tiny_model_dir):
    alone = engine_for(tiny_model_dir(), prefix_caching=False)
    for i in range(3):
        alone.add(str(i), sampled(seed=choice_seed(11, i)))
    finals = run_all(alone)
    expected = [finals[str(i)].token_ids for i in range(3)]
    assert choice_seed(11, 0) == 11 and len({tuple(t) for t in expected}) == 3

    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=3, logprobs=1))
    seen, final = {0: [], 1: [], 2: []}, None
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == "r"
            seen[out.choice] += out.new_token_ids
            final = out if out.finished else final
    assert [seen[i] for i in range(3)] == expected
    assert [c.token_ids for c in final.choices] == expected and [c.index for c in final.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.logprobs) == 6 for c in final.choices)
    result = final.to_result()
    assert result.usage.completion_tokens == 18 and result.usage.prompt_tokens == len(PROMPT)
    assert result.token_ids == expected[0] and len(result.choices) == 3
    assert engine.stats().prefix_cache.hits == 2 * 32  # choices 1 and 2 found choice 0's two full blocks


def test_cancelling_a_request_with_choices_ends_all_of_them_in_one_output(tiny_model_dir):
    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=4, max_tokens=50))
    engine.step()
    engine.step()
    out = engine.abort("r")
    assert out.request_id == "r" and out.finish_reason == "cancelled" and out.finished
    assert [c.finish_reason for c in out.choices] == ["cancelled"] * 4
    assert not engine.has_work() and engine.abort("r") is None
    with pytest.raises(RequestError):
        engine.add("r", sampled(n=2))
        engine.add("r", sampled(n=2))


def test_a_choice_that_fails_fails_the_request_and_stops_its_siblings(tiny_model_dir, monkeypatch):
    engine = engine_for(tiny_model_dir())
    engine.add("r", sampled(n=3, max_tokens=50))
    engine.add("other", sampled(max_tokens=5))
    accept = engine._accept

    def failing(req, token, finished):
        if req.seq.request_id.endswith("1") and len(req.seq.output_token_ids) == 3:
            raise RuntimeError("boom")
        return accept(req, token, finished)

    monkeypatch.setattr(engine, "_accept", failing)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    ends = [o for o in outputs if o.finished]
    assert {o.request_id for o in outputs} == {"r", "other"}
    (failed,) = [o for o in ends if o.request_id == "r"]
    assert "boom" in failed.error and failed.choice == 1
    assert [o.finish_reason for o in ends if o.request_id == "other"] == ["length"]
