"""A request's prompt as token ids: its own ids, its text, or its messages through the model's chat template (with
the tools and the template variables the request gives), exactly as every job kind renders it."""

from __future__ import annotations

from rqbatcher.schema import GenerationRequest
from rqbatcher.tools.prompt import chat_inputs, template_reads_tools
from rqbatcher.workers.engine.api import RequestError


def prompt_ids(request: GenerationRequest, tokenizer, model_name: str) -> list[int]:
    """The ids the model reads; RequestError for messages the model cannot take (no template, or one that raises)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if request.messages is not None and not has_template:
        raise RequestError(f"model {model_name!r} has no chat template; send a prompt instead of messages")
    if request.messages is not None:
        messages, tools = chat_inputs(request, template_reads_tools(tokenizer.chat_template))
    elif request.chat and has_template:
        messages, tools = [{"role": "user", "content": request.prompt}], None
    else:
        return list(tokenizer(request.prompt)["input_ids"])
    try:
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, **request.chat_template_kwargs)["input_ids"])
    except Exception as exc:  # noqa: BLE001  (a template that raises on this conversation: jinja's own errors)
        raise RequestError(f"model {model_name!r}'s chat template refused the messages: {exc}") from None
