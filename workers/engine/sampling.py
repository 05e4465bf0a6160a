"""Batched token sampling: greedy, temperature, top-k, top-p, the penalties, logit_bias and seeds.

Every request draws from its own generator, so a seeded request gets the same tokens whatever
else shares its batch.

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

import torch

from batcher.scheduler.sequence import Sequence
from batcher.schema import SamplingParams


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
        self._generators: dict[str, torch.Generator] = {}
        self._adjusted: dict[str, _Adjustment] = {}  # by request id: the sequences whose logits change

    def admit(self, seq: Sequence) -> None:
        """Note a sequence joining the engine (before its first step): whether its logits change before the draw."""
        sampling = seq.sampling
        if not adjusts_logits(sampling):
            return
        bias = None
        if sampling.logit_bias:
            bias = (torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=self.device),
                    torch.tensor(list(sampling.logit_bias.values()), dtype=torch.float32, device=self.device))
        self._adjusted[seq.request_id] = _Adjustment(sampling, bias)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._adjusted.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            seed = seq.sampling.seed if seq.sampling.seed is not None else random.getrandbits(63)
            gen = self._generators[seq.request_id] = torch.Generator(self.device).manual_seed(seed)
        return gen

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
        # max's indices are argmax's (the first maximum, too), and twice as fast on CPU: 2 ms against 3.4 ms
        # over 32 rows of a 49k vocabulary
        tokens = logits.max(dim=-1).indices.tolist()
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
        for j, i in enumerate(rows):
            pick = torch.multinomial(probs[j], 1, generator=self._generator(seqs[i]))
            tokens[i] = int(order[j, pick])
        return tokens
