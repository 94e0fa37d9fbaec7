"""V3 node classes: `define_schema()` declares the node, the classmethod `execute()` runs it."""
import torch

from comfy_api.latest import io, ui


class ExampleV3InvertImage(io.ComfyNode):
    """A pure node: the output depends only on the inputs, so it is cached."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ExampleV3InvertImage", display_name="Invert Image (V3 example)", category="example",
            description="Inverts the colours of an image (1 - value), leaving alpha alone.",
            inputs=[io.Image.Input("image", tooltip="The image to invert.")],
            outputs=[io.Image.Output(tooltip="The inverted image.")],
        )

    @classmethod
    def execute(cls, image: torch.Tensor) -> io.NodeOutput:
        inverted = image.clone()
        inverted[..., :3] = 1.0 - image[..., :3]
        return io.NodeOutput(inverted)


class ExampleV3LazySwitch(io.ComfyNode):
    """Lazy inputs: `check_lazy_status` names the inputs still needed, so the other branch never runs."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ExampleV3LazySwitch", display_name="Lazy Switch (V3 example)", category="example",
            description="Passes one of two images through; only the chosen one is computed.",
            inputs=[
                io.Boolean.Input("use_first", default=True, tooltip="Pass `first` (true) or `second` (false)."),
                io.Image.Input("first", lazy=True),
                io.Image.Input("second", lazy=True),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def check_lazy_status(cls, use_first: bool, first=None, second=None) -> list[str]:
        # Called before the lazy inputs are computed (they arrive as None); returns the names still needed.
        wanted = "first" if use_first else "second"
        return [wanted] if (first if use_first else second) is None else []

    @classmethod
    def execute(cls, use_first: bool, first=None, second=None) -> io.NodeOutput:
        return io.NodeOutput(first if use_first else second)


class ExampleV3PreviewImage(io.ComfyNode):
    """An output node: `ui.PreviewImage` writes the images to the temp folder and shows them on the node."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ExampleV3PreviewImage", display_name="Preview Image (V3 example)", category="example",
            description="Shows images on the node; the files go to the temporary folder.",
            inputs=[io.Image.Input("images")],
            is_output_node=True,  # also asks for the prompt and workflow, stored in the written files
        )

    @classmethod
    def execute(cls, images: torch.Tensor) -> io.NodeOutput:
        return io.NodeOutput(ui=ui.PreviewImage(images, cls=cls))


class ExampleV3AdjustImage(io.ComfyNode):
    """A dynamic combo: the chosen mode brings its own inputs, and `execute` gets them grouped."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ExampleV3AdjustImage", display_name="Adjust Image (V3 example)", category="example",
            description="Scales the brightness of an image, or turns it into black and white at a threshold.",
            inputs=[
                io.Image.Input("image"),
                io.DynamicCombo.Input("mode", tooltip="What to do to the image.", options=[
                    io.DynamicCombo.Option("brightness", [
                        io.Float.Input("factor", default=1.0, min=0.0, max=4.0, step=0.05,
                                       tooltip="Multiplies every colour value."),
                    ]),
                    io.DynamicCombo.Option("threshold", [
                        io.Float.Input("level", default=0.5, min=0.0, max=1.0, step=0.01,
                                       tooltip="Values above it become white, the rest black."),
                    ]),
                ]),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def execute(cls, image: torch.Tensor, mode: dict) -> io.NodeOutput:
        # mode = {"mode": the chosen key, <that option's inputs>: values}
        if mode["mode"] == "brightness":
            return io.NodeOutput((image * mode["factor"]).clamp(0.0, 1.0))
        return io.NodeOutput((image > mode["level"]).to(image.dtype))


class ExampleV3SumValues(io.ComfyNode):
    """An auto-growing group: linking the last `value` socket adds another; `execute` gets the linked ones."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ExampleV3SumValues", display_name="Sum Values (V3 example)", category="example",
            description="Adds up the numbers linked to it.",
            inputs=[io.Autogrow.Input("values", template=io.Autogrow.TemplatePrefix(
                io.Float.Input("value", tooltip="A number to add."), prefix="value", min=1, max=8))],
            outputs=[io.Float.Output("sum")],
        )

    @classmethod
    def execute(cls, values: dict) -> io.NodeOutput:
        # values = {"value0": ..., "value1": ...}, the linked slots in order
        return io.NodeOutput(float(sum(values.values())))


NODES = [ExampleV3InvertImage, ExampleV3LazySwitch, ExampleV3PreviewImage, ExampleV3AdjustImage,
         ExampleV3SumValues]
