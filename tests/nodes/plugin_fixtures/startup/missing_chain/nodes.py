from comfy import samplers  # noqa: F401
from comfy_extras.nodes_images import SaveAnimatedWEBP  # noqa: F401

try:
    import weft_fixture_optional_extra  # noqa: F401  (optional: guarded, not reported)
except ImportError:
    weft_fixture_optional_extra = None


def later():
    import weft_fixture_imported_when_called  # noqa: F401  (not at import time: not reported)


NODE_CLASS_MAPPINGS = {}
