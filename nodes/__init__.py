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
    "nodes.loops",
    "nodes.loaders",
    "nodes.latent",
    "nodes.conditioning",
    "nodes.sampling",
    "nodes.vae",
    "nodes.h3",
    "nodes.h3_control",
    "nodes.attention",
    "nodes.devices",
)


def builtin_packs():
    """Import and return the built-in node pack modules."""
    return [importlib.import_module(name) for name in BUILTIN_PACKS]
