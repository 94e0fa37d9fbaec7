"""Weft's example custom-node pack: a documented template for plugin authors.

Weft imports every package and `.py` module in `custom_nodes/` as `custom_nodes.<name>` at start-up.
This pack shows both ways to declare nodes:

- `NODE_CLASS_MAPPINGS` / `NODE_DISPLAY_NAME_MAPPINGS`: classic ComfyUI node classes (see nodes.py).
  They also load unchanged in ComfyUI.
- `weft_nodes()`: Weft's entry function, returning a list of `NodeSpec` (see gradient.py). It imports
  Weft only when called, so ComfyUI (which never calls it) still imports this pack.

`WEB_DIRECTORY` names the folder (inside this pack) whose `.js` files the editor loads, served at
`/extensions/example_pack/...`.

Nodes: ExampleGradient (data-declared source), ExampleInvertImage (pure), ExampleLazySwitch (lazy
inputs: only the chosen branch runs), ExampleSplitText (list output), ExampleJoinText (takes the whole
list at once), ExamplePreviewImage (output node writing previews with the compatibility layer's
folder_paths and comfy.utils.ProgressBar).
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"


def weft_nodes():
    """Weft's entry function: this pack's data-declared nodes."""
    from .gradient import gradient_node

    return [gradient_node()]


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", "weft_nodes"]
