"""Shared fixtures: a registry of the built-in nodes plus the testing node pack, and an executor."""
from __future__ import annotations

import importlib
import uuid

import pytest

from execution.cache import make_cache
from execution.paths import Paths
from execution.scheduler import Executor
from execution.validation import validate_prompt
from nodes.classic import specs_from_mappings
from nodes.registry import NodeRegistry, builtin_registry


def testing_registry(*, builtins: bool = True) -> NodeRegistry:
    """Built-in nodes plus tests/nodes_pack, registered the way a plugin is."""
    registry = builtin_registry() if builtins else NodeRegistry()
    pack = importlib.import_module("tests.nodes_pack")
    registry.register_all(
        specs_from_mappings(pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS, python_module="tests.nodes_pack"),
        origin="tests.nodes_pack",
    )
    return registry


@pytest.fixture(scope="session")
def registry() -> NodeRegistry:
    return testing_registry()


@pytest.fixture
def paths(tmp_path) -> Paths:
    return Paths(tmp_path).ensure()


class Runner:
    """Validates and runs API prompts on one executor (one cache across runs)."""

    def __init__(self, registry, paths, cache_kind="classic"):
        self.registry = registry
        self.executor = Executor(registry, cache=make_cache(cache_kind), paths=paths)

    def run(self, prompt, **kwargs):
        validated = validate_prompt(prompt, self.registry)
        return self.executor.run(validated, prompt_id=str(uuid.uuid4()), **kwargs)


@pytest.fixture
def runner(registry, paths) -> Runner:
    return Runner(registry, paths)
