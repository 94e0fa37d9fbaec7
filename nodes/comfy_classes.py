"""ComfyUI's classic node classes by name, for packs that `from nodes import VAEEncode` and call them.

ComfyUI's `nodes.py` holds its core nodes as classes, and packs reuse them from their own code
(`VAEEncode().encode(vae, pixels)`). Weft's `nodes` is its own package; for the node ids listed in
`CLASSIC_CALLS` it answers such an import with a class made from Weft's own built-in node of that id: the
classic attributes (INPUT_TYPES, RETURN_TYPES, FUNCTION, ...) and the method ComfyUI names, taking
ComfyUI's parameters in ComfyUI's order and returning the node's output tuple. The call runs Weft's
node, inside the run context of whatever node is calling it.
"""
from __future__ import annotations

from typing import Any

from execution.spec import NodeSpec
from execution.types import normalize_result

# node id -> (the method ComfyUI's class calls, its parameters in ComfyUI's order)
CLASSIC_CALLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "VAEEncode": ("encode", ("vae", "pixels")),
    "VAEDecode": ("decode", ("vae", "samples")),
    "VAEDecodeTiled": ("decode", ("vae", "samples", "tile_size", "overlap", "temporal_size", "temporal_overlap")),
    "LoadImage": ("load_image", ("image",)),
    "SaveImage": ("save_images", ("images", "filename_prefix", "prompt", "extra_pnginfo")),
    "PreviewImage": ("save_images", ("images", "filename_prefix", "prompt", "extra_pnginfo")),
    "CLIPTextEncode": ("encode", ("clip", "text")),
    "ImageScale": ("upscale", ("image", "upscale_method", "width", "height", "crop")),
    "EmptyLatentImage": ("generate", ("width", "height", "batch_size")),
}
_MADE: dict[str, type] = {}


def classic_class(name: str) -> type:
    """The classic class standing for Weft's built-in node `name` (AttributeError when there is none)."""
    if name in _MADE:
        return _MADE[name]
    if name not in CLASSIC_CALLS:
        raise AttributeError(name)
    spec = _builtin_spec(name)
    if spec is None:
        raise AttributeError(name)
    made = _MADE[name] = _make(spec, *CLASSIC_CALLS[name])
    return made


def _builtin_spec(node_id: str) -> NodeSpec | None:
    from nodes import builtin_packs

    for module in builtin_packs():
        for spec in module.NODES:
            if spec.node_id == node_id:
                return spec
    return None


def _input_types(spec: NodeSpec) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {"required": {}, "optional": {}, "hidden": {}}
    for inp in spec.inputs:
        if inp.kind == "hidden":
            sections["hidden"][inp.name] = inp.type
        elif inp.type == "COMBO":
            sections[inp.kind][inp.name] = (inp.choice_list(), dict(inp.options))
        else:
            sections[inp.kind][inp.name] = (inp.type, dict(inp.options))
    return {kind: section for kind, section in sections.items() if section or kind == "required"}


def _make(spec: NodeSpec, function: str, parameters: tuple[str, ...]) -> type:
    def call(self, *args: Any, **kwargs: Any) -> tuple:
        if len(args) > len(parameters):
            raise TypeError(f"{spec.node_id}.{function}() takes {len(parameters)} arguments, got {len(args)}")
        named = dict(zip(parameters, args))
        named.update(kwargs)
        for inp in spec.inputs:
            if inp.name not in named:
                if "default" in inp.options:
                    named[inp.name] = inp.options["default"]
                elif inp.kind != "required":
                    named[inp.name] = None
        accepted = {inp.name for inp in spec.inputs}
        result = spec.execute(**{key: value for key, value in named.items() if key in accepted})
        output = normalize_result(spec, result)
        if output.ui:
            return {"ui": output.ui, "result": tuple(output.values)}
        return tuple(output.values)

    call.__name__ = function
    return type(spec.node_id, (), {
        "__doc__": f"Weft's built-in node {spec.node_id} as ComfyUI's classic class (call {function}()).",
        "__module__": "nodes",
        "INPUT_TYPES": classmethod(lambda cls: _input_types(spec)),
        "RETURN_TYPES": tuple(o.type for o in spec.outputs),
        "RETURN_NAMES": tuple(o.name for o in spec.outputs),
        "FUNCTION": function,
        "CATEGORY": spec.category,
        "OUTPUT_NODE": spec.output_node,
        "DESCRIPTION": spec.description,
        function: call,
    })
