"""Options shared by several commands, each readable from a BATCHER_* variable."""

from __future__ import annotations

import functools

import click

from rqbatcher import config as c
from rqbatcher.client import DEFAULT_REDIS_URL, REDIS_URL_ENV
from rqbatcher.gateway.tenant_limits import Limits
from rqbatcher.jobs import durability, keys

redis_url_option = click.option(
    "--redis-url", default=DEFAULT_REDIS_URL, envvar=REDIS_URL_ENV, show_default=True,
    help="redis://[:password@]host:port/db, rediss:// for TLS, or "
         "redis+sentinel://[:password@]host:port[,host:port...]/service[/db] (rediss+sentinel:// for TLS).")
queue_option = click.option("--queue", default=keys.DEFAULT_QUEUE, show_default=True, help="The queue to submit to.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def make_client(redis_url: str, queue: str = keys.DEFAULT_QUEUE):
    """The client a command uses (one place, so that tests can put a fake Redis behind every command)."""
    from rqbatcher.client import Client

    return Client(redis_url, queue=queue)


prefix_caching_option = click.option(
    "--prefix-caching/--no-prefix-caching", default=c.DEFAULT_PREFIX_CACHING, envvar="BATCHER_PREFIX_CACHING",
    show_default=True, help="Reuse the KV blocks of prompt prefixes computed before (shared instructions, documents).")


def engine_options(func):
    """Add the engine knobs to a command; the command receives `engine_config: EngineConfig`."""
    options = [
        click.option("--model", default=c.DEFAULT_MODEL, envvar="BATCHER_MODEL", show_default=True,
                     help="A local model folder, a GGUF file (converted once), a hub id, or 'smollm2' (the bundled "
                          "SmolLM2-135M-Instruct)."),
        click.option("--policy", type=click.Choice(c.POLICIES), default="continuous", envvar="BATCHER_POLICY",
                     show_default=True, help="continuous batching, or the static baseline."),
        click.option("--max-num-seqs", type=click.IntRange(1), default=c.DEFAULT_MAX_NUM_SEQS,
                     envvar="BATCHER_MAX_NUM_SEQS", show_default=True, help="Slots: sequences in one step."),
        click.option("--max-num-batched-tokens", type=click.IntRange(1), default=c.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                     envvar="BATCHER_MAX_NUM_BATCHED_TOKENS", show_default=True,
                     help="Token budget of one step; prompts longer than this are prefilled in chunks."),
        click.option("--block-size", type=click.IntRange(1), default=c.DEFAULT_BLOCK_SIZE,
                     envvar="BATCHER_BLOCK_SIZE", show_default=True, help="Tokens per KV-cache block."),
        click.option("--num-blocks", type=click.IntRange(1), default=None, envvar="BATCHER_NUM_BLOCKS",
                     help="KV-cache blocks (default: as many as --kv-cache-bytes holds)."),
        click.option("--kv-cache-bytes", type=click.IntRange(1), default=c.DEFAULT_KV_CACHE_BYTES,
                     envvar="BATCHER_KV_CACHE_BYTES", show_default=True, help="Memory budget of the KV cache."),
        click.option("--max-model-len", type=click.IntRange(2), default=None, envvar="BATCHER_MAX_MODEL_LEN",
                     help="Longest prompt plus output (default: the model's context)."),
        click.option("--dtype", type=click.Choice(c.DTYPES), default=c.DEFAULT_DTYPE, envvar="BATCHER_DTYPE",
                     show_default=True, help="auto: bf16 on a GPU that has it; on a CPU, bf16 only where a "
                     "start-up matmul race shows it faster than fp32."),
        click.option("--quantization", type=click.Choice(c.QUANTIZATIONS), default=c.DEFAULT_QUANTIZATION,
                     envvar="BATCHER_QUANTIZATION", show_default=True,
                     help="int8: the decoder's linears and the LM head on int8 weights (per output channel; "
                     "activations per row, rotated in blocks of 64), a quarter of fp32's bytes to stream per decode "
                     "step; attention and the KV cache keep --dtype."),
        click.option("--attention-backend", type=click.Choice(c.ATTENTION_BACKENDS),
                     default=c.DEFAULT_ATTENTION_BACKEND, envvar="BATCHER_ATTENTION_BACKEND", show_default=True,
                     help="auto: triton on CUDA; cpu (bf16 AVX-512 decode kernels) for a bf16 model on a CPU that "
                     "has AVX-512 BF16; torch (the reference) elsewhere. triton runs on a CPU only under "
                     "TRITON_INTERPRET=1 (for tests)."),
        click.option("--device", default=c.DEFAULT_DEVICE, envvar="BATCHER_DEVICE", show_default=True,
                     help="cpu, cuda, cuda:1 ... or auto."),
        click.option("--compile/--no-compile", default=False, envvar="BATCHER_COMPILE",
                     show_default=True, help="torch.compile the forward of steps of up to --max-num-seqs tokens: "
                     "faster decode steps, after a start-up of tens of seconds per token-count bucket."),
        prefix_caching_option,
        click.option("--batch-invariant/--no-batch-invariant", default=c.DEFAULT_BATCH_INVARIANT,
                     envvar="BATCHER_BATCH_INVARIANT", show_default=True,
                     help="bf16 on batcher's CPU kernels: a request's tokens do not depend on what else runs "
                          "(docs/batch-invariance.md)."),
        click.option("--min-batch-share", type=click.FloatRange(0, 1), default=c.DEFAULT_MIN_BATCH_SHARE,
                     envvar="BATCHER_MIN_BATCH_SHARE", show_default=True,
                     help="Fraction of the slots batch work keeps under any load of interactive work."),
        click.option("--step-time-target", type=click.FloatRange(0), default=c.DEFAULT_STEP_TIME_TARGET_S,
                     envvar="BATCHER_STEP_TIME_TARGET",
                     help="Seconds a step may take while interactive or priority work runs or waits: batch prompt "
                     "chunks are cut to it from the measured step costs (0: always the full token budget). "
                     "Default: measured, twice the step the running decodes take alone."),
        click.option("--task", "tasks", type=click.Choice(c.TASKS), multiple=True, envvar="BATCHER_TASK",
                     help="What to serve: generate, embed, or both (--task generate --task embed; a causal LM embeds "
                          "from its final hidden states). Default: the model's nature (an embedding model embeds)."),
    ]
    names = ["model", "policy", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks",
             "kv_cache_bytes", "max_model_len", "dtype", "quantization", "attention_backend", "device", "compile",
             "prefix_caching", "batch_invariant", "min_batch_share", "step_time_target", "tasks"]

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        kwargs["engine_config"] = c.EngineConfig(**{n: kwargs.pop(n) for n in names})
        return func(*args, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def replica_wait_options(func):
    """Add --wait-replicas and --wait-timeout-ms to a command that writes what is acknowledged (enqueues, job
    ends); they set this process's `rqbatcher.jobs.durability` policy before the command runs."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        replicas, timeout_ms = kwargs.pop("wait_replicas"), kwargs.pop("wait_timeout_ms")
        try:
            policy = durability.ReplicaWait(None if replicas.strip().lower() == durability.AUTO else int(replicas),
                                            timeout_ms)
        except ValueError as exc:
            raise click.BadParameter(f"--wait-replicas is a number or `auto`: {exc}") from None
        durability.configure(policy)
        return func(*args, **kwargs)

    wrapper = click.option(
        "--wait-timeout-ms", type=click.IntRange(1), default=durability.DEFAULT_TIMEOUT_MS, show_default=True,
        envvar=durability.TIMEOUT_ENV, help="The longest a write waits for its replicas.")(wrapper)
    return click.option(
        "--wait-replicas", default=durability.AUTO, show_default=True, envvar=durability.REPLICAS_ENV,
        help="Acknowledge an enqueue or a job's end once this many replicas hold it (WAIT); auto: 1 where the "
             "primary has replicas, 0 where it has none.")(wrapper)


def key_values(pairs: tuple[str, ...], option: str) -> dict[str, str] | None:
    """Repeated KEY=VALUE options as a dict (None when none was given)."""
    if not pairs:
        return None
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise click.BadParameter(f"give KEY=VALUE, got {bad[0]!r}", param_hint=option)
    return dict(p.split("=", 1) for p in pairs)


def tenant_limit_options(func):
    """Add every tenant's default limits in the gateway (--requests-per-minute ...; no limit unless given); the command
    receives `default_limits: Limits` (batcher/gateway/tenant_limits.py). A key's line in the keys file overrides
    them for its tenant."""
    helps = {"requests_per_minute": "Requests a tenant may start per minute (chat, completions, responses, "
                                    "embeddings).",
             "tokens_per_minute": "Tokens a tenant may use per minute: a request reserves its prompt's estimate "
                                  "plus max_tokens, settled to its usage at its end.",
             "max_concurrent_requests": "Requests of one tenant in flight at once.",
             "max_queued_batch_lines": "Batch lines of one tenant queued and not yet run; a batch that would pass it "
                                       "is refused whole."}

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        kwargs["default_limits"] = Limits(**{name: kwargs.pop(name) for name in helps})
        return func(*args, **kwargs)

    for name, help_text in reversed(helps.items()):
        wrapper = click.option(f"--{name.replace('_', '-')}", type=click.IntRange(1), default=None,
                               envvar=f"BATCHER_{name.upper()}", help=help_text + " Default: no limit.")(wrapper)
    return wrapper
