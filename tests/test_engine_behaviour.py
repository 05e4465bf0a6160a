"""Engine behaviour beyond token equality: sampling, stop conditions, errors, scheduling by step log."""

import pytest
import torch

from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestError
from tests.engine_helpers import engine_for, greedy, random_prompts, run_all


@pytest.fixture
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def sampled(prompt, seed, max_tokens=12, **kw):
    return GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=max_tokens, temperature=0.9, top_k=50, top_p=0.9, seed=seed, ignore_eos=True, **kw))


def test_seeded_sampling_is_independent_of_the_batch(llama):
    prompt = random_prompts(1, seed=1)[0]
    alone = engine_for(llama)
    alone.add("x", sampled(prompt, seed=1234))
    solo = run_all(alone)["x"].token_ids

    crowded = engine_for(llama, max_num_seqs=8, max_num_batched_tokens=16)
    for i, other in enumerate(random_prompts(6, seed=2)):
        crowded.add(f"o{i}", sampled(other, seed=i))
    crowded.add("x", sampled(prompt, seed=1234))
    assert run_all(crowded)["x"].token_ids == solo

    differently_seeded = engine_for(llama)
    differently_seeded.add("x", sampled(prompt, seed=4321))
    assert run_all(differently_seeded)["x"].token_ids != solo


def test_repetition_penalty_changes_greedy_output(llama):
    prompt = random_prompts(1, seed=3)[0]
    engine = engine_for(llama)
    engine.add("plain", greedy(prompt, 30))
    engine.add("penalised", greedy(prompt, 30, repetition_penalty=5.0))
    finals = run_all(engine)
    plain, penalised = finals["plain"].token_ids, finals["penalised"].token_ids
    assert plain != penalised
    assert len(set(penalised)) >= len(set(plain))


def test_max_tokens_ends_with_length(llama):
    engine = engine_for(llama)
    engine.add("a", greedy([5, 6, 7], 9))
    out = run_all(engine)["a"]
    assert out.finish_reason == "length" and len(out.token_ids) == 9


def test_eos_ends_with_stop_unless_ignored(llama):
    engine = engine_for(llama)
    eos = next(iter(engine.loaded.eos_token_ids))
    # Make EOS the model's favourite token so that greedy decoding picks it at once.
    with torch.no_grad():
        engine.runner.model.get_output_embeddings().bias = torch.nn.Parameter(
            torch.zeros(engine.loaded.vocab_size).index_fill_(0, torch.tensor([eos]), 1e4))
    engine.add("stops", GenerationRequest(prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=5)))
    engine.add("ignores", greedy([5, 6, 7], 5))
    finals = run_all(engine)
    assert finals["stops"].finish_reason == "stop" and finals["stops"].token_ids == [eos]
    assert finals["ignores"].finish_reason == "length" and finals["ignores"].token_ids == [eos] * 5


def test_stop_string_ends_with_stop_and_is_cut_from_the_text(llama):
    engine = engine_for(llama)
    prompt = engine.loaded.tokenizer("Continuous batching decides")["input_ids"]
    engine.add("free", greedy(prompt, 40))
    text = run_all(engine)["free"].text
    stop = "idei"  # occurs mid-text in this seeded tiny model's output
    assert stop in text[1:-len(stop)]
    engine.add("stopped", greedy(prompt, 40, stop=["never there", stop]))
    deltas, final = [], None
    while engine.has_work():
        for out in engine.step():
            deltas.append(out.delta_text)
            final = out
    assert (final.finish_reason, final.stop_sequence) == ("stop", stop)
    assert final.text == text[: text.index(stop)]
    assert "".join(deltas) == final.text  # streamed deltas never leaked any of the stop string


def test_prompt_longer_than_the_context_fails_alone(llama):
    engine = engine_for(llama, max_model_len=64)
    engine.add("ok", greedy([5, 6, 7], 4))
    with pytest.raises(RequestError, match="64"):
        engine.add("too-long", greedy(list(range(3, 80)), 4))
    assert run_all(engine)["ok"].finish_reason == "length"


def test_generation_stops_at_the_context_limit(llama):
    engine = engine_for(llama, max_model_len=20)
    engine.add("a", greedy(list(range(3, 13)), 50))
    out = run_all(engine)["a"]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_token_ids_outside_the_vocabulary_are_refused(llama):
    engine = engine_for(llama)
    with pytest.raises(RequestError, match="vocabulary"):
        engine.add("bad", greedy([5, 10**6], 4))


def test_a_forward_failure_fails_only_its_request(llama, monkeypatch):
    engine = engine_for(llama)
    for i, prompt in enumerate(random_prompts(4, seed=5)):
        engine.add(f"r{i}", greedy(prompt, 6))
    engine.add("poison", greedy([5, 6, 7], 6))
    forward = engine.runner.execute

    def execute(plan):
        if any(seq.request_id == "poison" for seq in plan.num_tokens):
            raise RuntimeError("boom in the forward")
        return forward(plan)

    monkeypatch.setattr(engine.runner, "execute", execute)
    finals = run_all(engine)
    assert "boom" in finals["poison"].error
    assert all(finals[f"r{i}"].finish_reason == "length" and len(finals[f"r{i}"].token_ids) == 6 for i in range(4))


def steps_of(engine) -> tuple[dict[str, int], dict[str, int]]:
    """Run the engine to the end: the step of each request's first token, and the step it finished in (a prompt
    that fits one step's budget gets its first token in the step that admits it)."""
    first, finished = {}, {}
    while engine.has_work():
        step = engine.step_index
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
    return first, finished


def test_a_finished_slot_is_refilled_on_the_very_next_step(llama):
    engine = engine_for(llama, max_num_seqs=4, max_num_batched_tokens=512)
    for i, max_tokens in enumerate([3, 30, 8, 20, 5, 12, 4, 9]):
        engine.add(f"r{i}", greedy([5 + i, 6, 7], max_tokens))
    first, finished = steps_of(engine)
    finished_steps = sorted(finished.values())
    admitted = sorted(first.values())[4:]  # the four that had to wait
    for step in admitted:
        assert step - 1 in finished_steps, f"admitted at step {step}, but no slot freed at step {step - 1}"


def test_long_prompt_is_chunked_while_decodes_get_a_token_every_step(llama):
    engine = engine_for(llama, max_num_seqs=8, max_num_batched_tokens=16)
    decoders = [f"d{i}" for i in range(4)]
    for request_id in decoders:
        engine.add(request_id, greedy([5 + int(request_id[1:]), 6, 7], 60))
    for _ in range(3):
        engine.step()
    engine.add("long", greedy(random_prompts(1, seed=9, min_len=100, max_len=100)[0], 2))
    steps, outputs = 0, {}
    while "long" not in outputs:  # until the long prompt is prefilled and samples its first token
        outputs = {out.request_id: out for out in engine.step()}
        steps += 1
        assert all(len(outputs[d].new_token_ids) == 1 for d in decoders)  # every decode got its token
        assert engine.last_step.num_tokens <= 16
    assert steps >= 100 // 16


def test_static_policy_admits_only_into_an_empty_batch(llama):
    engine = engine_for(llama, max_num_seqs=2, policy="static")
    for i, n in enumerate([2, 10, 3, 3]):
        engine.add(f"r{i}", greedy([5 + i, 6, 7], n))
    first, finished = steps_of(engine)
    assert first["r2"] > finished["r1"]
    assert first["r3"] == first["r2"]


def test_abort_keeps_partial_text_and_frees_blocks(llama):
    engine = engine_for(llama)
    engine.add("a", greedy([5, 6, 7], 50))
    for _ in range(4):
        engine.step()
    out = engine.abort("a", reason="cancelled")
    assert out.finish_reason == "cancelled" and len(out.token_ids) == 4  # one token per step
    assert not engine.has_work()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks
    assert engine.abort("a") is None


def test_chat_messages_use_the_chat_template(llama):
    engine = engine_for(llama)
    request = GenerationRequest(messages=[{"role": "user", "content": "hello"}], sampling=SamplingParams(max_tokens=2))
    expected = engine.loaded.tokenizer("<|user|>hello</s><|assistant|>")["input_ids"]
    assert engine.tokenize(request) == expected


def test_a_chat_prompt_uses_the_template_when_the_model_has_one_and_goes_raw_otherwise(llama):
    engine = engine_for(llama)
    request = GenerationRequest(prompt="hello", chat=True, sampling=SamplingParams(max_tokens=2))
    tokenizer = engine.loaded.tokenizer
    assert engine.tokenize(request) == tokenizer("<|user|>hello</s><|assistant|>")["input_ids"]
    tokenizer.chat_template = None
    assert engine.tokenize(request) == tokenizer("hello")["input_ids"]
