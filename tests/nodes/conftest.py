"""Fixtures for calling node specs directly: a RunContext rooted in the test's tmp folder."""
from __future__ import annotations

import pytest

from execution.context import SHOWN_KEY, RunContext, activate, deactivate
from execution.paths import Paths


def unfolded(event: str, data: dict) -> list[tuple[str, dict]]:
    """One emitted event as the executor sends it on: a progress event's text and preview first."""
    return [*data.pop(SHOWN_KEY, ()), (event, data)]


@pytest.fixture
def events():
    """Events the `ctx` context emitted, as (event, data) pairs."""
    return []


@pytest.fixture
def ctx(tmp_path, events):
    """A RunContext rooted in tmp_path that records emitted events."""
    context = RunContext(prompt_id="job", node_id="7", display_node_id="7", paths=Paths(tmp_path).ensure(),
                         emit=lambda event, data: events.extend(unfolded(event, data)))
    token = activate(context)
    yield context
    deactivate(token)
