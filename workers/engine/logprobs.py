"""Log-probabilities of sampled tokens, for requests that ask (`SamplingParams.logprobs`), and for the candidates
of a best_of request, which are scored by them (workers/engine/choices.py asks with `logprobs=0` for those).

`capture` runs between the grammar mask and the sampler: the log-softmax of the rows that asked, taken
before logit_bias, the penalties, temperature, top-k and top-p touch the logits (rqbatcher.schema.TokenLogprob says
what the numbers mean). `record` then keeps, per request, the sampled token's logprob and the top
alternatives until the engine takes the token (`pop`). A step where no sequence asked costs nothing.

The prompt's logprobs (`GenerationRequest.prompt_logprobs`) come from the prefill the job runs anyway: the runner
projects every prompt position of an asking sequence's chunks (`ModelRunner.prompt_logits`), `record_prompt` keeps
each prompt token's logprob, rank and top alternatives (the first token has none: nothing predicts it), and the
request's last output carries them (`prompt_part`). A sequence with `max_tokens` 0 is prefill-only: the scheduler
ends it once its prompt is computed, drawing no token (`Sequence.prefill_only`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rqbatcher.schema import TokenLogprob, TopLogprob
from rqbatcher.workers.scheduler.sequence import Sequence

TOKEN_TEXT_CACHE_SIZE = 1 << 16
IMPOSSIBLE_LOGPROB = -9999.0  # what OpenAI reports for a token of no probability (JSON has no -inf)


@dataclass
class Captured:
    rows: list[int]  # rows of the step's logits
    logprobs: torch.Tensor  # [len(rows), V]
    top_values: torch.Tensor  # [len(rows), k]
    top_ids: torch.Tensor


class Logprobs:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._pending: dict[str, TokenLogprob] = {}
        self._prompts: dict[str, list[TokenLogprob | None]] = {}  # by request, one per prompt token

    def capture(self, logits: torch.Tensor, seqs: list[Sequence],
                prompt_logits: dict[Sequence, tuple[int, torch.Tensor]] | None = None) -> Captured | None:
        """The sampling rows' logprobs, for `record` once the tokens are drawn; the prompt rows' are kept now."""
        if prompt_logits:
            self.record_prompt(prompt_logits)
        rows = [i for i, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
        if not rows:
            return None
        logprobs = logits[rows].float().log_softmax(dim=-1)
        k = max(seqs[i].sampling.logprobs for i in rows)
        top = logprobs.topk(k, dim=-1) if k else None
        empty = logprobs[:, :0]
        return Captured(rows, logprobs, top.values if top else empty, top.indices if top else empty.long())

    def record(self, captured: Captured | None, seqs: list[Sequence], tokens: list[int]) -> None:
        if captured is None:
            return
        chosen = captured.logprobs[range(len(captured.rows)), [tokens[i] for i in captured.rows]].tolist()
        top_values, top_ids = captured.top_values.tolist(), captured.top_ids.tolist()
        for j, i in enumerate(captured.rows):
            k = seqs[i].sampling.logprobs
            top = [TopLogprob(token=self.text(t), logprob=v)
                   for t, v in zip(top_ids[j][:k], top_values[j][:k]) if math.isfinite(v)]
            self._pending[seqs[i].request_id] = TokenLogprob(
                token=self.text(tokens[i]), logprob=max(chosen[j], IMPOSSIBLE_LOGPROB), top_logprobs=top)

    def pop(self, request_id: str) -> TokenLogprob | None:
        """The logprobs of the token the request was last given (None if it did not ask)."""
        return self._pending.pop(request_id, None)

    def record_prompt(self, prompt_logits: dict[Sequence, tuple[int, torch.Tensor]]) -> None:
        """Keep the prompt tokens' logprobs of a step's prompt rows (`ModelRunner.prompt_logits`)."""
        for seq, (first, logits) in prompt_logits.items():
            logprobs = logits.float().log_softmax(dim=-1)
            targets = torch.tensor(seq.token_ids[first : first + len(logits)], device=logits.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0]
            ranks = ((logprobs > chosen[:, None]).sum(dim=-1) + 1).tolist()
            top = logprobs.topk(seq.prompt_logprobs, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
            kept = self._prompts.setdefault(seq.request_id, [None] * seq.num_prompt_tokens)
            for j, (token, logprob) in enumerate(zip(targets.tolist(), chosen.tolist())):
                top_j = [TopLogprob(token=self.text(t), logprob=v, token_id=t)
                         for t, v in zip(top_ids[j], top_values[j]) if math.isfinite(v)]
                kept[first + j] = TokenLogprob(token=self.text(token), logprob=max(logprob, IMPOSSIBLE_LOGPROB),
                                               top_logprobs=top_j, rank=ranks[j])

    def prompt_part(self, seq: Sequence) -> dict:
        """A request's prompt logprobs and token ids, for its last output ({} when it did not ask); forgets them."""
        kept = self._prompts.pop(seq.request_id, None)
        if seq.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": kept or [None] * seq.num_prompt_tokens, "prompt_token_ids": seq.prompt_token_ids}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if len(self._texts) >= TOKEN_TEXT_CACHE_SIZE:
                self._texts.clear()
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text
