"""The OpenAI-compatible HTTP gateway: `batcher serve`, in the `[server]` extra.

One more producer and consumer of Redis, with no state of its own: files, batches and jobs live in Redis,
so any number of replicas can run behind a load balancer. It never imports torch.

- `app`          the Starlette application: routes, error handlers, middleware
- `auth`         API keys (each one a tenant), checked in constant time
- `errors`       OpenAI's error object, and which fault answers which status
- `body`         request bodies read under a size limit
- `files`        /v1/files: uploads parsed as a stream into Redis, contents streamed back
- `batches`      /v1/batches: create from an uploaded file, read, list, cancel
- `completions`  /v1/completions and /v1/chat/completions: a job, its result or its stream as SSE
- `metrics`      the gateway's own Prometheus metrics
"""
