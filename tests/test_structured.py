"""Constrained decoding in the engine, on a tiny random model: whatever the model wants, the answer follows its
grammar; constrained and free sequences share steps without touching each other; preemption changes nothing."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from rqbatcher.constraints import INT_MAX, INT_MIN, NUMBER_DIGITS
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine import structured
from rqbatcher.workers.engine.api import RequestError
from tests.engine_helpers import engine_for, random_prompts, run_all, run_counting_preemptions

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}}}
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 2}
PREEMPTING = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 24}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def json_request(prompt_ids, schema, max_tokens=60, **sampling) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt_ids, sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                             response_format=schema_format(schema))


def assert_follows(out, schema) -> None:
    assert out.error is None
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_constrained_and_free_sequences_share_steps_and_the_free_ones_are_untouched(tiny_model_dir):
    prompts = random_prompts(8, seed=1, min_len=4, max_len=20)
    free = [GenerationRequest(prompt_token_ids=p, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
            for p in prompts[4:]]
    alone = engine_for(tiny_model_dir())
    for i, request in enumerate(free):
        alone.add(f"f{i}", request)
    expected = {k: v.token_ids for k, v in run_all(alone).items()}

    engine = engine_for(tiny_model_dir())
    for i, prompt in enumerate(prompts[:4]):
        engine.add(f"c{i}", json_request(prompt, SCHEMA, temperature=0.0 if i % 2 else 1.0, seed=i))
    for i, request in enumerate(free):
        engine.add(f"f{i}", request)
    mixed_steps, finals = 0, {}
    while engine.has_work():
        for out in engine.step():
            finals[out.request_id] = out if out.finished else finals.get(out.request_id)
        mixed_steps += engine.last_step.num_seqs == 8
    assert mixed_steps > 0
    assert {k: finals[k].token_ids for k in expected} == expected
    for i in range(4):
        assert_follows(finals[f"c{i}"], SCHEMA)


def test_a_preempted_constrained_sequence_recomputes_to_the_same_answer(tiny_model_dir):
    prompts = random_prompts(8, seed=2, min_len=8, max_len=20)
    answers = {}
    for name, knobs in (("roomy", {}), ("preempting", PREEMPTING)):
        engine = engine_for(tiny_model_dir(), **knobs)
        for i, prompt in enumerate(prompts):
            engine.add(str(i), json_request(prompt, WORDS, max_tokens=40, temperature=0.8, seed=i))
        finals, preempted = run_counting_preemptions(engine)
        answers[name] = {k: (v.token_ids, v.finish_reason) for k, v in finals.items()}
        if name == "preempting":
            assert preempted > 0
        for out in finals.values():
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), WORDS)
    assert answers["preempting"] == answers["roomy"]
    assert any(reason == "stop" for _, reason in answers["roomy"].values())


def test_regex_choice_and_json_object_hold_and_a_cut_answer_ends_with_length(tiny_model_dir):
    engine = engine_for(tiny_model_dir())
    prompt = random_prompts(1, seed=3, min_len=6)[0]
    base = {"prompt_token_ids": prompt, "sampling": SamplingParams(max_tokens=40, temperature=1.0, seed=5)}
    engine.add("regex", GenerationRequest(regex=r"[a-c]{2,5}-[0-9]{3}", **base))
    engine.add("choice", GenerationRequest(choice=["yes", "no", "maybe so"], **base))
    engine.add("object", GenerationRequest(response_format={"type": "json_object"},
                                           **{**base, "sampling": SamplingParams(max_tokens=300, temperature=0.0)}))
    engine.add("cut", json_request(prompt, WORDS, max_tokens=3))
    finals = run_all(engine)
    assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", finals["regex"].text) and finals["regex"].finish_reason == "stop"
    assert finals["choice"].text in ("yes", "no", "maybe so") and finals["choice"].finish_reason == "stop"
    if finals["object"].finish_reason == "stop":
        assert isinstance(json.loads(finals["object"].text), dict)
    else:
        assert finals["object"].text.startswith("{")
    assert finals["cut"].finish_reason == "length" and len(finals["cut"].token_ids) == 3


def test_unbounded_integers_and_numbers_end_where_a_greedy_model_would_write_digits_forever(tiny_model_dir):
    """Without their bounds (batcher/constraints.py), greedy answers here run on in digits to max_tokens."""
    schema = {"type": "object", "additionalProperties": False, "required": ["population", "share"],
              "properties": {"population": {"type": "integer"}, "share": {"type": "number"}}}
    engine = engine_for(tiny_model_dir())
    for i, prompt in enumerate(random_prompts(4, seed=7, min_len=4, max_len=20)):
        engine.add(str(i), json_request(prompt, schema, max_tokens=200, temperature=0.0))
    for out in run_all(engine).values():
        assert_follows(out, schema)
        population, share = re.fullmatch(r'\{"population":(.*),"share":(.*)\}', out.text).groups()
        assert INT_MIN <= int(population) <= INT_MAX
        assert len(share.replace("-", "").replace(".", "").lstrip("0")) <= NUMBER_DIGITS and "e" not in share.lower()


def test_a_grammar_that_cannot_be_compiled_in_time_fails_its_request_alone(tiny_model_dir, monkeypatch):
    engine = engine_for(tiny_model_dir())
    prompt = random_prompts(1, seed=4)[0]
    engine.add("free", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=5)))
    fast = structured.compile_grammar

    def slow(tokenizer, grammar):
        time.sleep(0.5)
        return fast(tokenizer, grammar)

    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(structured, "compile_grammar", slow)
    with pytest.raises(RequestError, match="took more than 0.1 s to compile"):
        engine.add("slow", json_request(prompt, SCHEMA))
    unchecked = GenerationRequest.model_construct(prompt_token_ids=prompt, sampling=SamplingParams(), regex="(")
    with pytest.raises(RequestError, match="regex"):
        engine.add("bad", unchecked)
    monkeypatch.setattr(structured, "compile_grammar", fast)
    engine.add("fine", json_request(prompt, SCHEMA))
    finals = run_all(engine)
    assert set(finals) == {"free", "fine"} and finals["free"].error is None
    assert_follows(finals["fine"], SCHEMA)


def test_compiled_grammars_are_cached_by_grammar(tiny_model_dir, monkeypatch):
    engine = engine_for(tiny_model_dir())
    compiles = []
    fast = structured.compile_grammar
    monkeypatch.setattr(structured, "compile_grammar", lambda t, g: compiles.append(g) or fast(t, g))
    for i, prompt in enumerate(random_prompts(3, seed=6)):
        engine.add(str(i), json_request(prompt, SCHEMA))
    engine.add("other", json_request(prompt, WORDS))
    assert len(compiles) == 2
    assert all(out.error is None for out in run_all(engine).values())


def test_batcher_run_answers_schema_lines_with_valid_json_and_a_bad_schema_with_an_error_line(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from rqbatcher.cli import main

    schema = {"type": "object", "additionalProperties": False, "required": ["word", "ok"],
              "properties": {"word": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}}
    bodies = {"json": {"prompt": "x", "max_tokens": 60, "response_format": schema_format(schema), "logprobs": 1},
              "bad": {"prompt": "x", "response_format": schema_format({"type": "string", "not": {}})},
              "choice": {"prompt": "x", "max_tokens": 10, "choice": ["left", "right"], "temperature": 1.0}}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions", "body": b}) + "\n"
                           for k, b in bodies.items()))
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_model_dir()), "--input", str(src), "--output",
                                       str(dst), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    out = {o["custom_id"]: o for o in map(json.loads, dst.read_text().splitlines())}
    answer = out["json"]["response"]["body"]["choices"][0]
    assert answer["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["text"]), schema)
    assert len(answer["logprobs"]["tokens"]) == len(answer["token_ids"])
    assert out["choice"]["response"]["body"]["choices"][0]["text"] in ("left", "right")
    assert out["bad"]["response"] is None and "response_format" in out["bad"]["error"]["message"]


def test_a_forward_that_raises_under_begun_masks_is_rerun_alone_and_the_answers_still_follow(tiny_model_dir,
                                                                                             monkeypatch):
    engine = engine_for(tiny_model_dir())
    for i, prompt in enumerate(random_prompts(3, seed=9, min_len=4)):
        engine.add(str(i), json_request(prompt, SCHEMA))
    execute, failures = engine.runner.execute, []

    def flaky(batch):
        if len(batch.num_tokens) > 1 and engine.step_index == 3 and not failures:
            failures.append(batch)
            raise RuntimeError("a transient fault")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    finals = run_all(engine)
    assert failures and len(finals) == 3
    for out in finals.values():
        assert_follows(out, SCHEMA)
