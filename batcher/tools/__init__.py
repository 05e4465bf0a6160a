"""Tool calls (OpenAI's function tools), the torch-free half.

- `definitions`: the request's tools and tool_choice, and the calls an assistant message carries, with their checks;
- `formats`: each model family's call text (Hermes/Qwen, Llama 3 JSON, Mistral, and our fallback);
- `grammar`: the llguidance grammar that makes an answer a well-formed call in that format (or text, for `auto`);
- `prompt`: the messages and tools a chat template is given, or the fallback prompt for a template without tools;
- `calls`: the calls read back out of the answer's text in that format, whole or as streamed deltas.
"""
