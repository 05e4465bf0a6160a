"""Batched token sampling: greedy, temperature, top-k, top-p, the penalties, logit_bias and seeds.

A draw is keyed by position: the uniform behind a sequence's token at output position i is Philox4x32-10's
output for key = the sequence's seed and counter = i, with no state carried between steps. A request's choice
i samples with its own seed (workers/engine/choices.py), so a draw depends on (seed, choice, position) alone: a
seeded request gets the same tokens alone or in any batch, in any row order, and across a resume, where the
sequence comes back holding its earlier tokens and so continues at the same position. A sequence without a seed
gets a random one the first time the sampler sees it, kept for its life (the worker gives every job one derived
from its job id, so that a resume continues the same draws: workers/job_worker/resume.py). The token is then
picked by inverse CDF over the filtered probabilities, one batched cumsum and searchsorted for every sampled row.

Before the draw (greedy's argmax included), a sequence's logits may be changed, in this order: the repetition
penalty (multiplicative, as in transformers), OpenAI's frequency and presence penalties over the *generated*
tokens (`logit[t] -= count[t] * frequency + (count[t] > 0) * presence`), then `logit_bias` (added last, so that
-100 and +100 act in full). The engine runs after the grammar mask, and -inf plus any bias stays -inf: a token
a grammar forbids stays forbidden. Only sequences `admit` recorded as adjusted are looked at, so a step where
none is costs one empty-dict test; each kind is one batched index op over the rows that need it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from rqbatcher.schema import SamplingParams
from rqbatcher.workers.scheduler.sequence import Sequence


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): seen tokens' logits are divided (or multiplied, if negative)."""
    seen = torch.tensor(sorted(set(token_ids)), device=logits.device)
    scores = logits[seen]
    logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def apply_frequency_presence(logits: torch.Tensor, rows: list[int], outputs: list[list[int]],
                             frequency: list[float], presence: list[float]) -> None:
    """OpenAI's penalties, in place: `logits[rows[j], t] -= count * frequency[j] + (count > 0) * presence[j]`,
    where count is how often `outputs[j]` (row j's generated tokens) holds t. One index op for every row."""
    lengths = [len(output) for output in outputs]
    if not any(lengths):
        return
    device, width = logits.device, logits.shape[1]
    which = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(lengths, device=device))
    tokens = torch.tensor([t for output in outputs for t in output], device=device)
    pairs, counts = torch.unique(which * width + tokens, return_counts=True)
    which, tokens = pairs // width, pairs % width
    per_row = torch.tensor([frequency, presence], dtype=logits.dtype, device=device)[:, which]
    penalty = counts.to(logits.dtype) * per_row[0] + per_row[1]
    logits.index_put_((torch.tensor(rows, device=device)[which], tokens), -penalty, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add each row's bias in place: `biases[j]` is (token ids, values) for row `rows[j]`. One index op."""
    device = logits.device
    lengths = torch.tensor([len(ids) for ids, _ in biases], device=device)
    which = torch.repeat_interleave(torch.tensor(rows, device=device), lengths)
    ids = torch.cat([ids for ids, _ in biases])
    values = torch.cat([values for _, values in biases]).to(logits.dtype)
    logits.index_put_((which, ids), values, accumulate=True)


# Logits a row's first pass reduces at once (`first_maxima`): 128 took 0.19 ms over 32 rows of a 49k vocabulary,
# 16 took 2.1 ms (AMD EPYC Zen 4, one thread)
FIRST_MAX_SPAN = 128


def first_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum's index, as `logits.max(dim=-1).indices` gives it. On a CPU, torch's max with indices
    walks a row one value at a time (1.3-1.7 ms over 32 rows of a 49k vocabulary, AMD EPYC Zen 4); here two vectorised
    passes find it instead: each span of FIRST_MAX_SPAN logits' maximum, then, in the first span that holds the row's
    maximum, the first logit equal to it. A row holding a NaN (torch's max picks its index), a vocabulary of no whole
    spans, or another device keeps torch's max."""
    rows, vocab = logits.shape
    if not logits.is_cpu or vocab % FIRST_MAX_SPAN:
        return logits.max(dim=-1).indices
    spans = logits.reshape(rows, vocab // FIRST_MAX_SPAN, FIRST_MAX_SPAN)
    span_max = spans.amax(dim=-1)
    row_max = span_max.amax(dim=-1, keepdim=True)
    if torch.isnan(row_max).any():
        return logits.max(dim=-1).indices
    span = (span_max == row_max).to(torch.uint8).argmax(dim=-1)  # argmax: the first of equals
    within = (spans[torch.arange(rows), span] == row_max).to(torch.uint8).argmax(dim=-1)
    return span * FIRST_MAX_SPAN + within


def top_k_top_p_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row filtered probabilities over the vocabulary sorted by descending logit.

    Returns `(probs [R, V], order [R, V])`; `order` maps a sorted position back to a token id."""
    scaled = logits / temperature.unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, logits.shape[1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    return probs, order


PHILOX_ROUNDS = 10
PHILOX_MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
PHILOX_KEY_STEPS = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))  # the key's Weyl increments between rounds
WORD_BITS = np.uint64(32)
WORD_MASK = np.uint64(0xFFFFFFFF)
KEY_MODULUS = 1 << 64  # a seed is any int64 or uint64 (rqbatcher.schema); its two's complement is the key
RANDOM_SEED_BITS = 63  # an unseeded sequence's seed, as choices' seeds are drawn (mod 2**63)
UNIFORM_HIGH_BITS, UNIFORM_LOW_BITS = 27, 26  # a float64's 53-bit mantissa: the top bits of two output words


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 (Salmon et al. 2011, as Random123 and cuRAND have it), vectorised: four counter words and two
    key words, each a uint64 array of 32-bit values, one element per draw; returns the four output words. A
    32-bit product fits a uint64, so its high word is a shift."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_ in range(PHILOX_ROUNDS):
        if round_:
            k0, k1 = (k0 + PHILOX_KEY_STEPS[0]) & WORD_MASK, (k1 + PHILOX_KEY_STEPS[1]) & WORD_MASK
        p0, p1 = PHILOX_MULTIPLIERS[0] * c0, PHILOX_MULTIPLIERS[1] * c2
        c0, c1, c2, c3 = (p1 >> WORD_BITS) ^ c1 ^ k0, p1 & WORD_MASK, (p0 >> WORD_BITS) ^ c3 ^ k1, p0 & WORD_MASK
    return c0, c1, c2, c3


def position_uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """Uniforms in [0, 1), element j a function of (seeds[j], positions[j]) alone: Philox keyed by the seed, at
    counter (position, 0, 0, 0)."""
    keys = np.array([seed % KEY_MODULUS for seed in seeds], dtype=np.uint64)
    zeros = np.zeros(len(seeds), dtype=np.uint64)
    words = philox4x32((np.array(positions, dtype=np.uint64), zeros, zeros, zeros),
                       (keys & WORD_MASK, keys >> WORD_BITS))
    high = words[0] >> (WORD_BITS - np.uint64(UNIFORM_HIGH_BITS))
    low = words[1] >> (WORD_BITS - np.uint64(UNIFORM_LOW_BITS))
    return (high * (1 << UNIFORM_LOW_BITS) + low) / (1 << (UNIFORM_HIGH_BITS + UNIFORM_LOW_BITS))


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `probs [R, V]`, the first index whose cumulative mass exceeds `uniforms[r]` times the row's total.
    A zero-probability index adds no mass, so it is never the first to exceed; the target is kept below the
    total, which a uniform rounded up to 1.0 in float32 would reach."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    below_total = total.nextafter(torch.zeros_like(total))
    target = torch.minimum(uniforms.to(cdf.dtype).unsqueeze(1) * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


@dataclass(frozen=True)
class _Adjustment:
    """What changes a sequence's logits before the draw; the bias as tensors, built once at `admit`."""

    sampling: SamplingParams
    bias: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def penalised(self) -> bool:
        return bool(self.sampling.frequency_penalty or self.sampling.presence_penalty)


def adjusts_logits(sampling: SamplingParams) -> bool:
    return bool(sampling.repetition_penalty != 1.0 or sampling.frequency_penalty or sampling.presence_penalty
                or sampling.logit_bias)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._random_seeds: dict[str, int] = {}  # by request id: the seeds drawn for sequences without one
        self._adjusted: dict[str, _Adjustment] = {}  # by request id: the sequences whose logits change

    def admit(self, seq: Sequence) -> None:
        """Note a sequence joining the engine (before its first step): its seed, drawn if it has none, and whether
        its logits change before the draw."""
        sampling = seq.sampling
        self._seed(seq)
        if not adjusts_logits(sampling):
            return
        bias = None
        if sampling.logit_bias:
            bias = (torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=self.device),
                    torch.tensor(list(sampling.logit_bias.values()), dtype=torch.float32, device=self.device))
        self._adjusted[seq.request_id] = _Adjustment(sampling, bias)

    def forget(self, request_id: str) -> None:
        self._random_seeds.pop(request_id, None)
        self._adjusted.pop(request_id, None)

    def _seed(self, seq: Sequence) -> int:
        """The sequence's seed, or the one drawn when the sampler first saw it: the same for the sequence's life."""
        if seq.sampling.seed is not None:
            return seq.sampling.seed
        seed = self._random_seeds.get(seq.request_id)
        if seed is None:
            seed = self._random_seeds[seq.request_id] = random.getrandbits(RANDOM_SEED_BITS)
        return seed

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Apply the penalties and biases of the admitted sequences among `seqs`, in place (row i is `seqs[i]`)."""
        if not self._adjusted:  # the common step: nobody asked for any
            return
        rows = [(i, a) for i, seq in enumerate(seqs) if (a := self._adjusted.get(seq.request_id)) is not None]
        for i, adjustment in rows:
            if adjustment.sampling.repetition_penalty != 1.0:
                apply_repetition_penalty(logits[i], seqs[i].token_ids, adjustment.sampling.repetition_penalty)
        penalised = [(i, a.sampling) for i, a in rows if a.penalised]
        if penalised:
            apply_frequency_presence(logits, [i for i, _ in penalised],
                                     [seqs[i].output_token_ids for i, _ in penalised],
                                     [s.frequency_penalty for _, s in penalised],
                                     [s.presence_penalty for _, s in penalised])
        biased = [(i, a.bias) for i, a in rows if a.bias is not None]
        if biased:
            apply_logit_bias(logits, [i for i, _ in biased], [b for _, b in biased])

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One next token per row of `logits [K, V]`, row i belonging to `seqs[i]`."""
        if not seqs:
            return []
        self.adjust(logits, seqs)
        tokens = first_maxima(logits).tolist()
        rows = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
        if not rows:
            return tokens
        params = [seqs[i].sampling for i in rows]
        probs, order = top_k_top_p_probs(
            logits[rows],
            torch.tensor([p.temperature for p in params], device=logits.device),
            torch.tensor([p.top_k for p in params], device=logits.device),
            torch.tensor([p.top_p for p in params], device=logits.device),
        )
        uniforms = position_uniforms([self._seed(seqs[i]) for i in rows], [seqs[i].num_output_tokens for i in rows])
        picks = inverse_cdf(probs, torch.from_numpy(uniforms).to(logits.device))
        for i, token in zip(rows, order.gather(1, picks.unsqueeze(1)).squeeze(1).tolist()):
            tokens[i] = token
        return tokens
