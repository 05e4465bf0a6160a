"""Shared by the engine tests: build an engine on a tiny model, run it dry, and the reference."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from rqbatcher.config import EngineConfig
from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.engine import Engine, build_engine

_references: dict[str, torch.nn.Module] = {}


def engine_for(model_dir, dtype="float32", **config) -> Engine:
    """An engine on a tiny model, in float32 unless asked otherwise: the token-equality contract holds in float32."""
    return build_engine(EngineConfig(model=str(model_dir), dtype=dtype, **config))


def greedy(prompt_ids, max_tokens, **sampling) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=prompt_ids,
                             sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


def random_prompts(n, seed=0, min_len=1, max_len=40, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def run_all(engine: Engine) -> dict:
    """Step until idle; return the final output of every request."""
    return run_counting_preemptions(engine)[0]


def run_counting_preemptions(engine: Engine) -> tuple[dict, int]:
    """Step until idle; return the final output of every request, and how many preemptions the steps made."""
    finals, preempted = {}, 0
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        preempted += engine.last_step.num_preempted
    return finals, preempted


def reference_tokens(model_dir, prompt_ids, max_tokens) -> list[int]:
    """`model.generate` on this request alone: greedy, fp32, exactly max_tokens (EOS not special)."""
    key = str(model_dir)
    if key not in _references:
        _references[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return generate_greedy(_references[key], prompt_ids, max_tokens)


def generate_greedy(model: torch.nn.Module, prompt_ids, max_tokens) -> list[int]:
    """`model.generate` on one request: greedy, exactly max_tokens (EOS not special)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def record_logits(engine) -> list[torch.Tensor]:
    """Every step's logits of `engine` from now on, as its runner computes them."""
    logits, execute = [], engine.runner.execute

    def recorded(plan):
        out = execute(plan)
        logits.append(out[0].clone())
        return out

    engine.runner.execute = recorded
    return logits
