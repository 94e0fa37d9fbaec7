"""Weft's example V3 node pack: the same kinds of node as `example_pack`, declared with ComfyUI's V3
node API (`comfy_api.latest`), which Weft provides in its compatibility layer.

A V3 pack exposes `comfy_entrypoint()`, returning a `ComfyExtension` whose `get_node_list()` names its
node classes. Each class states its node as data in `define_schema()` and does the work in the
classmethod `execute()`. The pack loads unchanged in ComfyUI.

Nodes (see nodes.py): ExampleV3InvertImage (pure), ExampleV3LazySwitch (lazy inputs: only the chosen
branch runs), ExampleV3PreviewImage (output node showing its images through `ui.PreviewImage`),
ExampleV3AdjustImage (a dynamic combo: each mode brings its own inputs), ExampleV3SumValues (an
auto-growing group of number sockets).
"""
from comfy_api.latest import ComfyExtension, io

from .nodes import NODES


class ExampleV3Extension(ComfyExtension):
    """This pack's extension: its node list."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> ExampleV3Extension:
    """What Weft (and ComfyUI) call to find this pack's nodes."""
    return ExampleV3Extension()
