"""Broken: uses a part of ComfyUI's server that Weft does not provide (its job queue)."""
from server import PromptServer

PromptServer.instance.prompt_queue.put(None)
