"""OpenAI's wire formats, which the gateway and batch lines both speak: chat completions and completions
(`generation_body` reads their bodies, `generation_answer` writes their answers), responses (`responses/`),
embeddings (`embeddings_body`), the batch file's line envelope (`batch_lines`) and the endpoints a line may name
(`batch_endpoints`), logprob objects and service tiers. It imports only the light base (schema, sampling, errors,
tools/), never jobs/, batches/, the client or the gateway."""
