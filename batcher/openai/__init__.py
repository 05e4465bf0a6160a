"""OpenAI's wire formats, which the gateway and batch lines both speak: chat completions and completions
(`batch_lines`), responses (`responses/`), embeddings (`embeddings_body`), the endpoints of batch lines
(`batch_endpoints`), logprob objects and service tiers. It imports only the light base (schema, sampling, errors,
tools/), never jobs/, batches/, the client or the gateway."""
