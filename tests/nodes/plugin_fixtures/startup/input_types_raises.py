"""Broken: INPUT_TYPES raises while the node is declared."""


class FixtureInputTypesRaises:
    @classmethod
    def INPUT_TYPES(cls):
        raise RuntimeError("cannot list inputs")

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self):
        return (1,)


NODE_CLASS_MAPPINGS = {"FixtureInputTypesRaises": FixtureInputTypesRaises}
