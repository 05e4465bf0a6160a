"""A stream that lost events it had acknowledged (an asynchronous failover) never shows a gap: the writer notices
the stream no longer holds its last event, and starts it over with `restart` and the whole text so far. A reader
that had read the lost events, and one that reads from the start, both end with the full text once."""

from __future__ import annotations

import fakeredis
import pytest

from rqbatcher.gateway.job_streams import TextRelay
from rqbatcher.jobs import keys
from rqbatcher.jobs.stream import AttemptFilter
from rqbatcher.schema import GenerationResult, StreamEvent, Usage
from rqbatcher.workers.job_worker.stream_writer import StreamWriter

JOB, EXECUTION = "job-1", "exec-1"


@pytest.fixture
def writer():
    connection = fakeredis.FakeRedis()
    connection.set(keys.lease_key(JOB), EXECUTION)
    w = StreamWriter(connection)
    w.begin(JOB, EXECUTION, None, 3600)
    return connection, w


def entries(connection, after: str = "0-0") -> list[tuple[str, StreamEvent]]:
    return [(i.decode(), StreamEvent.from_fields(f)) for i, f in
            connection.xrange(keys.stream_key(JOB), min=f"({after}" if after != "0-0" else "-")]


def relayed(events: list[StreamEvent], relay: TextRelay | None = None) -> tuple[str, TextRelay]:
    """The text a gateway client is sent for these events (and the relay, to go on with)."""
    relay, attempts, sent = relay or TextRelay(), AttemptFilter(), ""
    for event in events:
        if not attempts.accepts(event):
            continue
        if event.type == "restart":
            relay.restart()
        elif event.type == "token":
            sent += relay.delta(event)
    return sent, relay


def lose_last_event(connection) -> None:
    """What an asynchronous failover does to a write the old primary acknowledged and never replicated."""
    last_id = connection.xrevrange(keys.stream_key(JOB), count=1)[0][0]
    connection.xdel(keys.stream_key(JOB), last_id)


def test_a_flush_after_lost_events_starts_the_stream_over_with_the_whole_text(writer):
    connection, w = writer
    w.token(EXECUTION, "Hel", [1, 2], 0)
    assert w.flush(force=True) == []
    w.token(EXECUTION, "lo", [3], 2)
    assert w.flush(force=True) == []
    early_reader = entries(connection)  # read before the failover: it saw "Hello"
    lose_last_event(connection)
    w.token(EXECUTION, " wor", [4, 5], 3)
    assert w.flush(force=True) == []  # the gap is found: nothing written, the job is not given up
    assert [e.text for _, e in entries(connection) if e.type == "token"] == ["Hel"]
    w.token(EXECUTION, "ld", [6], 5)
    assert w.flush(force=True) == []

    stream = entries(connection)
    assert [e.type for _, e in stream] == ["restart", "start", "token"]
    assert (stream[2][1].text, stream[2][1].token_ids, stream[2][1].index) == ("Hello world", [1, 2, 3, 4, 5, 6], 0)
    assert stream[0][0] > early_reader[-1][0]  # above every id written before: an XREAD position stays valid
    # a reader from the start, and one that had read the lost event and goes on from there
    assert relayed([e for _, e in stream])[0] == "Hello world"
    sent, relay = relayed([e for _, e in early_reader])
    more, _ = relayed([e for _, e in entries(connection, after=early_reader[-1][0])], relay)
    assert (sent, sent + more) == ("Hello", "Hello world")


def test_an_end_transaction_that_finds_lost_events_writes_the_stream_again_after_it(writer):
    connection, w = writer
    w.token(EXECUTION, "Hi", [7], 0)
    w.flush(force=True)
    lose_last_event(connection)
    w.token(EXECUTION, " there", [8], 1)
    w.end(EXECUTION, "finished", GenerationResult(text="Hi there", token_ids=[7, 8], finish_reason="length",
                                                  usage=Usage(prompt_tokens=1, completion_tokens=2)), None, 600)
    with connection.pipeline() as pipe:
        pipe.multi()
        w.write_with(pipe, EXECUTION)
        pipe.set("the-result", 1)  # the job's end is recorded even though the stream refused its events
        replies = pipe.execute()
    assert [e.type for _, e in entries(connection)] == ["start"]
    w.after_transaction(replies, [EXECUTION])

    stream = [e for _, e in entries(connection)]
    assert [e.type for e in stream] == ["restart", "start", "token", "done"]
    assert stream[2].text == "Hi there" and stream[3].finish_reason == "length"
    assert 0 < connection.ttl(keys.stream_key(JOB)) <= 600
    assert relayed(stream)[0] == "Hi there"


def test_an_intact_stream_is_written_on_without_a_restart(writer):
    connection, w = writer
    for i, piece in enumerate(["a", "b", "c"]):
        w.token(EXECUTION, piece, [i], i)
        w.flush(force=True)
    w.end(EXECUTION, "finished", GenerationResult(text="Hi", token_ids=[7], finish_reason="stop",
                                                  usage=Usage(prompt_tokens=1, completion_tokens=1)), None, 600)
    with connection.pipeline() as pipe:
        pipe.multi()
        w.write_with(pipe, EXECUTION)
        replies = pipe.execute()
    w.after_transaction(replies, [EXECUTION])
    assert [e.type for _, e in entries(connection)] == ["start", "token", "token", "token", "done"]
