"""Cheap nodes for the worker-pool tests, and the light runtime that adds them (importable by Ray workers)."""
from __future__ import annotations

import argparse
import time

from execution.context import current
from execution.paths import atomic_write_bytes, next_output_name
from nodes.spec import Input, NodeSpec, Output
from tests.web.serve import LightRuntime


def _write_numbered(value: int, seconds: float, steps: int) -> dict:
    """Report `steps` progress steps over `seconds`, then write `cluster/out_NNNNN_.txt` holding `value`."""
    ctx = current()
    for step in range(steps):
        deadline = time.monotonic() + seconds / steps
        while time.monotonic() < deadline:
            time.sleep(0.005)
            ctx.check_interrupted()
        ctx.progress(step + 1, steps, text=f"step {step + 1} of {steps}")
    path, name, subfolder = next_output_name(ctx.paths.output, "cluster/out", "txt")
    atomic_write_bytes(path, f"value {value}\n".encode() * (1 + value % 7))
    return {"ui": {"values": [value], "files": [{"filename": name, "subfolder": subfolder, "type": "output"}]},
            "result": (value,)}


def _read_model(ckpt_name: str, value: int) -> dict:
    """Read the named model file's size (the worker's own copy) and write it out with `value`."""
    ctx = current()
    size = ctx.paths.model_path("checkpoints", ckpt_name).stat().st_size
    result = _write_numbered(value, 0.0, 1)
    result["ui"]["model_bytes"] = [size]
    return result


def _copy_input(source, value: int) -> dict:
    """Copy an input file's bytes into a numbered output (the input travelled to the worker)."""
    ctx = current()
    path, name, subfolder = next_output_name(ctx.paths.output, "cluster/copy", "txt")
    atomic_write_bytes(path, source.read_bytes())
    return {"ui": {"files": [{"filename": name, "subfolder": subfolder, "type": "output"}]}, "result": (value,)}


def _odd_output(value: int) -> dict:
    """A UI output holding something that does not pickle (a function), as a careless node might."""
    return {"ui": {"values": [value], "odd": [lambda: value]}, "result": (value,)}


def _checkpoint_folders() -> str:
    return ", ".join(str(p) for p in current().paths.model_dirs("checkpoints"))


CLUSTER_NODES = [
    NodeSpec(node_id="ClusterWrite", display_name="Cluster Write", category="testing",
             description="Reports progress, then writes a numbered text file holding its value.",
             execute=_write_numbered, output_node=True,
             inputs=[Input.int("value", 0, min=0, max=10_000), Input.float("seconds", 0.0, min=0.0, max=600.0),
                     Input.int("steps", 2, min=1, max=100)],
             outputs=[Output("INT")], python_module="tests.cluster.cluster_nodes"),
    NodeSpec(node_id="ClusterModel", display_name="Cluster Model", category="testing",
             description="Reads a checkpoint file's size on the worker that runs it.",
             execute=_read_model, output_node=True,
             inputs=[Input.combo("ckpt_name", lambda: current().paths.list_models("checkpoints"),
                                 folder=_checkpoint_folders),
                     Input.int("value", 0, min=0, max=10_000)],
             outputs=[Output("INT")], python_module="tests.cluster.cluster_nodes"),
    NodeSpec(node_id="ClusterCopyInput", display_name="Cluster Copy Input", category="testing",
             description="Copies an input file into the output folder.",
             execute=_copy_input, output_node=True,
             inputs=[Input.file("source", folder="input", extensions=(".txt",)), Input.int("value", 0)],
             outputs=[Output("INT")], python_module="tests.cluster.cluster_nodes"),
    NodeSpec(node_id="ClusterOddOutput", display_name="Cluster Odd Output", category="testing",
             description="Shows a value that does not pickle.", execute=_odd_output, output_node=True,
             inputs=[Input.int("value", 0)], outputs=[Output("INT")], python_module="tests.cluster.cluster_nodes"),
]


class ClusterRuntime(LightRuntime):
    """The light test runtime plus the pool-test nodes."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.registry.register_all(CLUSTER_NODES, origin="tests.cluster.cluster_nodes")
