"""Half broken: the first node is fine, the second names no method; the first loads, the second is refused."""

class FixturePartialGood:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": 0, "max": 10})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "fixtures"

    def run(self, value):
        return (value * 2,)


class FixturePartialBad:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"x": ("FLOAT", {"default": 2.0, "min": 5.0})}}

    RETURN_TYPES = ("FLOAT",)
    FUNCTION = "not_a_method"

    def run(self, x):
        return (x,)


NODE_CLASS_MAPPINGS = {"FixturePartialGood": FixturePartialGood, "FixturePartialBad": FixturePartialBad}
