"""Tiny H3 weights written once per test session, and the loaded tiny models."""
from __future__ import annotations

import pytest

from models.h3.make_tiny import write_tiny
from models.loading import load_model


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory):
    """{kind: path} of the four tiny model files."""
    return write_tiny(tmp_path_factory.mktemp("h3_models"))


@pytest.fixture(scope="session")
def tiny(tiny_paths):
    """{kind: loaded module} of the four tiny models."""
    return {kind: load_model(path).model for kind, path in tiny_paths.items()}
