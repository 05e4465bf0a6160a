"""Every CLI command turns an expected fault into one line on stderr and a non-zero exit: Redis unreachable or
refusing us, a model that cannot load, a bad input file, an unknown job. `--debug` shows the traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rqbatcher.cli import main
from tests.reliability.support import RedisServer, free_port

UNKNOWN_JOB = "no-such-job"
NO_MODEL = "/nonexistent/model"
# (command, fault) pairs that are not faults for that command: a worker waits for an unreachable Redis (it may
# start before Redis does; tests/reliability/test_redis_restart.py covers it).
WAITS = {("worker", "unreachable")}


@pytest.fixture(scope="module")
def refusing_redis(tmp_path_factory):
    """A Redis that wants a password we do not give."""
    server = RedisServer(tmp_path_factory.mktemp("auth"), "--requirepass", "s3cret", password="s3cret").start()
    yield f"redis://127.0.0.1:{server.port}/0"
    server.stop()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("inputs")
    (d / "binary.jsonl").write_bytes(b"\xff\xfe\x00binary\x80\x81")
    (d / "bad-workload.jsonl").write_text('{"id": "r0", "prompt_len": "many"}\n')
    (d / "good.jsonl").write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    return {"dir": d, "model": str(tiny_model_dir("llama"))}


def redis_commands(url: str, files: dict) -> dict[str, list[str]]:
    r = ["--redis-url", url]
    return {
        "submit": ["submit", *r, "hi"],
        "submit --file": ["submit", *r, "--file", str(files["dir"] / "good.jsonl")],
        "tail": ["tail", *r, UNKNOWN_JOB],
        "status": ["status", *r, UNKNOWN_JOB],
        "cancel": ["cancel", *r, UNKNOWN_JOB],
        "workers": ["workers", *r],
        "drain": ["drain", *r, "--all"],
        "suspend": ["suspend", *r],
        "resume": ["resume", *r],
        "queues": ["queues", *r],
        "requeue": ["requeue", *r, "--failed"],
        "worker": ["worker", *r, "--model", files["model"], "--device", "cpu", "--burst"],
        "demo": ["demo", *r, "--model", files["model"], "--no-compare"],
        "bench": ["bench", *r, "--model", files["model"], "--workload", "skew-small", "--systems",
                  "batcher:continuous@redis"],
    }


def assert_one_line_error(result, *expected: str) -> None:
    assert result.exit_code not in (0, None), result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output, result.output
    assert len([line for line in lines if not line.startswith(("Loading weights", "\r"))]) == 1, result.stderr
    for text in expected:
        assert text in lines[-1], lines[-1]


@pytest.mark.parametrize("fault", ["unreachable", "refusing"])
@pytest.mark.parametrize("command", [
    "submit", "submit --file", "tail", "status", "cancel", "workers", "drain", "suspend", "resume", "queues",
    "requeue", "worker", "demo", "bench"])
def test_a_redis_fault_is_one_line(command, fault, refusing_redis, files):
    if (command, fault) in WAITS:
        pytest.skip("a worker waits for an unreachable Redis, by design")
    url = refusing_redis if fault == "refusing" else f"redis://127.0.0.1:{free_port()}/0"
    result = CliRunner().invoke(main, redis_commands(url, files)[command])
    assert_one_line_error(result, "Redis refused" if fault == "refusing" else "cannot reach Redis")


@pytest.mark.parametrize("args", [
    ["run", "--model", NO_MODEL, "--input", "{good}", "--output", "{dir}/out.jsonl"],
    ["worker", "--model", NO_MODEL, "--redis-url", "{url}"],
    ["bench", "--model", NO_MODEL, "--workload", "skew-small"],
    ["demo", "--model", NO_MODEL],
], ids=["run", "worker", "bench", "demo"])
def test_a_model_that_cannot_load_is_one_line(args, files, redis_url):
    values = {"good": files["dir"] / "good.jsonl", "dir": files["dir"], "url": redis_url}
    result = CliRunner().invoke(main, [a.format(**values) for a in args])
    assert_one_line_error(result, "cannot load model", NO_MODEL)


@pytest.mark.parametrize("args, expected", [
    (["run", "--model", "{model}", "--input", "{dir}/binary.jsonl", "--output", "{dir}/out.jsonl"], "not UTF-8"),
    (["submit", "--redis-url", "{url}", "--file", "{dir}/binary.jsonl"], "not UTF-8"),
    (["bench", "--model", "{model}", "--workload", "{dir}/bad-workload.jsonl"], "is not a workload request"),
    (["bench", "--model", "{model}", "--workload", "no-such-workload"], "no workload file"),
], ids=["run", "submit", "bench-bad-line", "bench-missing"])
def test_a_bad_input_file_is_one_line(args, expected, files, redis_url):
    values = {"dir": files["dir"], "model": files["model"], "url": redis_url}
    result = CliRunner().invoke(main, [a.format(**values) for a in args])
    assert_one_line_error(result, expected)


@pytest.mark.parametrize("command", ["status", "cancel", "tail"])
@pytest.mark.parametrize("job_id, expected", [(UNKNOWN_JOB, "no job"), ("a:b", "a job id has only")])
def test_an_unknown_or_malformed_job_id_is_one_line(command, job_id, expected, redis_url):
    result = CliRunner().invoke(main, [command, "--redis-url", redis_url, job_id])
    assert result.exit_code != 0 and expected in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(redis_url):
    url = f"redis://127.0.0.1:{free_port()}/0"
    quiet = CliRunner().invoke(main, ["queues", "--redis-url", url])
    assert_one_line_error(quiet, "cannot reach Redis")
    for invocation in (["--debug", "queues", "--redis-url", url], ["queues", "--redis-url", url]):
        loud = CliRunner(env={"BATCHER_DEBUG": "1"} if "--debug" not in invocation else {}).invoke(main, invocation)
        assert loud.exit_code != 0 and type(loud.exception).__name__ == "ConnectionError"
