"""The gateway's defaults, importable without the server extra (the CLI shows them in `batcher serve --help`)."""

DEFAULT_HOST = "127.0.0.1"  # with no API keys, the only kind of address the gateway listens on
DEFAULT_PORT = 8000
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a JSON body: room for the longest prompt (1 MiB) and its escaping
API_KEYS_ENV = "BATCHER_API_KEYS"  # comma-separated keys; each is a tenant
API_KEYS_FILE_ENV = "BATCHER_API_KEYS_FILE"  # a file of keys, one a line
