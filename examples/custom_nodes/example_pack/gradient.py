"""A node declared as data (Weft's NodeSpec): a horizontal two-colour gradient image."""
import torch

from nodes.spec import Input, NodeSpec, Output


def _hex_rgb(color: int) -> torch.Tensor:
    return torch.tensor([(color >> 16) & 0xFF, (color >> 8) & 0xFF, color & 0xFF], dtype=torch.float32) / 255.0


def gradient(width: int, height: int, left: int, right: int, batch_size: int = 1) -> tuple[torch.Tensor]:
    """An IMAGE (B, H, W, 3) going from colour `left` to colour `right` across its width."""
    ramp = torch.linspace(0.0, 1.0, width).view(1, width, 1)  # (1, W, 1)
    row = _hex_rgb(left) * (1.0 - ramp) + _hex_rgb(right) * ramp  # (1, W, 3)
    return (row.expand(batch_size, height, width, 3).contiguous(),)


def gradient_node() -> NodeSpec:
    """The ExampleGradient node."""
    return NodeSpec(
        node_id="ExampleGradient", display_name="Gradient (example)", category="example",
        description="A horizontal gradient between two colours: a source image that needs no files.",
        inputs=[
            Input.int("width", 64, min=1, max=4096, tooltip="Image width in pixels."),
            Input.int("height", 64, min=1, max=4096, tooltip="Image height in pixels."),
            Input.int("left", 0x000000, min=0, max=0xFFFFFF, tooltip="Colour at the left edge."),
            Input.int("right", 0xFFFFFF, min=0, max=0xFFFFFF, tooltip="Colour at the right edge."),
            Input.int("batch_size", 1, min=1, max=64, tooltip="How many identical images."),
        ],
        outputs=[Output("IMAGE", tooltip="The gradient, values in 0..1.")],
        execute=gradient,
    )
