"""Nodes: NodeSpec, the registry, the plugin loader and the built-in node packs."""
import importlib

# Upper bound of every width/height widget. Custom-node packs written for ComfyUI import it from `nodes`.
MAX_RESOLUTION = 16384

# Built-in packs, registered in this order. Each module exposes NODES: a list of NodeSpec.
BUILTIN_PACKS = (
    "nodes.primitives",
    "nodes.image",
    "nodes.utility",
    "nodes.media",
    "nodes.audio_health",
    "nodes.loops",
    "nodes.loaders",
    "nodes.gguf_loaders",
    "nodes.latent",
    "nodes.conditioning",
    "nodes.sampling",
    "nodes.vae",
    "nodes.h3",
    "nodes.h3_control",
    "nodes.attention",
    "nodes.context_windows",
    "nodes.step_cache",
    "nodes.devices",
)


def builtin_packs():
    """Import and return the built-in node pack modules."""
    return [importlib.import_module(name) for name in BUILTIN_PACKS]


def __getattr__(name: str):
    # `from nodes import VAEEncode`: ComfyUI's classic class of that name, made from Weft's own node
    # (nodes/comfy_classes.py); any other missing name stays an AttributeError (an ImportError there).
    from nodes.comfy_classes import classic_class

    try:
        return classic_class(name)
    except AttributeError:
        raise AttributeError(f"module 'nodes' has no attribute {name!r}") from None
