"""Broken: FUNCTION names no method."""


class FixtureNoFunction:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "execute"


NODE_CLASS_MAPPINGS = {"FixtureNoFunction": FixtureNoFunction}
