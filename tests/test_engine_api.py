"""The engine's interface is written once (`EngineProtocol`): the real engine and the test fake both follow it."""

import inspect

import pytest

from tests.engine_helpers import engine_for
from tests.fake_engine import FakeEngine
from workers.engine import Engine
from workers.engine_api import EngineProtocol

METHODS = ["add", "step", "abort", "has_work"]
PROPERTIES = ["free_slots", "num_running", "num_waiting", "kv_cache_usage", "dtype", "prefix_cache_stats",
              "urgent_room", "batch_deficit", "urgency_preemptions"]


@pytest.mark.parametrize("impl", [Engine, FakeEngine])
def test_methods_and_properties_match_the_protocol(impl):
    for name in METHODS:
        expected = inspect.signature(getattr(EngineProtocol, name))
        assert inspect.signature(getattr(impl, name)) == expected, (impl.__name__, name)
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(impl, name), property), (impl.__name__, name)
    members = {n for n in vars(EngineProtocol) if not n.startswith("_")} | set(EngineProtocol.__annotations__)
    assert members == set(METHODS) | set(PROPERTIES) | {"loaded", "step_index", "last_step"}, "a new member: test it"


def test_instances_satisfy_the_protocol(tiny_model_dir):
    for engine in (engine_for(tiny_model_dir("llama"), dtype="float32"), FakeEngine()):
        assert isinstance(engine, EngineProtocol)
        assert (engine.num_running, engine.num_waiting, engine.step_index, engine.last_step) == (0, 0, 0, None)
