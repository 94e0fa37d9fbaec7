"""Broken: INPUT_TYPES returns a list."""


class FixtureInputTypesList:
    @classmethod
    def INPUT_TYPES(cls):
        return ["value"]

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self, value):
        return (value,)


NODE_CLASS_MAPPINGS = {"FixtureInputTypesList": FixtureInputTypesList}
