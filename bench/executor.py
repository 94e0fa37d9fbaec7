"""Executor overhead: chains and wide DAGs of 1k, 10k and 50k trivial nodes.

For each graph: microseconds per node for the first run (validation included), the unchanged
re-run, and the re-run after changing one leaf constant; plus the 50k/10k time ratio.
The last line printed is one JSON object with every figure.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from execution.cache import make_cache  # noqa: E402
from execution.paths import Paths  # noqa: E402
from execution.scheduler import Executor  # noqa: E402
from execution.validation import validate_prompt  # noqa: E402
from nodes.classic import specs_from_mappings  # noqa: E402
from nodes.registry import NodeRegistry  # noqa: E402


def registry() -> NodeRegistry:
    import tests.nodes_pack as pack

    reg = NodeRegistry()
    reg.register_all(specs_from_mappings(pack.NODE_CLASS_MAPPINGS, python_module="tests.nodes_pack"))
    return reg


def chain(n: int) -> dict:
    prompt = {"0": {"class_type": "TestConst", "inputs": {"value": 0}}}
    for i in range(1, n - 1):
        prompt[str(i)] = {"class_type": "TestAdd", "inputs": {"a": [str(i - 1), 0], "b": 1}}
    prompt["out"] = {"class_type": "TestOutput", "inputs": {"value": [str(n - 2), 0]}}
    return prompt


def wide(n: int) -> dict:
    """A tree of binary sums over n/2 leaves: half the nodes are leaves, one output at the root."""
    prompt = {}
    level = []
    leaves = n // 2
    for i in range(leaves):
        prompt[f"l{i}"] = {"class_type": "TestConst", "inputs": {"value": i}}
        level.append(f"l{i}")
    counter = 0
    while len(level) > 1:
        nxt = []
        for j in range(0, len(level) - 1, 2):
            node_id = f"s{counter}"
            counter += 1
            prompt[node_id] = {"class_type": "TestMul", "inputs": {"a": [level[j], 0], "b": [level[j + 1], 0]}}
            nxt.append(node_id)
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    prompt["out"] = {"class_type": "TestOutput", "inputs": {"value": [level[0], 0]}}
    return prompt


def timed_run(executor: Executor, reg: NodeRegistry, prompt: dict, prompt_id: str) -> tuple[float, int]:
    gc.collect()
    start = time.perf_counter()
    result = executor.run(validate_prompt(prompt, reg), prompt_id=prompt_id)
    elapsed = time.perf_counter() - start
    assert result.status == "success", result.error
    return elapsed, len(result.executed)


def measure(shape: str, n: int, reg: NodeRegistry, tmp: Path) -> dict:
    prompt = chain(n) if shape == "chain" else wide(n)
    nodes = len(prompt)
    executor = Executor(reg, cache=make_cache("classic"), paths=Paths(tmp))
    first, executed_first = timed_run(executor, reg, prompt, "first")
    rerun, executed_rerun = timed_run(executor, reg, prompt, "rerun")
    leaf = "0" if shape == "chain" else "l0"
    prompt[leaf]["inputs"]["value"] += 1
    changed, executed_changed = timed_run(executor, reg, prompt, "changed")
    return {
        "shape": shape, "nodes": nodes,
        "first_us_per_node": first / nodes * 1e6, "rerun_us_per_node": rerun / nodes * 1e6,
        "changed_leaf_us_per_node": changed / nodes * 1e6, "first_s": first, "rerun_s": rerun,
        "changed_s": changed, "rerun_over_first": rerun / first,
        "executed": [executed_first, executed_rerun, executed_changed],
    }


def main() -> None:
    import tempfile

    reg = registry()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("chain", "wide"):
            for n in (1_000, 10_000, 50_000):
                rows.append(measure(shape, n, reg, Path(tmp)))
    print(f"{'shape':<6} {'nodes':>7} {'first us/node':>14} {'rerun us/node':>14} {'1-leaf us/node':>15} "
          f"{'rerun/first':>12} {'executed (first, rerun, changed)':>34}")
    for row in rows:
        print(f"{row['shape']:<6} {row['nodes']:>7} {row['first_us_per_node']:>14.1f} {row['rerun_us_per_node']:>14.1f} "
              f"{row['changed_leaf_us_per_node']:>15.1f} {row['rerun_over_first']:>12.3f} {str(row['executed']):>34}")
    ratios = {}
    for shape in ("chain", "wide"):
        by_n = {r["nodes"]: r for r in rows if r["shape"] == shape}
        sizes = sorted(by_n)
        ratios[shape] = by_n[sizes[-1]]["first_s"] / by_n[sizes[1]]["first_s"]
        print(f"{shape}: 50k/10k first-run time ratio {ratios[shape]:.2f} (5.0 is linear)")
    print(json.dumps({"benchmark": "executor", "rows": rows, "ratio_50k_over_10k": ratios}))


if __name__ == "__main__":
    main()
