"""OpenAI's frequency and presence penalties and logit_bias: the sampler's arithmetic on hand-made logits, their
effect on a tiny model's greedy answers, the grammar mask they cannot undo, and the vocabulary check, in the
engine and published for the gateway."""

from __future__ import annotations

import pytest
import torch

from rqbatcher.jobs import admin, keys
from rqbatcher.logit_bias import logit_bias_problem
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.api import RequestError
from rqbatcher.workers.engine.sampling import Sampler, apply_frequency_presence, apply_logit_bias
from rqbatcher.workers.job_worker.worker import JobWorker
from rqbatcher.workers.scheduler.sequence import Sequence
from tests import fake_engine
from tests.engine_helpers import engine_for, greedy, run_all
from tests.jobs_support import fake_redis_fixture, keep_signal_handlers_fixture  # noqa: F401

VOCAB = 8
REPEATING_PROMPT = [5, 6, 7]  # the tiny llama's greedy answer to it repeats one token over and over


def sequence(request_id: str, prompt: list[int], output: list[int], **sampling) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(**sampling))
    seq.token_ids.extend(output)
    return seq


def test_penalties_subtract_counts_of_generated_tokens_alone_in_one_op_for_every_row():
    logits = torch.arange(3 * VOCAB, dtype=torch.float32).view(3, VOCAB)
    expected = logits.clone()
    apply_frequency_presence(logits, [0, 2], [[1, 1, 2], [4, 1, 4, 4]], frequency=[0.5, -1.0], presence=[0.25, 2.0])
    expected[0, 1] -= 2 * 0.5 + 0.25
    expected[0, 2] -= 1 * 0.5 + 0.25
    expected[2, 4] -= 3 * -1.0 + 2.0
    expected[2, 1] -= 1 * -1.0 + 2.0
    assert torch.equal(logits, expected)


def test_the_sampler_applies_penalties_and_bias_to_admitted_sequences_before_the_greedy_pick():
    sampler = Sampler(torch.device("cpu"))
    plain = sequence("plain", [3, 3], [1])
    penalised = sequence("penalised", [3, 3], [7, 7, 1], frequency_penalty=1.5, presence_penalty=0.5)
    biased = sequence("biased", [3], [7], logit_bias={2: 100.0, 7: -100.0})
    seqs = [plain, penalised, biased]
    for seq in seqs:
        sampler.admit(seq)
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 3.0  # everyone's favourite
    logits[:, 3] = 2.0  # in the prompts: no penalty for it
    expected = logits.clone()
    expected[1, 7] -= 2 * 1.5 + 0.5
    expected[1, 1] -= 1.5 + 0.5
    expected[2, 2] += 100.0
    expected[2, 7] -= 100.0
    tokens = sampler.sample(logits, seqs)
    assert torch.equal(logits, expected) and tokens == [7, 3, 2]
    sampler.forget("penalised")
    sampler.forget("biased")
    untouched = torch.zeros(3, VOCAB)
    sampler.adjust(untouched, seqs)
    assert torch.equal(untouched, torch.zeros(3, VOCAB)), "a forgotten sequence is not adjusted again"


def test_a_bias_leaves_a_forbidden_token_forbidden():
    logits = torch.zeros(2, VOCAB)
    logits[0, 5] = float("-inf")
    apply_logit_bias(logits, [0], [(torch.tensor([5, 6]), torch.tensor([100.0, -3.0]))])
    assert logits[0, 5] == float("-inf") and logits[0, 6] == -3.0 and logits[1].eq(0).all()


def test_a_sampler_with_no_adjusted_sequence_skips_every_adjustment():
    sampler = Sampler(torch.device("cpu"))
    seq = sequence("a", [1], [2, 2])
    sampler.admit(seq)
    assert not sampler._adjusted  # the common request costs one empty-dict test a step
    logits = torch.zeros(1, VOCAB)
    sampler.adjust(logits, [seq])
    assert logits.eq(0).all()


@pytest.fixture
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


def test_a_strong_presence_penalty_stops_greedy_repeats(llama):
    engine = engine_for(llama)
    engine.add("plain", greedy(REPEATING_PROMPT, 30))
    engine.add("present", greedy(REPEATING_PROMPT, 30, presence_penalty=2.0))
    engine.add("frequent", greedy(REPEATING_PROMPT, 30, frequency_penalty=2.0))
    finals = run_all(engine)
    plain = finals["plain"].token_ids
    assert len(set(plain)) < len(plain) - 10
    present = finals["present"].token_ids
    assert len(set(present)) == len(present) == 30
    assert finals["frequent"].token_ids != plain


def test_logit_bias_decides_greedy_picks(llama):
    engine = engine_for(llama)
    engine.add("plain", greedy(REPEATING_PROMPT, 8))
    plain = run_all(engine)["plain"].token_ids
    engine.add("forced", greedy(REPEATING_PROMPT, 8, logit_bias={42: 100.0}))
    engine.add("banned", greedy(REPEATING_PROMPT, 8, logit_bias={plain[0]: -100.0}))
    finals = run_all(engine)
    assert finals["forced"].token_ids == [42] * 8
    assert plain[0] not in finals["banned"].token_ids
    assert finals["banned"].logprobs is None


def test_logprobs_report_the_model_before_the_bias(llama):
    engine = engine_for(llama)
    engine.add("plain", greedy(REPEATING_PROMPT, 1, logprobs=1))
    engine.add("forced", greedy(REPEATING_PROMPT, 1, logprobs=1, logit_bias={42: 100.0}))
    finals = run_all(engine)
    assert finals["forced"].token_ids == [42]
    (forced,), (plain,) = finals["forced"].logprobs[0].top_logprobs, finals["plain"].logprobs[0].top_logprobs
    assert forced.token == plain.token and forced.logprob == pytest.approx(plain.logprob, abs=1e-4)
    assert finals["forced"].logprobs[0].logprob < plain.logprob  # the bias's pick, as unlikely as the model found it


def test_a_bias_cannot_bring_back_a_token_the_grammar_forbids(llama):
    engine = engine_for(llama)
    tokenizer, eos = engine.loaded.tokenizer, engine.loaded.eos_token_ids
    forbidden = {t: 100.0 for t in range(engine.loaded.vocab_size)
                 if t not in eos and not any(tokenizer.decode([t]) in word for word in ("yes", "no"))}
    engine.add("pick", GenerationRequest(prompt_token_ids=REPEATING_PROMPT, choice=["yes", "no"],
                                         sampling=SamplingParams(max_tokens=5, logit_bias=forbidden)))
    (out,) = run_all(engine).values()
    assert out.error is None and out.text in ("yes", "no")


def test_a_bias_outside_the_vocabulary_is_refused_and_the_engine_serves_on(llama):
    engine = engine_for(llama)
    size = engine.loaded.vocab_size
    assert engine.stats().vocab_size == size
    with pytest.raises(RequestError, match=rf"^logit_bias: token id {size} is outside the vocabulary \(size {size}\)"):
        engine.add("bad", greedy(REPEATING_PROMPT, 4, logit_bias={3: 1.0, size: 5.0}))
    engine.add("good", greedy(REPEATING_PROMPT, 4, logit_bias={size - 1: 1.0}))
    assert run_all(engine)["good"].finish_reason == "length" and not engine.has_work()


def test_logit_bias_problem_needs_a_known_vocabulary():
    sampling = SamplingParams(logit_bias={10: 1.0, 300: -1.0})
    assert logit_bias_problem(sampling, 0) is None  # an older worker: unknown
    assert logit_bias_problem(sampling, 301) is None
    assert logit_bias_problem(sampling, 300) == "logit_bias: token id 300 is outside the vocabulary (size 300)"
    assert logit_bias_problem(SamplingParams(), 1) is None


@pytest.mark.usefixtures("keep_signal_handlers")
def test_the_workers_vocabulary_size_reaches_list_workers(fake_redis):
    worker = JobWorker(keys.priority_queue_names(["v"]), fake_engine.FakeEngine(), connection=fake_redis)
    worker.keeper.tick()
    (stats,) = admin.list_workers(fake_redis)
    assert stats.vocab_size == fake_engine.VOCAB_SIZE
