"""Anthropic's Messages API in batcher's terms (torch-free): a body read into a GenerationRequest, a result written as
a Message, a job's stream written as Anthropic's server-sent events, and Anthropic's error object. The gateway's
/v1/messages routes (batcher/gateway/message_routes.py) speak HTTP around it; the tools machinery (batcher/tools) is
the chat endpoint's, so a tool_use block is a tool call read out of the answer the same way."""
