"""The correctness contract: in fp32 with greedy decoding, every request's tokens equal
`model.generate` on that request alone, whatever the batch, chunk budget, block size or preemption."""

import random

import pytest

from tests.engine_helpers import engine_for, greedy, random_prompts, reference_tokens, run_all

SETTINGS = {
    # name: (engine knobs, number of requests)
    "mixed-batch": (dict(max_num_seqs=16, max_num_batched_tokens=256, block_size=16), 16),
    "tiny-chunks": (dict(max_num_seqs=8, max_num_batched_tokens=3, block_size=16), 8),
    "block-size-1": (dict(max_num_seqs=6, max_num_batched_tokens=32, block_size=1), 6),
    "odd-block-size": (dict(max_num_seqs=6, max_num_batched_tokens=11, block_size=7), 6),
    "preemption": (dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=24), 8),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_tokens_equal_generate_alone(tiny_model_dir, family, setting):
    knobs, n = SETTINGS[setting]
    model_dir = tiny_model_dir(family)
    engine = engine_for(model_dir, dtype="float32", **knobs)
    rng = random.Random(setting)
    prompts = random_prompts(n, seed=len(setting), max_len=40)
    lengths = [rng.randint(1, 40) for _ in prompts]
    for i, (prompt, max_tokens) in enumerate(zip(prompts, lengths)):
        engine.add(f"r{i}", greedy(prompt, max_tokens))
    finals = run_all(engine)
    for i, (prompt, max_tokens) in enumerate(zip(prompts, lengths)):
        out = finals[f"r{i}"]
        assert out.finish_reason == "length"
        assert out.token_ids == reference_tokens(model_dir, prompt, max_tokens), f"request r{i} diverged"
    if setting == "preemption":
        assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks


def test_preemption_really_happens_in_the_preemption_setting(tiny_model_dir):
    knobs, n = SETTINGS["preemption"]
    engine = engine_for(tiny_model_dir("llama"), **knobs)
    for i, prompt in enumerate(random_prompts(n, seed=len("preemption"), max_len=40)):
        engine.add(f"r{i}", greedy(prompt, 40))
    preemptions = 0
    while engine.has_work():
        engine.step()
        preemptions += engine.last_step.num_preempted
    assert preemptions > 0
