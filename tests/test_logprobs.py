"""Logprobs from the engine: the model's own log-softmax (not the sampler's), restricted to what a grammar allows."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rqbatcher.schema import GenerationRequest, SamplingParams
from tests.engine_helpers import engine_for, random_prompts, run_all


def test_logprobs_are_the_models_log_softmax_whatever_the_temperature(tiny_model_dir):
    prompt = random_prompts(1, seed=7, min_len=5)[0]
    engine = engine_for(tiny_model_dir())
    engine.add("greedy", GenerationRequest(prompt_token_ids=prompt,
                                           sampling=SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5)))
    engine.add("hot", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
        max_tokens=4, ignore_eos=True, logprobs=2, temperature=5.0, top_k=3, seed=1)))
    engine.add("none", GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=4)))
    finals = run_all(engine)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    tokenizer = engine.loaded.tokenizer
    assert finals["none"].logprobs is None and finals["none"].to_result().logprobs is None
    for name in ("greedy", "hot"):
        out = finals[name]
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            expected = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids) == 4
        for position, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token == tokenizer.decode([token])
            assert lp.logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
            best = expected[position].topk(len(lp.top_logprobs))
            assert [t.logprob for t in lp.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        if name == "greedy":
            assert all(lp.top_logprobs[0].token == lp.token for lp in out.logprobs)


def test_under_a_grammar_the_alternatives_are_the_allowed_tokens_and_their_probabilities_sum_to_one(tiny_model_dir):
    engine = engine_for(tiny_model_dir())
    engine.add("pick", GenerationRequest(prompt_token_ids=random_prompts(1, seed=8)[0], choice=["yes", "no"],
                                         sampling=SamplingParams(max_tokens=5, logprobs=20)))
    (out,) = run_all(engine).values()
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    assert all(("yes".startswith(t.token) or "no".startswith(t.token)) and t.token for t in first.top_logprobs)
    assert math.fsum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(1.0, abs=1e-4)
