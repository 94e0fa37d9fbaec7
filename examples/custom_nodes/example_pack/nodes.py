"""Classic ComfyUI node classes: INPUT_TYPES, RETURN_TYPES, FUNCTION and friends.

Weft adapts each class into its NodeSpec at start-up (INPUT_TYPES is read once, then). The helpers
imported below (`folder_paths`, `comfy.utils`) come from Weft's compatibility layer, which provides a
few ComfyUI helper modules; see docs/custom-nodes.md for the list.
"""
import os

import numpy as np
from PIL import Image

import comfy.utils
import folder_paths


class ExampleInvertImage:
    """A pure node: the output depends only on the inputs, so Weft caches it."""

    DESCRIPTION = "Inverts the colours of an image (1 - value), leaving alpha alone."
    CATEGORY = "example"
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The inverted image.",)
    FUNCTION = "invert"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE", {"tooltip": "The image to invert."})}}

    def invert(self, image):
        inverted = image.clone()
        inverted[..., :3] = 1.0 - image[..., :3]
        return (inverted,)


class ExampleLazySwitch:
    """Lazy inputs: `check_lazy_status` says which inputs are needed, so the other branch never runs."""

    DESCRIPTION = "Passes one of two images through; only the chosen one is computed."
    CATEGORY = "example"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "switch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "use_first": ("BOOLEAN", {"default": True, "tooltip": "Pass `first` (true) or `second` (false)."}),
            "first": ("IMAGE", {"lazy": True}),
            "second": ("IMAGE", {"lazy": True}),
        }}

    def check_lazy_status(self, use_first, first=None, second=None):
        # Called before the lazy inputs are computed; returns the names still needed.
        wanted = "first" if use_first else "second"
        return [wanted] if (first if use_first else second) is None else []

    def switch(self, use_first, first=None, second=None):
        return (first if use_first else second,)


class ExampleSplitText:
    """A list output: OUTPUT_IS_LIST makes each item flow on separately (downstream nodes run per item)."""

    DESCRIPTION = "Splits a text at a separator into a list of strings (empty pieces dropped)."
    CATEGORY = "example"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("pieces",)
    OUTPUT_IS_LIST = (True,)
    FUNCTION = "split"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text": ("STRING", {"default": "a,b,c", "multiline": True}),
            "separator": ("STRING", {"default": ","}),
        }}

    def split(self, text, separator):
        if not separator:
            raise ValueError("ExampleSplitText: separator must not be empty")
        return ([piece.strip() for piece in text.split(separator) if piece.strip()],)


class ExampleJoinText:
    """INPUT_IS_LIST: the node receives whole lists at once instead of running once per item."""

    DESCRIPTION = "Joins a list of strings into one text, showing it on the node."
    CATEGORY = "example"
    RETURN_TYPES = ("STRING",)
    INPUT_IS_LIST = True
    FUNCTION = "join"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "pieces": ("STRING", {"forceInput": True}),
            "separator": ("STRING", {"default": " + "}),
        }}

    def join(self, pieces, separator):
        joined = separator[0].join(pieces)  # every input arrives as a list, widgets included
        return {"ui": {"text": [joined]}, "result": (joined,)}


class ExamplePreviewImage:
    """An output node with a preview: writes PNGs to the temp folder and returns them for the editor."""

    DESCRIPTION = "Shows images on the node (written to the temp folder), reporting progress per image."
    CATEGORY = "example"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "preview"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",)}}

    def preview(self, images):
        folder, stem, counter, subfolder, _ = folder_paths.get_save_image_path(
            "example_preview", folder_paths.get_temp_directory(), images.shape[2], images.shape[1])
        progress = comfy.utils.ProgressBar(images.shape[0])
        results = []
        for frame in images:
            array = np.clip(frame.cpu().numpy() * 255.0, 0, 255).astype(np.uint8)
            name = f"{stem}_{counter:05}_.png"
            Image.fromarray(array).save(os.path.join(folder, name), compress_level=1)
            results.append({"filename": name, "subfolder": subfolder, "type": "temp"})
            counter += 1
            progress.update(1)
        return {"ui": {"images": results}}


NODE_CLASS_MAPPINGS = {
    "ExampleInvertImage": ExampleInvertImage,
    "ExampleLazySwitch": ExampleLazySwitch,
    "ExampleSplitText": ExampleSplitText,
    "ExampleJoinText": ExampleJoinText,
    "ExamplePreviewImage": ExamplePreviewImage,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "ExampleInvertImage": "Invert Image (example)",
    "ExampleLazySwitch": "Lazy Switch (example)",
    "ExampleSplitText": "Split Text (example)",
    "ExampleJoinText": "Join Text (example)",
    "ExamplePreviewImage": "Preview Image (example)",
}
