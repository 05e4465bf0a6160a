"""Resume, not restart: a request added with what an earlier attempt generated (`Engine.add(progress=...)`) goes on
to the very answer an uninterrupted run gives: the same tokens, the same text, streamed from where the earlier
attempt's stream stopped (stop strings and grammars across the cut, logprobs, every choice of n > 1). And the
worker's side: what a stream lets a rerun continue from (`rqbatcher.workers.job_worker.resume`)."""

from __future__ import annotations

import pytest

from rqbatcher.schema import GenerationRequest, SamplingParams, StreamEvent, TokenLogprob
from rqbatcher.workers.engine.api import Progress
from rqbatcher.workers.job_worker.resume import read_resumable, with_job_seed
from tests.engine_helpers import engine_for, greedy, random_prompts

PROMPT = random_prompts(1, seed=11, min_len=12, max_len=12)[0]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return engine_for(tiny_model_dir("llama"), max_num_seqs=8)


def run(engine, request: GenerationRequest, progress=None) -> tuple[list, dict]:
    """Every output of one request (with another request beside it, so that the cut is not the only change), and
    the final output by choice."""
    engine.add("other", greedy(random_prompts(1, seed=3)[0], 7))
    engine.add("r", request, progress=progress)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == "r"]
    return outputs, outputs[-1]


def streamed_before(outputs, cut: int, choice: int = 0) -> tuple[list[int], str, list]:
    """What the stream held after `cut` tokens of `choice`: its tokens, its text, its logprobs."""
    tokens, text, logprobs = [], "", []
    for out in outputs:
        if out.choice != choice or len(tokens) >= cut:
            continue
        tokens += out.new_token_ids
        text += out.delta_text
        logprobs += out.new_logprobs or []
    assert len(tokens) == cut
    return tokens, text, logprobs


def test_a_resumed_greedy_request_ends_as_an_uninterrupted_one_and_streams_only_what_is_new(engine):
    request = greedy(PROMPT, 30, logprobs=2)
    outputs, whole = run(engine, request)
    tokens, text, logprobs = streamed_before(outputs, 17)
    resumed, end = run(engine, request, {0: Progress(tokens, logprobs)})
    assert end.token_ids == whole.token_ids and end.text == whole.text and end.finish_reason == "length"
    assert [lp.token for lp in end.logprobs] == [lp.token for lp in whole.logprobs]
    assert text + "".join(o.delta_text for o in resumed) == whole.text
    assert sum(len(o.new_token_ids) for o in resumed) == 30 - 17
    assert end.num_prompt_tokens == len(PROMPT) and end.num_cached_tokens <= len(PROMPT)


def test_a_stop_string_across_the_cut_is_found(engine):
    outputs, whole = run(engine, greedy(PROMPT, 30))
    # A stop string that begins in token 10's text and ends in token 12's: held back before the cut at 11.
    offsets, text = [], ""
    for out in outputs:
        text += out.delta_text
        offsets.append(len(text))
    start = next(i for i in range(offsets[9] - 1, offsets[10]) if whole.text.find(whole.text[i:offsets[11]]) == i)
    stop = whole.text[start:offsets[11]]
    request = greedy(PROMPT, 30, stop=[stop])
    outputs, uninterrupted = run(engine, request)
    assert uninterrupted.finish_reason == "stop" and uninterrupted.text == whole.text[:start]
    tokens, streamed, _ = streamed_before(outputs, 11)
    resumed, end = run(engine, request, {0: Progress(tokens)})
    assert (end.text, end.finish_reason) == (uninterrupted.text, "stop")
    assert streamed + "".join(o.delta_text for o in resumed) == uninterrupted.text


def test_a_constrained_request_resumes_inside_its_grammar(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"], "additionalProperties": False}
    request = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=60),
                                response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    outputs, whole = run(engine, request)
    cut = len(whole.token_ids) // 2
    tokens, streamed, _ = streamed_before(outputs, cut)
    resumed, end = run(engine, request, {0: Progress(tokens)})
    assert (end.token_ids, end.text, end.finish_reason) == (whole.token_ids, whole.text, whole.finish_reason)
    assert streamed + "".join(o.delta_text for o in resumed) == whole.text


def test_seeded_choices_resume_each_from_its_own_cut_and_an_ended_choice_stays_ended(engine):
    request = GenerationRequest(prompt_token_ids=PROMPT, sampling=SamplingParams(
        max_tokens=20, n=3, temperature=0.8, seed=1234, ignore_eos=True))
    outputs, whole = run(engine, request)
    answers = [c.token_ids for c in whole.choices]
    assert len({tuple(a) for a in answers}) == 3
    progress = {0: Progress(answers[0][:5]), 1: Progress(answers[1]), 2: Progress(answers[2][:13])}
    resumed, end = run(engine, request, progress)
    assert [c.token_ids for c in end.choices] == answers
    assert [c.text for c in end.choices] == [c.text for c in whole.choices]
    assert not [o for o in resumed if o.choice == 1 and o.new_token_ids]  # choice 1 had ended: nothing new


def test_an_unseeded_sampled_request_gets_one_seed_per_job():
    request = GenerationRequest(prompt="x", sampling=SamplingParams(temperature=0.7))
    first, again = with_job_seed(request, "job-1"), with_job_seed(request, "job-1")
    assert first.sampling.seed == again.sampling.seed is not None
    assert with_job_seed(request, "job-2").sampling.seed != first.sampling.seed
    seeded = request.model_copy(update={"sampling": SamplingParams(temperature=0.7, seed=5)})
    assert with_job_seed(seeded, "job-1").sampling.seed == 5
    assert with_job_seed(GenerationRequest(prompt="x"), "job-1").sampling.seed is None  # greedy draws nothing


def entry(i: int, **event) -> tuple[str, dict]:
    return f"1-{i}", StreamEvent(**event).to_fields()


def token(i, execution, index, ids, text, choice=0, logprobs=None):
    return entry(i, type="token", execution_id=execution, index=index, token_ids=ids, text=text, choice=choice,
                 logprobs=logprobs)


def test_a_stream_continues_across_executions_and_starts_over_at_a_restart():
    stream = [entry(0, type="start", execution_id="a"), token(1, "a", 0, [5, 6], "xy"),
              entry(2, type="start", execution_id="b"), token(3, "b", 2, [7], "z"), token(4, "b", 0, [9], "q", 1),
              token(5, "a", 2, [8], "late")]  # an earlier attempt's late write: not the stream's any more
    resumed = read_resumable(stream, wants_logprobs=False)
    assert {c: p.token_ids for c, p in resumed.progress.items()} == {0: [5, 6, 7], 1: [9]}
    assert resumed.text == {0: "xyz", 1: "q"}
    restarted = stream[:2] + [entry(2, type="restart", execution_id="b"), entry(3, type="start", execution_id="b"),
                              token(4, "b", 0, [1], "o")]
    assert read_resumable(restarted, wants_logprobs=False).progress[0].token_ids == [1]


@pytest.mark.parametrize("stream, wants_logprobs", [
    ([token(0, "a", 0, [5], "x")], False),  # trimmed: its start is gone
    ([entry(0, type="start", execution_id="a"), token(1, "a", 1, [5], "x")], False),  # a gap
    ([entry(0, type="start", execution_id="a"), token(1, "a", 0, [5], "x"), token(2, "a", 0, [5], "x")], False),
    ([entry(0, type="start", execution_id="a"), token(1, "a", 0, [5], "x")], True),  # logprobs asked, not kept
    ([entry(0, type="start", execution_id="a"), entry(1, type="done", execution_id="a", finish_reason="stop")],
     False),
])
def test_a_stream_that_is_not_one_unbroken_text_cannot_be_continued(stream, wants_logprobs):
    assert read_resumable(stream, wants_logprobs) is None


def test_logprobs_kept_in_the_stream_come_back():
    lp = [TokenLogprob(token="x", token_id=5, logprob=-0.5)]
    stream = [entry(0, type="start", execution_id="a"), token(1, "a", 0, [5], "x", logprobs=lp)]
    assert read_resumable(stream, wants_logprobs=True).progress[0].logprobs == lp
