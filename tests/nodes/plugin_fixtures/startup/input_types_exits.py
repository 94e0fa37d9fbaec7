"""Broken: INPUT_TYPES calls sys.exit while the node is declared."""
import sys


class FixtureInputTypesExits:
    @classmethod
    def INPUT_TYPES(cls):
        sys.exit(2)

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self):
        return (1,)


NODE_CLASS_MAPPINGS = {"FixtureInputTypesExits": FixtureInputTypesExits}
