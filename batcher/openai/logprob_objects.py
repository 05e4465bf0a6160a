"""Logprobs in OpenAI's shapes, from batcher's `TokenLogprob`s (what the numbers mean: rqbatcher.schema).

Chat: `logprobs: true` and `top_logprobs` (0-20) in the body; a choice's `logprobs` is
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}`.
Completions: `logprobs` (0-5) in the body; a choice's `logprobs` is
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A streamed chunk carries the logprobs of the tokens whose text it carries, in the same shapes.

The prompt's logprobs (`GenerationResult.prompt_logprobs`): a completion with `echo` and `logprobs` begins its
legacy object with the prompt's tokens (the first one's logprob and top_logprobs null: nothing predicts it), and
vLLM's `prompt_logprobs` extra field answers vLLM's list: None first, then `{token_id: {logprob, rank,
decoded_token}}` for the prompt token and its `prompt_logprobs` most likely alternatives.
"""

from __future__ import annotations

from typing import Any

from rqbatcher.sampling_params import MAX_TOP_LOGPROBS
from rqbatcher.schema import TokenLogprob

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions endpoint's limit


class LogprobsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def requested(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a body asks for (0: the tokens' own only), or None for no logprobs."""
    if chat:
        wanted, top = body.get("logprobs", False), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise LogprobsError("logprobs must be true or false", "logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise LogprobsError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top is not None and not wanted:
            raise LogprobsError("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None
    wanted = body.get("logprobs")
    if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool)
                               or not 0 <= wanted <= MAX_COMPLETION_LOGPROBS):
        raise LogprobsError(f"logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}", "logprobs")
    return wanted


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [{**_token(lp.token, lp.logprob),
                         "top_logprobs": [_token(t.token, t.logprob) for t in lp.top_logprobs]} for lp in logprobs],
            "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob] | None, text_offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
            "text_offset": offsets}


def echoed_logprobs(prompt: str, entries: list[TokenLogprob | None], generated: list[TokenLogprob] | None) -> dict:
    """The legacy object of a completion that echoes its text prompt: the prompt's tokens, then the generated ones.
    The first token's text is what of the prompt precedes the others' (none predicts it, so none names it)."""
    rest = "".join(e.token for e in entries[1:] if e is not None)
    first = prompt[: len(prompt) - len(rest)] if prompt.endswith(rest) else ""
    tokens = [first] + [e.token if e is not None else "" for e in entries[1:]]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    shaped = {"tokens": tokens, "token_logprobs": [None] + [e and e.logprob for e in entries[1:]],
              "top_logprobs": [None] + [e and {t.token: t.logprob for t in e.top_logprobs} for e in entries[1:]],
              "text_offset": offsets}
    after = completion_logprobs(generated, len(prompt)) or {}
    return {key: value + after.get(key, []) for key, value in shaped.items()}


def prompt_logprobs_body(entries: list[TokenLogprob | None], token_ids: list[int], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: for each prompt token after the first, it and then its k likeliest, by token id."""
    def one(token_id: int, entry: TokenLogprob) -> dict:
        shaped = {token_id: {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for rank, top in enumerate(entry.top_logprobs[:k], start=1):
            shaped.setdefault(top.token_id, {"logprob": top.logprob, "rank": rank, "decoded_token": top.token})
        return shaped

    return [None if e is None else one(t, e) for t, e in zip(token_ids, entries)]
