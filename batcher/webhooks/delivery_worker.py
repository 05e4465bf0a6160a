"""`batcher webhooks worker`: an RQ worker on the `webhooks` queue, with RQ's scheduler (which runs the retries),
that also dispatches the outbox every DISPATCH_INTERVAL_S. Producers dispatch after each end they record, so the
periodic dispatch only picks up what they could not (a producer that died right after its transaction, an end
recorded by a cancel). It never loads a model; a stock `rq worker --with-scheduler` on the queue runs the same jobs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis
from rq.serializers import JSONSerializer

from rqbatcher.jobs.rq_adapter import PromptExitWorker
from rqbatcher.webhooks.delivery import DELIVERY_QUEUE
from rqbatcher.webhooks.outbox import dispatch

log = logging.getLogger(__name__)

DISPATCH_INTERVAL_S = 1.0  # an empty outbox costs one round trip per interval


def dispatch_periodically(connect: Callable[[], Redis], stop: threading.Event,
                          interval_s: float = DISPATCH_INTERVAL_S) -> None:
    """Dispatch the outbox until `stop` is set, on a connection of its own (the worker forks a process per job:
    a connection pool shared with this thread could be mid-use at a fork)."""
    connection = connect()
    while not stop.wait(interval_s):
        try:
            dispatch(connection)
        except Exception:  # noqa: BLE001  (Redis away for a while: the outbox waits, the next pass retries)
            log.exception("webhook dispatch failed; retrying in %.0f s", interval_s)


def run(connect: Callable[[], Redis], *, burst: bool = False, interval_s: float = DISPATCH_INTERVAL_S) -> None:
    """Run delivery jobs (and their retries) until stopped; with `burst`, until the queue is empty."""
    connection = connect()
    dispatch(connection)  # what waited while no worker ran
    stop = threading.Event()
    if not burst:
        threading.Thread(target=dispatch_periodically, args=(connect, stop, interval_s), name="webhook-dispatch",
                         daemon=True).start()
    try:
        PromptExitWorker([DELIVERY_QUEUE], connection=connection, serializer=JSONSerializer).work(
            with_scheduler=True, burst=burst)
    finally:
        stop.set()
