"""Start Weft's server for tests: the real server with the testing node pack (and a few web-only nodes).

    python -m tests.web.serve [server flags] [--light]

`--light` leaves out the built-in node packs (and with them torch), so a server process starts in
well under a second: the durability test restarts it twenty times.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

import main as weft_main
from execution import context as run_context
from execution.context import current
from execution.events import EventBus
from execution.scheduler import Executor
from execution.validation import ValidationMemo
from nodes.classic import specs_from_mappings


class WebTestPreviews:
    """Reports `steps` progress steps, each with a progress text and a `size`x`size` preview image."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"steps": ("INT", {"default": 3, "min": 1, "max": 10_000}),
                             "size": ("INT", {"default": 32, "min": 1, "max": 2048}),
                             "seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, steps, size, seed):
        import numpy as np
        from PIL import Image

        rng = np.random.default_rng(seed)
        ctx = current()
        for step in range(steps):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            ctx.progress(step + 1, steps, text=f"Iteration {step + 1}/{steps}", preview=Image.fromarray(pixels))
        return {"ui": {"values": [steps]}, "result": (steps,)}


class WebTestRecordRun:
    """Appends its job's id to output/runs.log each time it starts (so a test can count runs), then waits."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 0}), "seconds": ("FLOAT", {"default": 0.0, "min": 0.0})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, value, seconds):
        import time

        from execution.paths import atomic_write_bytes, next_output_name

        ctx = current()
        with open(ctx.paths.output / "runs.log", "a") as log:
            log.write(ctx.prompt_id + "\n")
        # One output file per run, numbered as SaveImage numbers its files: a retried job must not leave two.
        path, name, subfolder = next_output_name(ctx.paths.output, "runs/run", "txt")
        atomic_write_bytes(path, ctx.prompt_id.encode())
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.005)
            ctx.check_interrupted()
        return {"ui": {"values": [value], "files": [{"filename": name, "subfolder": subfolder, "type": "output"}]},
                "result": (value,)}


class WebTestRunaway:
    """Computes a huge power in one C call that never reaches a check point (a node that cannot be
    interrupted cooperatively), after writing a file under the run's staging name."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"digits": ("INT", {"default": 30_000_000, "min": 1})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, digits):
        from execution.paths import atomic_write_bytes, next_output_name

        ctx = current()
        path, _, _ = next_output_name(ctx.paths.output, "runaway/partial", "txt")
        atomic_write_bytes(path, b"written before the runaway step")
        value = 7 ** digits  # one long C call: holds its process for much longer than any test waits
        return {"ui": {"values": [value & 1]}, "result": (value & 1,)}


class WebTestCrash:
    """Ends its process at once (a node that crashes the interpreter), after noting the attempt."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"code": ("INT", {"default": 3, "min": 1, "max": 255})}}

    RETURN_TYPES = ("INT",)
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "testing"

    def run(self, code):
        import os

        ctx = current()
        with open(ctx.paths.output / "crashes.log", "a") as log:
            log.write(ctx.prompt_id + "\n")
        os._exit(code)


WEB_NODES = {"WebTestPreviews": WebTestPreviews, "WebTestRecordRun": WebTestRecordRun,
             "WebTestRunaway": WebTestRunaway, "WebTestCrash": WebTestCrash}


def add_test_nodes(registry) -> None:
    """The testing node pack is already there; add the web-only test nodes."""
    registry.register_all(specs_from_mappings(WEB_NODES, python_module="tests.web.serve"), origin="tests.web.serve")


class LightRuntime(weft_main.Runtime):
    """main.Runtime over the testing node pack alone (no built-in packs, no torch)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.paths = weft_main.paths_from_args(args)
        import importlib

        from nodes.registry import NodeRegistry

        self.registry = NodeRegistry()
        pack = importlib.import_module("tests.nodes_pack")
        self.registry.register_all(specs_from_mappings(pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS,
                                                       python_module="tests.nodes_pack"), origin="tests.nodes_pack")
        add_test_nodes(self.registry)
        self.plugin_reports: list[Any] = []
        self.events = EventBus()
        self.services = run_context.Services(max_loop_iterations=args.max_loop_iterations)
        run_context.configure(self.paths, self.services)
        self.executor = Executor(self.registry, cache=weft_main.cache_from_args(args), events=self.events,
                                 paths=self.paths, runtime=self.services)
        self.validation_memo = ValidationMemo()


def full_runtime(args: argparse.Namespace):
    """main.Runtime (built-in nodes) plus the testing node pack and the web test nodes."""
    import importlib

    runtime = weft_main.Runtime(args)
    pack = importlib.import_module("tests.nodes_pack")
    runtime.registry.register_all(
        specs_from_mappings(pack.NODE_CLASS_MAPPINGS, pack.NODE_DISPLAY_NAME_MAPPINGS, python_module="tests.nodes_pack"),
        origin="tests.nodes_pack")
    add_test_nodes(runtime.registry)
    return runtime


def parse_args(argv: list[str], *, light: bool) -> argparse.Namespace:
    """The server's own flags (as `python main.py` parses them)."""
    from web.server import build_parser

    add_common = weft_main.add_common_arguments
    if light:
        def add_common(parser):  # the memory manager's flags import torch; the light runtime has no model
            saved = weft_main._argument_extensions
            weft_main._argument_extensions = lambda: []
            try:
                weft_main.add_common_arguments(parser)
            finally:
                weft_main._argument_extensions = saved
    return build_parser(add_common).parse_args(argv)


class ServerThread:
    """A real server on a free loopback port, run on its own event loop in a thread."""

    def __init__(self, base: Path, *, light: bool = False, extra_args: list[str] = (), config_changes=None,
                 runtime_changes=None, cache_flags: tuple[str, ...] = ("--cache-none",)) -> None:
        from web.server import config_from_args

        self.args = parse_args(["--base-directory", str(base), "--port", "0", *cache_flags, *extra_args],
                               light=light)
        factory = LightRuntime if light else full_runtime
        self.runtime = factory(self.args)
        self.config = config_from_args(self.args, announce=lambda text: None)
        if not self.args.in_process_jobs:  # as `python main.py` does: jobs run in a worker process
            from execution.worker import RuntimeRecipe

            self.config.worker_recipe = RuntimeRecipe(factory, self.args)
        if config_changes:
            config_changes(self.config)
        if runtime_changes:
            runtime_changes(self.runtime)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="weft-test-server", daemon=True)
        self.thread.start()
        from web.server import start_server

        self.server = asyncio.run_coroutine_threadsafe(start_server(self.runtime, self.config), self.loop).result(60)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self):
        return self.server.state

    def call(self, fn, *args):
        """Run a plain function on the server's loop (to inspect loop-owned state safely)."""
        async def wrapper():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    light = "--light" in argv
    argv = [a for a in argv if a != "--light"]
    from web import server

    add_common = weft_main.add_common_arguments
    if light:
        def add_common(parser):
            weft_main._argument_extensions = lambda: []
            weft_main.add_common_arguments(parser)
    factory = LightRuntime if light else full_runtime
    parser = server.build_parser(add_common)
    args = parser.parse_args(argv)
    import main as weft

    # --workers N: the same local Ray pool `python main.py --workers N` starts, over this runtime.
    return server.serve(parser, args, factory, worker_pool=weft.worker_pool_from_args(parser, args))


if __name__ == "__main__":
    sys.exit(main())
