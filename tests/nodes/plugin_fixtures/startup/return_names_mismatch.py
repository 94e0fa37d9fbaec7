"""Broken: two RETURN_NAMES for one RETURN_TYPES."""


class FixtureNames:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("INT",)
    RETURN_NAMES = ("a", "b")
    FUNCTION = "run"

    def run(self):
        return (1,)


NODE_CLASS_MAPPINGS = {"FixtureNames": FixtureNames}
