"""`batcher webhooks add | list | remove | worker`: each tenant's signed webhook endpoints, and the worker that
delivers to them (docs/webhooks.md).

A tenant is named as the gateway names it (`key-<16 hex>`), or by one of its API keys (`--api-key`); with neither,
the endpoint is for work that names no tenant (an open gateway's, `tenant: null`).
"""

from __future__ import annotations

import json

import click

from rqbatcher.cli.group import main
from rqbatcher.cli.options import json_option, redis_url_option
from rqbatcher.webhooks.event_payload import EVENT_TYPES


def _connect(redis_url: str):
    from rqbatcher.client import connect

    return connect(redis_url)


@main.group()
def webhooks():
    """Signed webhooks: the end of a batch or a background response, POSTed to its tenant's endpoints."""


@webhooks.command()
@redis_url_option
@click.option("--url", required=True, help="Where events are POSTed (http or https).")
@click.option("--tenant", default=None, help="The gateway's tenant (key-<16 hex>); omit for work of no tenant.")
@click.option("--api-key", default=None, help="Name the tenant by one of its API keys instead (it is not stored).")
@click.option("--events", "events", multiple=True, type=click.Choice(EVENT_TYPES),
              help="An event to send (repeat the option); default: every event.")
@click.option("--allow-private-addresses", is_flag=True,
              help="Let this endpoint reach loopback, private and link-local addresses (an operator's choice).")
def add(redis_url, url, tenant, api_key, events, allow_private_addresses):
    """Add an endpoint and print its id and signing secret (shown this once)."""
    from rqbatcher.webhooks import endpoints
    from rqbatcher.webhooks.addresses import RefusedAddress, UnresolvedHost

    if tenant is not None and api_key is not None:
        raise click.UsageError("give --tenant or --api-key, not both")
    if api_key is not None:
        from rqbatcher.gateway.auth import tenant_of

        tenant = tenant_of(api_key)
    try:
        endpoint = endpoints.add(_connect(redis_url), url, tenant=tenant, events=tuple(events) or EVENT_TYPES,
                                 allow_private_addresses=allow_private_addresses)
    except (RefusedAddress, UnresolvedHost, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"endpoint {endpoint.id} for {endpoint.tenant or 'work of no tenant'}: {endpoint.url}; keep its "
               "signing secret: it is not shown again", err=True)
    click.echo(json.dumps({"id": endpoint.id, "secret": endpoint.secret}))


@webhooks.command(name="list")
@redis_url_option
@json_option
@click.option("--tenant", default=None, help="Only this tenant's endpoints.")
@click.option("--no-tenant", is_flag=True, help="Only the endpoints of work of no tenant.")
def list_endpoints(redis_url, as_json, tenant, no_tenant):
    """Endpoints (never their secrets)."""
    from rqbatcher.webhooks import endpoints

    connection = _connect(redis_url)
    if tenant is not None and no_tenant:
        raise click.UsageError("give --tenant or --no-tenant, not both")
    found = (endpoints.of_tenant(connection, tenant) if tenant is not None or no_tenant
             else endpoints.every(connection))
    if as_json:
        click.echo(json.dumps([e.public() for e in found], indent=1))
        return
    if not found:
        click.echo("no webhook endpoints")
    for e in found:
        private = "  (private addresses allowed)" if e.allow_private_addresses else ""
        click.echo(f"{e.id}  {e.tenant or '-'}  {e.url}  {','.join(e.events)}{private}")


@webhooks.command()
@redis_url_option
@click.argument("endpoint_id")
def remove(redis_url, endpoint_id):
    """Remove an endpoint; its deliveries still waiting send nothing."""
    from rqbatcher.webhooks import endpoints

    if not endpoints.remove(_connect(redis_url), endpoint_id):
        raise click.ClickException(f"no webhook endpoint {endpoint_id}")
    click.echo(f"removed {endpoint_id}", err=True)


@webhooks.command()
@redis_url_option
@click.option("--burst", is_flag=True, help="Exit once the queue is empty.")
def worker(redis_url, burst):
    """Deliver webhooks: an RQ worker on the `webhooks` queue with RQ's scheduler (retries), which also dispatches
    the outbox every second. Never a model worker; run several for more deliveries at once."""
    from rqbatcher.webhooks.delivery_worker import run

    run(lambda: _connect(redis_url), burst=burst)
