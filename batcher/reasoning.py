"""A thinking model's reasoning, apart from its answer: the markers each family writes, a splitter fed the text as
it streams, and the grammar that lets a constrained answer (JSON, regex, choice, tools) start after the reasoning.

Qwen3 writes `<think>...</think>` before its answer (format `think`); DeepSeek-R1 distills, and Qwen3's thinking-only
releases, open `<think>` in the generation prompt, so their answer starts inside the reasoning (`think_in_prompt`).
Both markers are tokens of their tokenizers. The worker names a model's format from its tokenizer and template
(workers/engine/reasoning_probe.py); the name rides on ChatFormat. Granite's text markers and gpt-oss's channels are
not read: their reasoning stays in the content.

A request turns thinking off through the template's switch (vLLM's `chat_template_kwargs: {"enable_thinking": false}`,
or `reasoning_effort: "none"`): its whole answer is then content, and its grammar starts at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

THINK = "think"
THINK_IN_PROMPT = "think_in_prompt"
THINKING_SWITCH = "enable_thinking"  # the variable Qwen3's template reads
EFFORT = "reasoning_effort"  # the variable gpt-oss's template reads; "none" turns thinking off
NO_EFFORT = "none"
MAX_REASONING_SHARE = 0.5  # of max_tokens, the most a constrained answer's reasoning takes: the rest is the answer's
ANSWER_GRAMMAR = "answer"  # the name the wrapped grammar goes by in the grammar that puts reasoning first
MAX_TEMPLATE_KWARGS = 16
# What the template call sets itself (transformers' apply_chat_template parameters, the template's messages): a
# request's template variables cannot override them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
    "continue_final_message", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tokenizer"})


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    open: str
    close: str
    prompt_opens: bool  # the generation prompt opens the reasoning: the answer starts inside it


FORMATS = {THINK: ReasoningFormat(THINK, "<think>", "</think>", prompt_opens=False),
           THINK_IN_PROMPT: ReasoningFormat(THINK_IN_PROMPT, "<think>", "</think>", prompt_opens=True)}


def thinking_enabled(template_kwargs: dict | None) -> bool:
    """Whether the request leaves the model's thinking on (the template's switch, or reasoning_effort `none`)."""
    kwargs = template_kwargs or {}
    return kwargs.get(THINKING_SWITCH) is not False and kwargs.get(EFFORT) != NO_EFFORT


def checked_kwargs(template_kwargs: dict) -> dict:
    """The request's template variables, if the template may take them; ValueError naming one it may not."""
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
    odd = sorted(name for name in template_kwargs if not name.isidentifier())
    if odd:
        raise ValueError(f"{odd[0]!r} is not a template variable's name (an identifier)")
    return template_kwargs


TemplateKwargs = Annotated[dict[str, str | int | float | bool], AfterValidator(checked_kwargs)]


class ReasoningSplitter:
    """Splits one answer's text, fed in pieces of any size, into (reasoning, content) deltas. A piece that may
    still be a marker's beginning is held back until the next piece tells. The newlines the models write after
    each marker are dropped, so content starts with the answer itself."""

    def __init__(self, format_name: str | None, thinking: bool = True) -> None:
        self.format = FORMATS.get(format_name) if thinking else None
        self.state = "content" if self.format is None else "reasoning" if self.format.prompt_opens else "opening"
        self.reasoned = self.state == "reasoning"  # some reasoning was (or is being) written
        self._held = ""
        self._trim = self.state != "content"  # drop the newlines that start the next part

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        while self._held:
            if self._trim:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    break
                self._trim = False
            if self.state == "opening":
                if self.format.open.startswith(self._held) and self._held != self.format.open:
                    break  # could still be the opening marker
                opened = self._held.startswith(self.format.open)
                self.state, self.reasoned, self._trim = ("reasoning", True, True) if opened else ("content", False,
                                                                                                   False)
                self._held = self._held[len(self.format.open):] if opened else self._held
            elif self.state == "reasoning":
                at = self._held.find(self.format.close)
                if at < 0:
                    keep = _partial_marker(self._held, self.format.close)
                    reasoning += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    break
                reasoning += self._held[:at]
                self._held, self.state, self._trim = self._held[at + len(self.format.close):], "content", True
            else:
                content, self._held = content + self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the answer has ended (cut short inside the reasoning, or in a marker)."""
        held, self._held = self._held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    return next((size for size in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:size])), 0)


def split_answer(text: str, format_name: str | None, thinking: bool = True) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning is None when the model wrote none."""
    splitter = ReasoningSplitter(format_name, thinking)
    parts = [splitter.feed(text), splitter.finish()]
    reasoning = "".join(r for r, _ in parts)
    return (reasoning if splitter.reasoned else None), "".join(c for _, c in parts)


def after_reasoning(answer_grammar: str | None, format_name: str | None, max_tokens: int) -> str | None:
    """The grammar of `reasoning? answer`: free reasoning (without the closing marker, at most MAX_REASONING_SHARE
    of max_tokens), the closing marker, then `answer_grammar` (an llguidance grammar: Lark text or its JSON form).
    The markers are tokens (`<think>` in Lark names the token), so the model writes them as it was trained to."""
    fmt = FORMATS.get(format_name)
    if answer_grammar is None or fmt is None:
        return answer_grammar
    try:
        grammars = json.loads(answer_grammar)["grammars"]
    except (ValueError, TypeError, KeyError):
        grammars = [{"lark_grammar": answer_grammar}]
    budget = max(1, int(max_tokens * MAX_REASONING_SHARE))
    close = re.escape(fmt.close).replace("/", "\\/")  # the marker inside a Lark regex
    reasoning = f"reasoning {fmt.close} GAP? @{ANSWER_GRAMMAR}"
    start = reasoning if fmt.prompt_opens else f"{fmt.open} {reasoning} | @{ANSWER_GRAMMAR}"
    lark = "\n".join((f"start: {start}",
                      f"reasoning[max_tokens={budget}]: /(?s:.*)/ & ~/(?s:.*){close}(?s:.*)/",
                      'GAP: "\\n" | "\\n\\n"'))
    answer = {**grammars[0], "name": ANSWER_GRAMMAR}
    return json.dumps({"grammars": [{"name": "reasoning_first", "lark_grammar": lark}, answer, *grammars[1:]]})


def template_variables(template_kwargs, effort: str | None):
    """A chat body's `chat_template_kwargs` (vLLM's) with its `reasoning_effort`, which templates read under that name
    (gpt-oss); `none` also turns Qwen3's switch off. A value of another shape passes on for the schema to refuse."""
    if effort is None or not isinstance(template_kwargs, dict | None):
        return template_kwargs if template_kwargs is not None else {}
    switch = {THINKING_SWITCH: False} if effort == NO_EFFORT else {}
    return {**switch, EFFORT: effort, **(template_kwargs or {})}
