"""Whether the served model thinks before it answers, and how it marks its reasoning (batcher/reasoning.py's
formats), found once at load: the tokenizer has each marker as one token, the chat template writes the closing
one, and a generation prompt rendered through the template tells whether the answer starts inside the reasoning."""

from __future__ import annotations

import logging

from rqbatcher.reasoning import FORMATS, THINK, THINK_IN_PROMPT
from rqbatcher.workers.engine.detokenize import special_ids

log = logging.getLogger(__name__)

PROBE_MESSAGES = [{"role": "user", "content": "Hello"}]


def reasoning_format_of(tokenizer) -> str | None:
    """The name of `tokenizer`'s reasoning format, None for a model that does not think (or one whose markers
    batcher does not read)."""
    template = getattr(tokenizer, "chat_template", None)
    marks = FORMATS[THINK]
    if not isinstance(template, str) or marks.close not in template:
        return None
    vocab = tokenizer.get_vocab()
    if marks.open not in vocab or marks.close not in vocab:
        return None
    try:
        prompt = tokenizer.apply_chat_template(PROBE_MESSAGES, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001  (a template that needs more than a user turn: read it as Qwen3's)
        log.warning("the chat template refused the reasoning probe (%s): reading the model's own markers", exc)
        return THINK
    opened = prompt.rfind(marks.open) > prompt.rfind(marks.close)
    return THINK_IN_PROMPT if opened else THINK


def special_marker_ids(tokenizer, format_name: str | None) -> tuple[int, ...]:
    """The ids of the format's markers that `tokenizer` holds as special tokens (Qwen3's are not special; a model
    whose are would lose them in decoding): the detokenizer keeps them, so the reasoning is read apart."""
    marks = FORMATS.get(format_name)
    if marks is None:
        return ()
    ids = [tokenizer.convert_tokens_to_ids(marker) for marker in (marks.open, marks.close)]
    return tuple(i for i in ids if i in special_ids(tokenizer))
