"""The OpenAI-compatible HTTP gateway: `batcher serve`, in the `[server]` extra.

One more producer and consumer of Redis, with no state of its own: files, batches and jobs live in Redis,
so any number of replicas can run behind a load balancer. It never imports torch.

- `app`               the Starlette application: routes, error handlers, middleware, /v1/models, /health
- `auth`              API keys (each one a tenant), checked in constant time
- `error_objects`     OpenAI's error object, and which fault answers which status
- `body`              request bodies read under a size limit
- `job_service`       what every route does with a job: the model check against the live workers (read at most
                      once a second), submit, wait for the end (its `done` event carries the result), cancel
- `job_streams`       a job's Redis stream read without blocking the event loop, and the text relayed across restarts
- `completions`       /v1/completions and /v1/chat/completions: a job's answer, or its stream as SSE
- `response_routes`   /v1/responses (stored, background, streamed and resumed); `response_events` its SSE events;
                      `response_records` the stored responses in Redis
- `embedding_routes`  /v1/embeddings
- `file_routes`       /v1/files: uploads parsed as a stream into Redis, contents streamed back
- `batch_routes`      /v1/batches: create from an uploaded file, read, list, cancel
- `http_metrics`      the gateway's own Prometheus metrics
- `tenant_limits`     each tenant's limits (defaults, the keys file's overrides), what a request reserves, usage now
- `tenant_admission`  those limits enforced in Redis across gateways: one Lua script a check, 429s and their headers
- `defaults`          the defaults `batcher serve --help` shows, importable without the server extra
"""
