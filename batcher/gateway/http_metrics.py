"""The gateway's own Prometheus metrics, served on its /metrics: requests by route, method and status, their
latency (to the last byte: a stream counts until its end), the streams open now, each tenant's limits and the
requests refused for passing one (429), by tenant and limit.

Routes are labelled by their template (`/v1/batches/{batch_id}`), never by the path a client sent, so a
scan of random ids cannot blow up the number of series.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rqbatcher.gateway.tenant_limits import Limits

UNMATCHED_ROUTE = "other"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("batcher_gateway_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=registry)
        self.latency = Histogram("batcher_gateway_request_duration_seconds",
                                 "Time from a request's arrival to its response's last byte, by route",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=registry)
        self.streams = Gauge("batcher_gateway_streams", "Completion streams (server-sent events) open now",
                             registry=registry)
        self.rate_limited = Counter("batcher_gateway_rate_limited",
                                    "Requests refused with 429 for passing a tenant's limit, by tenant and limit "
                                    "(requests, tokens, concurrency, batch_lines)", ["tenant", "limit"],
                                    registry=registry)
        self.tenant_limits = Gauge("batcher_gateway_tenant_limit",
                                   "Each tenant's limits as this gateway enforces them (a limit not set is absent)",
                                   ["tenant", "limit"], registry=registry)

    def show_limits(self, limits: dict[str, Limits]) -> None:
        for tenant, tenant_limits in limits.items():
            for name, value in asdict(tenant_limits).items():
                if value is not None:
                    self.tenant_limits.labels(tenant, name).set(value)


class MetricsMiddleware:
    """Counts and times every HTTP request; `routes` gives each endpoint its route template."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: list[Route]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    def route_of(self, scope: Scope) -> str:
        """The template of the route the path matches (whatever the method), found even for a request that
        was answered before routing (a 401)."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return UNMATCHED_ROUTE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = self.route_of(scope)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route, scope["method"]).observe(time.perf_counter() - started)
