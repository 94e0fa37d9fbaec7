"""Executor overhead: chains and wide DAGs of 1k, 10k and 50k trivial nodes.

For each graph: microseconds per node for the first run, the unchanged re-run, and the re-run after
changing one leaf constant; plus the 50k/10k first-run time ratio, measured side by side per round. Each run is timed as two stages, validation
(parse + checks) and execution (signatures, cache, scheduling, node calls), in process CPU time:
this machine is shared, and CPU time is what the engine spends, whoever else is running. Wall time
is printed beside it. Each figure is the fastest of seven fresh repetitions (noise only adds time).
Each repetition holds one executor and one validation memo, as the server does, so the unchanged
re-run is what re-submitting the same prompt costs end to end. The last line printed is one JSON
object with every figure.
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
from execution.validation import ValidationMemo, validate_prompt  # noqa: E402
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


def timed_run(executor: Executor, reg: NodeRegistry, memo: ValidationMemo, prompt: dict, prompt_id: str) -> dict:
    gc.collect()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    validated = validate_prompt(prompt, reg, memo=memo)
    wall1, cpu1 = time.perf_counter(), time.process_time()
    result = executor.run(validated, prompt_id=prompt_id)
    wall2, cpu2 = time.perf_counter(), time.process_time()
    assert result.status == "success", result.error
    return {"validate_cpu": cpu1 - cpu0, "execute_cpu": cpu2 - cpu1, "total_cpu": cpu2 - cpu0,
            "total_wall": wall2 - wall0, "executed": len(result.executed)}


REPEATS = 7  # each figure is the fastest of this many fresh repetitions: the host's noise only adds time


def fastest(runs: list[dict]) -> dict:
    return {key: min(run[key] for run in runs) if key != "executed" else runs[0][key] for key in runs[0]}


def measure_once(shape: str, n: int, reg: NodeRegistry, tmp: Path) -> tuple[dict, dict, dict, int]:
    """One fresh repetition: the first run, the unchanged re-run, the re-run after changing one leaf."""
    prompt = chain(n) if shape == "chain" else wide(n)
    # As the server holds them: one executor (with its output cache) and one validation memo.
    executor = Executor(reg, cache=make_cache("classic"), paths=Paths(tmp))
    memo = ValidationMemo()
    first = timed_run(executor, reg, memo, prompt, "first")
    rerun = timed_run(executor, reg, memo, prompt, "rerun")
    leaf = "0" if shape == "chain" else "l0"
    prompt[leaf]["inputs"]["value"] += 1
    changed = timed_run(executor, reg, memo, prompt, "changed")
    return first, rerun, changed, len(prompt)


def summarise(shape: str, repetitions: list[tuple[dict, dict, dict, int]]) -> dict:
    first = fastest([r[0] for r in repetitions])
    rerun = fastest([r[1] for r in repetitions])
    changed = fastest([r[2] for r in repetitions])
    nodes = repetitions[0][3]
    per_node = lambda run, key: run[key] / nodes * 1e6  # noqa: E731
    return {
        "shape": shape, "nodes": nodes,
        "first_us_per_node": per_node(first, "total_cpu"), "rerun_us_per_node": per_node(rerun, "total_cpu"),
        "changed_leaf_us_per_node": per_node(changed, "total_cpu"),
        "first_execute_us_per_node": per_node(first, "execute_cpu"),
        "rerun_execute_us_per_node": per_node(rerun, "execute_cpu"),
        "validate_us_per_node": per_node(first, "validate_cpu"),
        "first_wall_us_per_node": per_node(first, "total_wall"),
        "first_s": first["total_cpu"], "rerun_over_first": rerun["total_cpu"] / first["total_cpu"],
        "rerun_over_first_execute": rerun["execute_cpu"] / first["execute_cpu"],
        "executed": [first["executed"], rerun["executed"], changed["executed"]],
    }


def main() -> None:
    import tempfile

    reg = registry()
    cases: list[tuple[str, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in ("chain", "wide"):
            for n in (1_000, 10_000, 50_000):
                cases.append((shape, n))
        # Repetitions go round-robin over the graphs, so a slow spell of the host hits them all alike.
        samples: dict[tuple[str, int], list] = {case: [] for case in cases}
        for _ in range(REPEATS):
            for shape, n in cases:
                samples[(shape, n)].append(measure_once(shape, n, reg, Path(tmp)))
        rows = [summarise(shape, samples[(shape, n)]) for shape, n in cases]
    print("CPU microseconds per node (wall in brackets for the first run)")
    print(f"{'shape':<6} {'nodes':>7} {'first':>16} {'validate':>9} {'execute':>8} {'rerun':>7} "
          f"{'rerun exec':>10} {'1 leaf':>7} {'rerun/first':>11} {'exec rerun/first':>16} {'executed':>22}")
    for row in rows:
        print(f"{row['shape']:<6} {row['nodes']:>7} {row['first_us_per_node']:>7.1f} [{row['first_wall_us_per_node']:>6.1f}] "
              f"{row['validate_us_per_node']:>9.1f} {row['first_execute_us_per_node']:>8.1f} "
              f"{row['rerun_us_per_node']:>7.1f} {row['rerun_execute_us_per_node']:>10.1f} "
              f"{row['changed_leaf_us_per_node']:>7.1f} {row['rerun_over_first']:>11.3f} "
              f"{row['rerun_over_first_execute']:>16.3f} {str(row['executed']):>22}")
    # The 50k/10k ratio is measured side by side: in each round the 10k and the 50k graph run one
    # after the other, their ratio is that round's, and the median over rounds is the figure. The
    # ratio of the fastest runs (5 x first(50k) / first(10k) in the table) is printed beside it;
    # it pairs runs from different rounds, so a quiet spell that only a short 10k run caught moves it.
    ratios, fastest = {}, {}
    for shape in ("chain", "wide"):
        paired = sorted(big[0]["total_cpu"] / small[0]["total_cpu"]
                        for small, big in zip(samples[(shape, 10_000)], samples[(shape, 50_000)]))
        ratios[shape] = paired[len(paired) // 2]
        by_n = {r["nodes"]: r for r in rows if r["shape"] == shape}
        fastest[shape] = by_n[50_000]["first_s"] / by_n[10_000]["first_s"]
        print(f"{shape}: 50k/10k first-run time ratio {ratios[shape]:.2f} (median of the rounds' side-by-side "
              f"ratios {', '.join(f'{r:.2f}' for r in paired)}; fastest runs {fastest[shape]:.2f}; 5.0 is linear)")
    print(json.dumps({"benchmark": "executor", "rows": rows, "ratio_50k_over_10k": ratios,
                      "ratio_50k_over_10k_of_fastest_runs": fastest}))


if __name__ == "__main__":
    main()
