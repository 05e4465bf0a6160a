"""Operator commands: `workers`, `drain`, `suspend`, `resume`, `queues`, `requeue`, `tenants`.

Human-readable tables by default, `--json` for scripts."""

from __future__ import annotations

import json
import sys
import time

import click

from rqbatcher.cli.group import main
from rqbatcher.cli.options import json_option, redis_url_option
from rqbatcher.gateway.tenant_limits import usage
from rqbatcher.jobs import admin, keys

DRAIN_POLL_S = 0.5
DEFAULT_DRAIN_TIMEOUT_S = 600


def _connect(redis_url: str):
    from rqbatcher.client import connect

    return connect(redis_url)


def _table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


@main.command()
@redis_url_option
@json_option
def workers(redis_url, as_json):
    """Live workers: model, dtype, quantization, state, jobs in flight, free slots, KV usage, prefix-cache hit rate
    and prefix blocks awaited in flight, tokens/s, the step-time target (! when the given one is infeasible), the
    prompt tokens the last step gave to urgent and batch work, the measured step time, last heartbeat."""
    stats = admin.list_workers(_connect(redis_url))
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in stats], indent=1))
        return
    if not stats:
        click.echo("no live workers")
        return
    rows = [{**s.to_dict(), "kv_usage": f"{s.kv_usage:.0%}", "prefix_hits": f"{s.prefix_cache_hit_rate:.0%}",
             "tokens_per_s": f"{s.tokens_per_s:.1f}", "last_heartbeat": f"{s.heartbeat_age_s:.0f}s ago",
             "by_class": s.in_flight_by_class or "-",
             "step_target": (f"{s.step_time_target_s * 1000:.0f}ms" if s.step_time_target_s else "-")
             + ("!" if s.step_target_infeasible else ""),
             "prompt_urgent/batch": f"{s.urgent_prompt_tokens}/{s.batch_prompt_tokens}",
             "awaited": s.prefix_blocks_awaited,
             "step": f"{s.step_s * 1000:.0f}ms"} for s in stats]
    click.echo(_table(rows, ["name", "host", "queues", "model", "dtype", "quantization", "state", "in_flight",
                             "by_class", "free_slots", "kv_usage", "prefix_hits", "awaited", "tokens_per_s",
                             "step_target", "prompt_urgent/batch", "step", "last_heartbeat"]))


@main.command()
@redis_url_option
@click.argument("names", nargs=-1)
@click.option("--all", "all_workers", is_flag=True, help="Drain every live worker.")
@click.option("--wait", is_flag=True, help="Follow the drain; exit non-zero if it outlasts --timeout.")
@click.option("--timeout", type=click.FloatRange(0), default=DEFAULT_DRAIN_TIMEOUT_S, show_default=True,
              help="Seconds --wait waits.")
def drain(redis_url, names, all_workers, wait, timeout):
    """Stop workers admitting jobs; each finishes its jobs in flight and exits 0."""
    if bool(names) == all_workers:
        raise click.UsageError("give worker NAMES or --all")
    connection = _connect(redis_url)
    live = {s.name: s for s in admin.list_workers(connection)}
    targets = sorted(live) if all_workers else list(names)
    unknown = [n for n in targets if n not in live]
    if unknown:
        click.echo(f"not live (no heartbeat): {', '.join(unknown)}", err=True)
    admin.drain(connection, targets)
    click.echo(f"draining {len(targets)} worker(s): {', '.join(targets) or '-'}", err=True)
    if not wait:
        return
    started = time.monotonic()
    total = max(1, sum(live[n].in_flight for n in targets if n in live))
    with click.progressbar(length=total, label="jobs in flight finished", file=sys.stderr) as bar:
        while True:
            current = {s.name: s for s in admin.list_workers(connection)}
            remaining = [n for n in targets if n in current]
            in_flight = sum(current[n].in_flight for n in remaining)
            done = total - in_flight if remaining else total
            bar.update(max(0, done - bar.pos))
            if not remaining:
                break
            if time.monotonic() - started > timeout:
                click.echo(f"\ntimed out after {timeout:.0f}s; still running: {', '.join(remaining)} "
                           f"({in_flight} jobs in flight)", err=True)
                sys.exit(1)
            time.sleep(DRAIN_POLL_S)
    click.echo(f"drained: {', '.join(targets)}", err=True)


@main.command()
@redis_url_option
def suspend(redis_url):
    """Pause admission on all workers (jobs in flight go on)."""
    admin.suspend_all(_connect(redis_url))
    click.echo("suspended: workers admit no new jobs until `batcher resume`")


@main.command()
@redis_url_option
def resume(redis_url):
    """Resume admission on all workers."""
    admin.resume_all(_connect(redis_url))
    click.echo("resumed")


@main.command()
@redis_url_option
@click.option("--queue", help="One base queue (its priority levels); default: every RQ queue.")
@json_option
def queues(redis_url, queue, as_json):
    """Queue depths and registries: queued, started, failed, finished; the model a queue routes to, and
    whether a live worker serves it."""
    connection = _connect(redis_url)
    overview = admin.queue_overview(connection, queue and keys.check_queue(queue))
    rows = [r.to_dict() for r in overview]
    backlog = admin.class_backlog(overview)
    suspended = bool(admin.is_suspended(connection))
    if as_json:
        click.echo(json.dumps({"suspended": suspended, "queues": rows, "classes": backlog}, indent=1))
        return
    shown = [{**r, "model": r["model"] or "(any)", "served": "yes" if r["served"] else "NO",
              "class": r["service_class"], "tenant": r["tenant"] or "-"} for r in rows]
    click.echo(_table(shown, ["queue", "class", "tenant", "model", "queued", "started", "failed", "finished",
                              "served"]) if rows else "no queues")
    if rows:
        tenants = f" ({backlog['batch']['tenants']} tenant(s) with jobs queued)"
        click.echo("by class (most urgent first): " + "; ".join(
            f"{c} {b['queued']} queued, {b['started']} running" + (tenants if c == "batch" else "")
            for c, b in backlog.items()))
    waiting = [r for r in rows if not r["served"] and r["queued"]]
    for r in waiting:
        click.echo(f"unserved: {r['queued']} job(s) in {r['queue']} wait for a worker serving "
                   f"{r['model'] or 'queue ' + keys.base_queue(r['queue'])}")
    if suspended:
        click.echo("(workers are suspended)")


@main.command()
@redis_url_option
@click.option("--failed", is_flag=True, required=True, help="Requeue the jobs in the failed registries.")
@click.option("--queue", help="Only this base queue (and its priority levels).")
def requeue(redis_url, failed, queue):
    """Put failed jobs back on their queues."""
    n = admin.requeue_failed(_connect(redis_url), queue and keys.check_queue(queue))
    click.echo(f"requeued {n} job(s)")


@main.command()
@redis_url_option
@click.option("--queue", default=keys.DEFAULT_QUEUE, show_default=True,
              help="The base queue whose batch lines are counted.")
@json_option
def tenants(redis_url, queue, as_json):
    """The gateway's tenants (as each `batcher serve` published them at its start): each limit and what the tenant
    uses of it now. Requests and tokens are what its per-minute buckets hold spent (they refill continuously), then
    its requests in flight and its batch lines queued in --queue."""
    rows = usage(_connect(redis_url), keys.check_queue(queue))
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=1))
        return
    if not rows:
        click.echo("no tenants: no gateway has published its limits")
        return

    def of(used, limit) -> str:
        return "-" if limit is None else f"{used:.0f}/{limit}"

    click.echo(_table([{"tenant": r.tenant,
                        "requests/min": of(r.requests, r.limits.requests_per_minute),
                        "tokens/min": of(r.tokens, r.limits.tokens_per_minute),
                        "concurrent": f"{r.concurrent}/{r.limits.max_concurrent_requests or '-'}",
                        "queued_batch_lines": f"{r.queued_batch_lines}/{r.limits.max_queued_batch_lines or '-'}"}
                       for r in rows], ["tenant", "requests/min", "tokens/min", "concurrent", "queued_batch_lines"]))
