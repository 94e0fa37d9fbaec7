"""Broken: a hidden input with an unknown value."""


class FixtureBadHidden:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "hidden": {"secret": "NOT_A_HIDDEN_VALUE"}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self, secret=None):
        return (1,)


NODE_CLASS_MAPPINGS = {"FixtureBadHidden": FixtureBadHidden}
