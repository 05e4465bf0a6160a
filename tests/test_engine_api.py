"""The engine's interface is written once (`EngineProtocol`): the real engine and the test fake both follow it."""

import inspect

import pytest

from rqbatcher.schema import GenerationRequest
from rqbatcher.workers.engine.api import EngineProtocol
from rqbatcher.workers.engine.engine import Engine
from tests.engine_helpers import engine_for
from tests.fake_engine import FakeEngine

METHODS = ["add", "step", "abort", "has_work", "stats"]
PROPERTIES = ["free_slots", "urgent_room", "fair_room", "batch_deficit"]


@pytest.mark.parametrize("impl", [Engine, FakeEngine])
def test_methods_and_properties_match_the_protocol(impl):
    for name in METHODS:
        expected = inspect.signature(getattr(EngineProtocol, name))
        assert inspect.signature(getattr(impl, name)) == expected, (impl.__name__, name)
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(impl, name), property), (impl.__name__, name)
    members = {n for n in vars(EngineProtocol) if not n.startswith("_")} | set(EngineProtocol.__annotations__)
    assert members == set(METHODS) | set(PROPERTIES) | {"loaded", "chat_format"}, "a new member: test it"


def test_instances_satisfy_the_protocol(tiny_model_dir):
    for engine in (engine_for(tiny_model_dir("llama"), dtype="float32"), FakeEngine()):
        assert isinstance(engine, EngineProtocol)
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.last_step) == (0, 0, None)
        assert stats.free_slots == engine.free_slots > 0 and stats.dtype == "float32"
        assert engine.add("r", GenerationRequest(prompt_token_ids=[5, 6, 7])) is None  # nothing live leaves the engine
        assert (engine.stats().num_running + engine.stats().num_waiting == 1
                and engine.free_slots == stats.free_slots - 1)
