"""Sampling keyed by position (issue 35): a sequence's draw at output position i depends on (seed, choice, i)
alone, whatever shares the step, in whatever row order, and whatever was drawn before, so that a resumed
sequence continues the same draws; the inverse-CDF pick follows the filtered distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rqbatcher.schema import GenerationRequest, SamplingParams
from rqbatcher.workers.engine.choices import choice_seed
from rqbatcher.workers.engine.sampling import Sampler, inverse_cdf, philox4x32, position_uniforms
from rqbatcher.workers.scheduler.sequence import Sequence
from tests.engine_helpers import engine_for, random_prompts, run_all

VOCAB = 16
POSITIONS = 24
PROMPT = [3, 4, 5]
CPU = torch.device("cpu")
# Random123's known answers for Philox4x32-10: (counter, key, output)
PHILOX_KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
FOUR_TOKENS = [0.1, 0.2, 0.3, 0.4]
DRAW_SEEDS, DRAW_POSITIONS = 40, 100  # 4000 draws
CHI_SQUARE_BOUND = 16.27  # 3 degrees of freedom, p = 0.001


def sequence(request_id: str, seed: int | None, output: list[int] | tuple[int, ...] = (), **sampling) -> Sequence:
    seq = Sequence(request_id, PROMPT, SamplingParams(seed=seed, **{"temperature": 1.0, **sampling}))
    seq.token_ids.extend(output)
    return seq


def row_logits(seq: Sequence) -> torch.Tensor:
    """The same logits for a sequence at every step (a function of its id), so only the draw can differ."""
    generator = torch.Generator().manual_seed(sum(map(ord, seq.request_id)))
    return torch.randn(VOCAB, generator=generator) * 2


def step(sampler: Sampler, seqs: list[Sequence]) -> dict[str, int]:
    """Sample one token for each of `seqs` (in that row order) and append it, as the scheduler would."""
    tokens = sampler.sample(torch.stack([row_logits(seq) for seq in seqs]), seqs)
    for seq, token in zip(seqs, tokens):
        seq.token_ids.append(token)
    return {seq.request_id: token for seq, token in zip(seqs, tokens)}


def run(seqs: list[Sequence], positions: int, shuffle: random.Random | None = None) -> dict[str, list[int]]:
    """Each sequence's tokens over `positions` steps of one sampler, the rows reordered every step by `shuffle`."""
    sampler, drawn = Sampler(CPU), {seq.request_id: [] for seq in seqs}
    for seq in seqs:
        sampler.admit(seq)
    rows = list(seqs)
    for _ in range(positions):
        if shuffle is not None:
            shuffle.shuffle(rows)
        for request_id, token in step(sampler, rows).items():
            drawn[request_id].append(token)
    return drawn


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, expected):
    words = philox4x32(tuple(np.array([w], dtype=np.uint64) for w in counter),
                       tuple(np.array([w], dtype=np.uint64) for w in key))
    assert tuple(int(w[0]) for w in words) == expected


def test_a_draw_is_the_same_alone_in_any_batch_and_in_any_row_order():
    alone = run([sequence("x", seed=1234)], POSITIONS)["x"]
    others = [sequence(f"o{i}", seed=i) for i in range(5)] + [sequence("greedy", None, temperature=0.0)]
    crowded = run([*others[:3], sequence("x", seed=1234), *others[3:]], POSITIONS, shuffle=random.Random(7))
    assert crowded["x"] == alone and len(set(alone)) > 1


def test_a_sequence_holding_earlier_tokens_continues_the_draws_of_one_that_generated_them():
    generated = run([sequence("x", seed=99)], POSITIONS)["x"]
    half = POSITIONS // 2
    other_history = [(t + 1) % VOCAB for t in generated[:half]]  # whatever was drawn before does not matter
    for history in (generated[:half], other_history):
        resumed = run([sequence("x", seed=99, output=history)], POSITIONS - half)["x"]
        assert resumed == generated[half:]


def test_draws_differ_across_choices_and_positions_and_each_depends_on_seed_choice_and_position_alone():
    seeds = [choice_seed(2024, choice) for choice in range(4)]
    grid = [(seed, position) for seed in seeds for position in range(POSITIONS)]
    uniforms = position_uniforms([s for s, _ in grid], [p for _, p in grid])
    assert len(set(uniforms.tolist())) == len(grid) and ((uniforms >= 0) & (uniforms < 1)).all()
    reversed_ = position_uniforms([s for s, _ in grid[::-1]], [p for _, p in grid[::-1]])
    assert reversed_.tolist() == uniforms.tolist()[::-1]
    answers = run([sequence(str(choice), seed) for choice, seed in enumerate(seeds)], POSITIONS)
    assert len({tuple(tokens) for tokens in answers.values()}) == len(seeds)


def test_an_unseeded_sequence_draws_one_seed_and_keeps_it():
    sampler = Sampler(CPU)
    seq = sequence("u", seed=None)
    sampler.admit(seq)
    (seed,) = sampler._random_seeds.values()
    logits = row_logits(seq).unsqueeze(0)
    again = [sampler.sample(logits.clone(), [seq])[0] for _ in range(3)]
    assert len(set(again)) == 1, "the same position draws the same token"
    drawn = [step(sampler, [seq])["u"] for _ in range(POSITIONS)]
    assert 0 <= seed < 2**63 and drawn == run([sequence("u", seed=seed)], POSITIONS)["u"]
    sampler.forget("u")
    assert not sampler._random_seeds


def test_the_inverse_cdf_never_picks_a_zero_probability_token_even_at_a_uniform_of_one():
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0]] * 4 + [[0.0, 1.0, 0.0, 0.0]])
    below_one = 1 - 2.0 ** -53  # 1.0 once in float32
    picks = inverse_cdf(probs, torch.tensor([0.0, 0.5, below_one, 0.4999, 0.0], dtype=torch.float64))
    assert picks.tolist() == [0, 2, 2, 0, 1]


def test_the_draws_follow_the_distribution_and_respect_top_k_and_top_p():
    logits = torch.tensor(FOUR_TOKENS).log().expand(DRAW_SEEDS, -1)

    def counts(**sampling) -> np.ndarray:
        sampler, seqs = Sampler(CPU), [sequence(str(seed), seed, **sampling) for seed in range(DRAW_SEEDS)]
        tokens = []
        for _ in range(DRAW_POSITIONS):
            drawn = sampler.sample(logits.clone(), seqs)
            for seq, token in zip(seqs, drawn):
                seq.token_ids.append(token)
            tokens += drawn
        return np.bincount(tokens, minlength=len(FOUR_TOKENS))

    expected = DRAW_SEEDS * DRAW_POSITIONS * np.array(FOUR_TOKENS)
    assert ((counts() - expected) ** 2 / expected).sum() < CHI_SQUARE_BOUND
    top_two = counts(top_k=2)
    assert top_two[:2].sum() == 0 and top_two[2:].min() > 0
    assert (counts(top_p=0.5) == top_two).all(), "top_p 0.5 keeps the same two tokens, drawn the same way"


def test_a_seeded_request_gets_the_same_tokens_alone_and_in_a_crowd_through_the_engine(tiny_model_dir):
    prompt = random_prompts(1, seed=21)[0]

    def request(prompt_ids, seed):
        return GenerationRequest(prompt_token_ids=prompt_ids, sampling=SamplingParams(
            max_tokens=10, temperature=0.8, seed=seed, ignore_eos=True))

    alone = engine_for(tiny_model_dir("llama"))
    alone.add("x", request(prompt, 77))
    solo = run_all(alone)["x"].token_ids

    crowded = engine_for(tiny_model_dir("llama"), max_num_seqs=8, max_num_batched_tokens=24)
    others = random_prompts(5, seed=22)
    for i, other in enumerate(others[:2]):
        crowded.add(f"before{i}", request(other, i))
    crowded.add("x", request(prompt, 77))
    for i, other in enumerate(others[2:]):
        crowded.add(f"after{i}", request(other, None))
    assert run_all(crowded)["x"].token_ids == solo and len(set(solo)) > 1
