"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters and word-boundary spaces, so each new
token is decoded together with a few tokens before it, and text is released only once it no
longer ends in a partial character (U+FFFD). Text that could still turn into a stop string is
held back until it cannot.

Special tokens are left out of the text, but for the `kept` ones: a tool call's markers that the model writes as
special tokens (`<tool_call>`, `[TOOL_CALLS]`), which the readers of its calls must see (batcher/tools/calls.py).
"""

from __future__ import annotations

PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def special_ids(tokenizer) -> frozenset[int]:
    """Every special token of `tokenizer`: its named ones and the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] = (),
                 kept: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self._left_out = special_ids(tokenizer) - set(kept) if kept else None  # None: every special token
        self.stop = list(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._released = 0
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def _decode(self, ids: list[int]) -> str:
        if self._left_out is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self._left_out], skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now final."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        new = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if hits:  # the text ends where the earliest match begins
            at, self.matched = min(hits)
            self.text = self.text[:at]
            return self.flush()
        ready = len(self.text) - self._holdback
        if ready <= self._released:
            return ""
        delta, self._released = self.text[self._released : ready], ready
        return delta

    def flush(self) -> str:
        """Release everything held back (the sequence has finished)."""
        delta, self._released = self.text[self._released :], len(self.text)
        return delta
