"""A hidden input of no hidden value: an ordinary input the editor does not show, so the node loads."""


class FixtureBadHidden:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}, "hidden": {"secret": "NOT_A_HIDDEN_VALUE"}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"

    def run(self, secret=None):
        return (1,)


NODE_CLASS_MAPPINGS = {"FixtureBadHidden": FixtureBadHidden}
