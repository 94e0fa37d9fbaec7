"""Services (execution/context.py): what the node calls of one runtime share."""
from __future__ import annotations

import pytest

from execution.context import DEFAULT_MAX_LOOP_ITERATIONS, RunContext, Services
from execution.paths import Paths


def test_shared_objects_are_made_once_per_runtime():
    services = Services(max_loop_iterations=5)
    made = []

    def make():
        made.append(object())
        return made[-1]

    first = services.shared("model_cache", make)
    assert services.shared("model_cache", make) is first and len(made) == 1
    assert Services().shared("model_cache", make) is not first  # another runtime, another object
    assert services.max_loop_iterations == 5 and Services().max_loop_iterations == DEFAULT_MAX_LOOP_ITERATIONS


def test_settings_are_declared_and_shared_objects_are_released_together():
    services = Services(max_loop_iterations=3, preview_size=256)
    assert (services.max_loop_iterations, services.preview_size) == (3, 256)
    cache = services.shared("model_cache", dict)
    cache["kept"] = 1
    assert services.shared("model_cache", dict) is cache
    services.release_shared()
    assert services.shared("model_cache", dict) == {}
    with pytest.raises(AttributeError):
        services.anything_else = 1  # settings are declared, not added on the fly
    assert not hasattr(services, "get")  # one way in: a declared setting or a named shared object


def test_a_node_call_without_services_gets_its_own(tmp_path):
    context = RunContext(prompt_id="p", node_id="1", display_node_id="1", paths=Paths(tmp_path))
    assert isinstance(context.runtime, Services)
