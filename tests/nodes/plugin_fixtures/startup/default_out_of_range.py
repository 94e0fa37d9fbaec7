"""A default above its max: ComfyUI lists it (the editor clamps), so the node loads."""


class FixtureBadDefault:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"steps": ("INT", {"default": 500, "min": 1, "max": 100})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self, steps):
        return (steps,)


NODE_CLASS_MAPPINGS = {"FixtureBadDefault": FixtureBadDefault}
