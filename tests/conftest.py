"""Shared fixtures: a registry of the built-in nodes plus the testing node pack, and an executor."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from execution.cache import make_cache
from execution.paths import Paths
from execution.scheduler import Executor
from execution.validation import ValidationMemo, validate_prompt
from nodes.plugins import load_plugin
from nodes.registry import NodeRegistry, builtin_registry


def testing_registry(*, builtins: bool = True) -> NodeRegistry:
    """Built-in nodes plus tests/nodes_pack, loaded by the plugin loader (as custom_nodes.nodes_pack)."""
    registry = builtin_registry() if builtins else NodeRegistry()
    report = load_plugin(registry, Path(__file__).resolve().parent / "nodes_pack")
    if report.status != "loaded":
        raise RuntimeError(f"the testing node pack did not load: {report.reason}")
    return registry


@pytest.fixture(scope="session")
def registry() -> NodeRegistry:
    return testing_registry()


@pytest.fixture
def paths(tmp_path) -> Paths:
    return Paths(tmp_path).ensure()


class Runner:
    """Validates and runs API prompts on one executor (one cache and one validation memo across
    runs, as the server holds them)."""

    def __init__(self, registry, paths, cache_kind="classic"):
        self.registry = registry
        self.executor = Executor(registry, cache=make_cache(cache_kind), paths=paths)
        self.memo = ValidationMemo()

    def run(self, prompt, **kwargs):
        validated = validate_prompt(prompt, self.registry, memo=self.memo)
        return self.executor.run(validated, prompt_id=str(uuid.uuid4()), **kwargs)


@pytest.fixture
def runner(registry, paths) -> Runner:
    return Runner(registry, paths)
