import pytest


def pytest_collection_modifyitems(config, items):
    """The long variants (`@pytest.mark.slow`) run only when asked for: `pytest -m slow`."""
    if config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason="a long variant: run it with `pytest -m slow`")
    for item in items:
        if "slow" in item.keywords and "tests/reliability" in str(item.path):
            item.add_marker(skip)


@pytest.fixture(scope="package")
def shared_worker(tiny_model_dir, tmp_path_factory):
    """One real worker process (poisoned model, context capped at 96 tokens) on a Redis of its own, for the
    bad-input, poison and security tests: a SimpleNamespace(server, connection, url, name, process, log,
    model_dir, queue)."""
    from types import SimpleNamespace

    from tests.reliability.support import RedisServer, start_worker, stop, wait_ready

    model_dir = tiny_model_dir("llama")
    directory = tmp_path_factory.mktemp("shared")
    server = RedisServer(directory / "redis").start()
    log = directory / "worker.log"
    name, process = start_worker(server.url, model_dir, "shared", log, max_num_seqs=16, num_blocks=256,
                                 extra=("--max-model-len", "96"), module="tests.reliability.poison_worker")
    try:
        wait_ready(server.connection(), name, process)
        yield SimpleNamespace(server=server, connection=server.connection(), url=server.url, name=name,
                              process=process, log=log, model_dir=model_dir, queue="shared")
    finally:
        stop(process)
        server.stop()
