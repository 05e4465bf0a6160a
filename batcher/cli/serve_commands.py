"""`batcher serve`: the OpenAI-compatible HTTP gateway (the `[server]` extra; imported only when it runs)."""

from __future__ import annotations

import os

import click

from rqbatcher.batches.file_store import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_FILE_LINES
from rqbatcher.cli.group import main
from rqbatcher.cli.options import queue_option, redis_url_option, replica_wait_options, tenant_limit_options
from rqbatcher.client import DEFAULT_MAX_QUEUE_LENGTH
from rqbatcher.errors import BatcherError
from rqbatcher.gateway.defaults import (
    API_KEYS_ENV,
    API_KEYS_FILE_ENV,
    DEFAULT_HOST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PORT,
)


@main.command()
@click.option("--host", default=DEFAULT_HOST, envvar="BATCHER_HOST", show_default=True,
              help="The address to listen on; anything but loopback needs API keys.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, envvar="BATCHER_PORT", show_default=True)
@redis_url_option
@queue_option
@click.option("--api-keys-file", type=click.Path(dir_okay=False), envvar=API_KEYS_FILE_ENV,
              help="API keys, one a line (# comments), each optionally followed by its own limits "
                   "(requests-per-minute=60 ...); added to those of $BATCHER_API_KEYS (comma-separated).")
@click.option("--max-file-bytes", type=click.IntRange(1), default=DEFAULT_MAX_FILE_BYTES, show_default=True,
              envvar="BATCHER_MAX_FILE_BYTES", help="Largest batch input file.")
@click.option("--max-file-lines", type=click.IntRange(1), default=DEFAULT_MAX_FILE_LINES, show_default=True,
              envvar="BATCHER_MAX_FILE_LINES", help="Most requests in a batch input file.")
@click.option("--max-request-bytes", type=click.IntRange(1), default=DEFAULT_MAX_REQUEST_BYTES, show_default=True,
              envvar="BATCHER_MAX_REQUEST_BYTES", help="Largest JSON request body.")
@click.option("--max-queue-length", type=click.IntRange(1), default=DEFAULT_MAX_QUEUE_LENGTH, show_default=True,
              envvar="BATCHER_MAX_QUEUE_LENGTH", help="Answer 429 rather than queue more jobs than this.")
@tenant_limit_options
@replica_wait_options
def serve(host, port, redis_url, queue, api_keys_file, max_file_bytes, max_file_lines, max_request_bytes,
          max_queue_length, default_limits):
    """The OpenAI-compatible HTTP gateway. It serves:

    \b
      POST /v1/chat/completions, /v1/completions   (stream: true too)
      POST /v1/responses; GET, DELETE /v1/responses/{id}; POST /v1/responses/{id}/cancel;
           GET /v1/responses/{id}/input_items
      POST /v1/embeddings
      POST /v1/messages, /v1/messages/count_tokens   (Anthropic's Messages API)
      POST /tokenize, /detokenize   (vLLM's; also /v1/tokenize, /v1/detokenize)
      POST, GET /v1/files; GET, DELETE /v1/files/{id}; GET /v1/files/{id}/content
      POST, GET /v1/batches; GET /v1/batches/{id}; POST /v1/batches/{id}/cancel
      GET /v1/models, /v1/models/{model}
      GET /health, /metrics

    It keeps no state of its own (everything is in Redis), so replicas can run behind a load balancer.
    Each API key is a tenant that sees only its own files and batches. The limits (--requests-per-minute ...) are
    every tenant's, shared by every gateway on the Redis; a key's line in --api-keys-file may override them:
    `sk-abc requests-per-minute=60 max-concurrent-requests=4`. Past one, the answer is 429 (`batcher tenants`)."""
    try:
        import uvicorn

        from rqbatcher.gateway.app import GatewayConfig, create_app
        from rqbatcher.gateway.auth import ApiKeys, check_bind
    except ImportError as exc:
        raise BatcherError(f"`batcher serve` needs the server extra (pip install 'rqbatcher[server]'): {exc}") from None
    from rqbatcher.batches.file_store import FileLimits
    from rqbatcher.client import connect
    from rqbatcher.jobs import keys
    from rqbatcher.jobs.connection import connect_async

    api_keys = ApiKeys.load(os.environ.get(API_KEYS_ENV), api_keys_file)
    check_bind(host, api_keys)
    keys.check_queue(queue)
    connection = connect(redis_url)
    connection.ping()  # an unreachable Redis is a one-line error now, not a 503 on every request
    config = GatewayConfig(queue=queue, api_keys=api_keys,
                           file_limits=FileLimits(max_bytes=max_file_bytes, max_lines=max_file_lines),
                           max_request_bytes=max_request_bytes, max_queue_length=max_queue_length,
                           default_limits=default_limits)
    app = create_app(config, connection, connect_async(redis_url))
    click.echo(f"batcher gateway on http://{host}:{port} (queue {queue}, "
               f"{len(api_keys) or 'no'} API key{'' if len(api_keys) == 1 else 's'})", err=True)
    uvicorn.run(app, host=host, port=port)
