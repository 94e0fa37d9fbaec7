"""Broken: registers FixtureShared, already taken by dup_a_first."""

class FixtureShared:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": 0, "max": 10})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "fixtures"

    def run(self, value):
        return (value * 5,)

NODE_CLASS_MAPPINGS = {"FixtureShared": FixtureShared}
