"""Broken: WEB_DIRECTORY points outside the plugin's folder."""

class FixtureEscape:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": 0, "max": 10})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "fixtures"

    def run(self, value):
        return (value * 2,)

NODE_CLASS_MAPPINGS = {"FixtureEscape": FixtureEscape}
WEB_DIRECTORY = "../../.."
