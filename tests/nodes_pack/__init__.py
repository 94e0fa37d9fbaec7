"""A small testing node pack in the classic ComfyUI interface, loaded like a plugin by the tests."""
import asyncio
import logging
import time

from execution.context import current
from execution.types import ExecutionBlocker


class TestConst:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0, "min": -(2**63), "max": 2**63 - 1})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value):
        return (value,)


class TestAdd:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"a": ("INT", {"forceInput": True}), "b": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, a, b):
        return (a + b,)


class TestMul:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"a": ("INT", {"forceInput": True}), "b": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, a, b):
        return ((a * b) % 1000003,)


class TestLazySelect:
    """Returns a if cond else b; only the chosen input is computed."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"cond": ("BOOLEAN", {"default": True}),
                             "a": ("INT", {"lazy": True, "forceInput": True}),
                             "b": ("INT", {"lazy": True, "forceInput": True})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def check_lazy_status(self, cond, a=None, b=None):
        return ["a"] if cond else ["b"]

    def run(self, cond, a=None, b=None):
        return (a if cond else b,)


class TestExpandAddChain:
    """Expands into `steps` TestAdd nodes that each add `increment`."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True}), "steps": ("INT", {"default": 2, "min": 1, "max": 50}),
                             "increment": ("INT", {"default": 1})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, steps, increment):
        graph = {"start": {"class_type": "TestConst", "inputs": {"value": value}}}
        previous = ["start", 0]
        for i in range(steps):
            graph[f"add{i}"] = {"class_type": "TestAdd", "inputs": {"a": previous, "b": increment}}
            previous = [f"add{i}", 0]
        return {"result": (previous,), "expand": graph}


class TestOutput:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("*", {})}, "optional": {"label": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, label=""):
        return {"ui": {"values": [value], "labels": [label]}}


class TestListSource:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"count": ("INT", {"default": 3, "min": 0, "max": 1000}), "start": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_IS_LIST = (True,)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, count, start):
        return (list(range(start, start + count)),)


class TestListSum:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"values": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)
    INPUT_IS_LIST = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, values):
        return (sum(values),)


class TestFail:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True}), "message": ("STRING", {"default": "boom"})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, message):
        # A log line from inside the node: the logs panel test follows it from the worker to the server.
        logging.getLogger("tests.nodes_pack").warning("TestFail is failing on purpose: %s", message)
        raise RuntimeError(message)


class TestSlow:
    """Sleeps in small steps, reporting progress (where interruption is checked)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True}), "seconds": ("FLOAT", {"default": 0.2})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, seconds):
        steps = 20
        for i in range(steps):
            time.sleep(seconds / steps)
            current().progress(i + 1, steps)
        return (value,)


class TestAsyncAdd:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"a": ("INT", {"forceInput": True}), "b": ("INT", {"default": 1})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    async def run(self, a, b):
        await asyncio.sleep(0)
        return (a + b,)


class TestBlock:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True}), "block": ("BOOLEAN", {"default": True}),
                             "message": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, block, message):
        return (ExecutionBlocker(message or None) if block else value,)


class TestAlwaysChanged:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def IS_CHANGED(cls, value):
        return float("nan")

    def run(self, value):
        return (value,)


class TestNotIdempotent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    NOT_IDEMPOTENT = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value):
        return (value,)


class TestValidated:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def VALIDATE_INPUTS(cls, value):
        return True if value % 2 == 0 else f"value must be even, got {value}"

    def run(self, value):
        return (value,)


class TestRecord:
    """An output node with an output: records each value it sees (in order) and passes it on."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("*", {})}, "optional": {"label": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("*",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, label=""):
        return {"ui": {"values": [value], "labels": [label]}, "result": (value,)}


class TestMixedList:
    """A list output mixing images ([B, H, W, C] tensors) and strings."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"default": 2, "min": 1, "max": 64})}}

    RETURN_TYPES = ("*",)
    OUTPUT_IS_LIST = (True,)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, size):
        import torch

        first = torch.arange(size * size * 3, dtype=torch.float32).reshape(1, size, size, 3) / (size * size * 3)
        return ([first, "a caption", torch.ones(2, size + 1, size, 3) * 0.25],)


class TestTag:
    """Joins a tag and any value into a string: `tag:value`."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("*", {}), "tag": ("STRING", {"default": "t"})}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, tag):
        return (f"{tag}:{value}",)


class TestGraphSize:
    """How many nodes the live graph holds when this node runs (for bounded-memory checks)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("*", {})}, "hidden": {"dynprompt": "DYNPROMPT"}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, dynprompt=None):
        return (len(dynprompt.all_node_ids()),)


class TestBoolList:
    """A list of booleans from "1,0,1"."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"bits": ("STRING", {"default": "1,0"})}}

    RETURN_TYPES = ("BOOLEAN",)
    OUTPUT_IS_LIST = (True,)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, bits):
        return ([bit.strip() == "1" for bit in bits.split(",")],)


class TestBlockOdd:
    """Blocks odd values, passes even ones (mapped over a list, it blocks item by item)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True})}}

    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value):
        return (ExecutionBlocker(None) if value % 2 else value,)


class TestRawLink:
    """Reports the link its `source` input arrives as, and the class of the node it names."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"source": ("INT", {"rawLink": True, "forceInput": True})},
                "hidden": {"dynprompt": "DYNPROMPT"}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, source, dynprompt=None):
        return (f"{source[0]}:{source[1]}:{dynprompt.get_node(source[0])['class_type']}",)


NODE_CLASS_MAPPINGS = {cls.__name__: cls for cls in (
    TestConst, TestAdd, TestMul, TestLazySelect, TestExpandAddChain, TestOutput, TestListSource, TestListSum,
    TestFail, TestSlow, TestAsyncAdd, TestBlock, TestAlwaysChanged, TestNotIdempotent, TestValidated,
    TestRecord, TestMixedList, TestTag, TestGraphSize, TestBoolList, TestBlockOdd, TestRawLink,
)}
NODE_DISPLAY_NAME_MAPPINGS = {"TestOutput": "Test Output"}
