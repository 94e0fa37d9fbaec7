"""Structured prompt errors in ComfyUI's JSON shape, shared by the server, the CLI and the editor."""
from __future__ import annotations

from typing import Any


def node_error(type: str, message: str, details: str = "", *, input_name: str | None = None,
               input_config: Any = None, received_value: Any = None) -> dict[str, Any]:
    """One entry of `node_errors[id].errors`."""
    extra: dict[str, Any] = {}
    if input_name is not None:
        extra = {"input_name": input_name, "input_config": input_config, "received_value": _jsonable(received_value)}
    return {"type": type, "message": message, "details": details, "extra_info": extra}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value][:50]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in list(value.items())[:50]}
    return repr(value)[:200]


class PromptError(ValueError):
    """A prompt (or workflow) that cannot run, with ComfyUI's `{error, node_errors}` body."""

    def __init__(self, type: str, message: str, details: str = "", *, extra_info: dict | None = None,
                 node_errors: dict[str, dict] | None = None):
        super().__init__(f"{message}: {details}" if details else message)
        self.type = type
        self.message = message
        self.details = details
        self.extra_info = extra_info or {}
        self.node_errors = node_errors or {}

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {"type": self.type, "message": self.message, "details": self.details,
                      "extra_info": self.extra_info},
            "node_errors": self.node_errors,
        }
