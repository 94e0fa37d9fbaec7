"""Executor overhead: chains and wide DAGs of 1k, 10k and 50k trivial nodes.

For each graph: microseconds per node for the first run, the unchanged re-run, and the re-run after
changing one leaf constant; plus the 50k/10k first-run time ratio. Each run is timed as two stages,
validation (parse + checks) and execution (signatures, cache, scheduling, node calls), in process
CPU time: this machine is shared, and CPU time is what the engine spends, whoever else is running.
Wall time is printed beside it.

Every graph is measured in a fresh process (`bench/executor.py --child SHAPE NODES`), after an
untimed first run of the same graph there, as a server that runs such prompts has run one before:
the first run, the unchanged re-run and the one-leaf re-run, holding one executor and one validation
memo as the server does. So each size starts alike. Measured in one process, a 10k run found pages
an earlier larger run had mapped while a 50k run mapped its own, and a page's first touch costs
about 3.5 us on this host (a third of a page fault per node of a fresh 50k run).

The 50k/10k ratio is measured side by side, in rounds: each round runs five 10k graphs around one
50k graph, the same number of nodes, so the host's slow spells (this machine is shared, and single
runs vary by a third) fall on both sides alike. The figure is the mean 50k first run over the mean
10k first run: with equal exposure, the time noise adds is the same share of both means. Printed
beside it: the median of the rounds' own ratios (50k over the mean of its five 10k runs), which
favours the 50k side a little, since a single run is more often quiet than a mean of five, and the
ratio of the fastest runs, which favours the 10k side, having five times the samples. The table's
figures are the fastest of all runs of each graph (noise only adds time). The last line printed is
one JSON object with every figure.
"""
from __future__ import annotations

import gc
import json
import statistics
import subprocess
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
    cpu1 = time.process_time()
    result = executor.run(validated, prompt_id=prompt_id)
    wall2, cpu2 = time.perf_counter(), time.process_time()
    assert result.status == "success", result.error
    return {"validate_cpu": cpu1 - cpu0, "execute_cpu": cpu2 - cpu1, "total_cpu": cpu2 - cpu0,
            "total_wall": wall2 - wall0, "executed": len(result.executed)}


def measure(shape: str, n: int, reg: NodeRegistry, tmp: Path) -> dict:
    """The first run of a fresh graph, the unchanged re-run, the re-run after changing one leaf."""
    prompt = chain(n) if shape == "chain" else wide(n)
    # As the server holds them: one executor (with its output cache) and one validation memo.
    executor = Executor(reg, cache=make_cache("classic"), paths=Paths(tmp))
    memo = ValidationMemo()
    first = timed_run(executor, reg, memo, prompt, "first")
    rerun = timed_run(executor, reg, memo, prompt, "rerun")
    leaf = "0" if shape == "chain" else "l0"
    prompt[leaf]["inputs"]["value"] += 1
    changed = timed_run(executor, reg, memo, prompt, "changed")
    return {"first": first, "rerun": rerun, "changed": changed, "nodes": len(prompt)}


def child(shape: str, n: int) -> None:
    """One measurement in this fresh process, after an untimed first run of the same graph; prints it as JSON."""
    import tempfile

    reg = registry()
    with tempfile.TemporaryDirectory() as tmp:
        warm_up = Executor(reg, cache=make_cache("classic"), paths=Paths(tmp))
        timed_run(warm_up, reg, ValidationMemo(), chain(n) if shape == "chain" else wide(n), "warm-up")
        del warm_up
        print(json.dumps(measure(shape, n, reg, Path(tmp))))


def in_fresh_process(shape: str, n: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", shape, str(n)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {shape} {n} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


ROUNDS = 9
SMALL_PER_LARGE = 5  # 10k runs per 50k run in a round: the same node count on both sides
SIZES = (1_000, 10_000, 50_000)


def fastest(runs: list[dict]) -> dict:
    return {key: min(run[key] for run in runs) if key != "executed" else runs[0][key] for key in runs[0]}


def summarise(shape: str, samples: list[dict]) -> dict:
    first = fastest([s["first"] for s in samples])
    rerun = fastest([s["rerun"] for s in samples])
    changed = fastest([s["changed"] for s in samples])
    nodes = samples[0]["nodes"]
    per_node = lambda run, key: run[key] / nodes * 1e6  # noqa: E731
    return {
        "shape": shape, "nodes": nodes, "runs": len(samples),
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
    samples: dict[tuple[str, int], list[dict]] = {(shape, n): [] for shape in ("chain", "wide") for n in SIZES}
    round_ratios: dict[str, list[float]] = {"chain": [], "wide": []}
    # A round per shape: the 1k graph, then the 50k graph amid the five 10k ones.
    small_before = SMALL_PER_LARGE // 2
    sequence = [1_000] + [10_000] * small_before + [50_000] + [10_000] * (SMALL_PER_LARGE - small_before)
    for _ in range(ROUNDS):
        for shape in ("chain", "wide"):
            runs = [(n, in_fresh_process(shape, n)) for n in sequence]
            for n, sample in runs:
                samples[(shape, n)].append(sample)
            small = [sample["first"]["total_cpu"] for n, sample in runs if n == 10_000]
            large = next(sample["first"]["total_cpu"] for n, sample in runs if n == 50_000)
            round_ratios[shape].append(large / statistics.mean(small))
    rows = [summarise(shape, samples[(shape, n)]) for shape, n in samples]
    print("CPU microseconds per node, fastest of all runs of each graph (wall in brackets for the first run)")
    print(f"{'shape':<6} {'nodes':>7} {'runs':>5} {'first':>16} {'validate':>9} {'execute':>8} {'rerun':>7} "
          f"{'rerun exec':>10} {'1 leaf':>7} {'rerun/first':>11} {'exec rerun/first':>16} {'executed':>22}")
    for row in rows:
        print(f"{row['shape']:<6} {row['nodes']:>7} {row['runs']:>5} {row['first_us_per_node']:>7.1f} "
              f"[{row['first_wall_us_per_node']:>6.1f}] "
              f"{row['validate_us_per_node']:>9.1f} {row['first_execute_us_per_node']:>8.1f} "
              f"{row['rerun_us_per_node']:>7.1f} {row['rerun_execute_us_per_node']:>10.1f} "
              f"{row['changed_leaf_us_per_node']:>7.1f} {row['rerun_over_first']:>11.3f} "
              f"{row['rerun_over_first_execute']:>16.3f} {str(row['executed']):>22}")
    ratios, median_ratio, fastest_ratio = {}, {}, {}
    for shape, paired in round_ratios.items():
        small = [sample["first"]["total_cpu"] for sample in samples[(shape, 10_000)]]
        large = [sample["first"]["total_cpu"] for sample in samples[(shape, 50_000)]]
        ratios[shape] = statistics.mean(large) / statistics.mean(small)
        median_ratio[shape] = statistics.median(paired)
        by_n = {r["nodes"]: r for r in rows if r["shape"] == shape}
        fastest_ratio[shape] = by_n[50_000]["first_s"] / by_n[10_000]["first_s"]
        print(f"{shape}: 50k/10k first-run time ratio {ratios[shape]:.2f} (mean 50k run / mean 10k run; "
              f"median of the rounds' ratios {median_ratio[shape]:.2f}, they are "
              f"{', '.join(f'{r:.2f}' for r in sorted(paired))}; fastest runs {fastest_ratio[shape]:.2f}; "
              f"5.0 is linear)")
    print(json.dumps({"benchmark": "executor", "rows": rows, "ratio_50k_over_10k": ratios,
                      "ratio_50k_over_10k_median_of_rounds": median_ratio,
                      "ratio_50k_over_10k_rounds": round_ratios,
                      "ratio_50k_over_10k_of_fastest_runs": fastest_ratio}))

if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
