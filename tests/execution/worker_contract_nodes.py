"""Nodes and the runtime of the worker contract suite (importable by a worker process and by a Ray actor)."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from nodes.spec import Input, NodeSpec, Output
from tests.cluster.cluster_nodes import ClusterRuntime


def _ignore_interrupts(seconds: float) -> dict:
    """Sleep without ever reaching a check point (a node stuck in a long call)."""
    time.sleep(seconds)
    return {"result": (0,)}


def _fail(message: str) -> dict:
    raise ValueError(message)


def _die(marker: str) -> dict:
    """End the worker's process at once, as a crash in native code would; with a marker file, only on
    the first attempt (the marker remembers it across processes)."""
    if marker:
        path = Path(marker)
        if path.exists():
            return {"ui": {"values": [1]}, "result": (1,)}
        path.write_text("died once")
    os._exit(3)


CONTRACT_NODES = [
    NodeSpec(node_id="ContractIgnoreInterrupts", display_name="Contract Ignore Interrupts", category="testing",
             description="Sleeps without a check point.", execute=_ignore_interrupts, output_node=True,
             inputs=[Input.float("seconds", 60.0, min=0.0, max=600.0)], outputs=[Output("INT")],
             python_module="tests.execution.worker_contract_nodes"),
    NodeSpec(node_id="ContractFail", display_name="Contract Fail", category="testing",
             description="Raises a ValueError with its message.", execute=_fail, output_node=True,
             inputs=[Input.string("message", "no")], outputs=[Output("INT")],
             python_module="tests.execution.worker_contract_nodes"),
    NodeSpec(node_id="ContractDie", display_name="Contract Die", category="testing",
             description="Ends its worker's process (once, when given a marker file).", execute=_die,
             output_node=True, inputs=[Input.string("marker", "")], outputs=[Output("INT")],
             python_module="tests.execution.worker_contract_nodes"),
]


class ContractRuntime(ClusterRuntime):
    """The pool-test runtime plus the contract nodes; `args.contract_boot_s` makes it slow to build
    (a worker that is still booting when its job arrives)."""

    def __init__(self, args: argparse.Namespace) -> None:
        time.sleep(float(getattr(args, "contract_boot_s", 0.0) or 0.0))
        super().__init__(args)
        self.registry.register_all(CONTRACT_NODES, origin="tests.execution.worker_contract_nodes")
