"""Broken: uses a part of ComfyUI's server that Weft does not provide (its user manager)."""
from server import PromptServer

PromptServer.instance.user_manager.get_request_user_id(None)
