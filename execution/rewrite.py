"""Graph rewrites: a declared phase between validation's checks and the run.

A node pack may need the graph it runs to differ from the graph the user drew: a loop's End Loop
must not wait on its body (it copies the body per iteration instead), and an output node inside a
body must be reached through its loop. Such a pack declares a `GraphRewrite` in its GRAPH_CHECKS:

- its `check` is an ordinary graph check, a pure function `(prompt, registry, options) -> {node_id:
  [node_error, ...]}` (validation runs it with the others, and `ValidationMemo` may reuse results);
- its `rewrite` takes the checked prompt and returns a `RewriteResult`: nodes replaced by new ones
  with the same id and class (their inputs changed; an input not in the node's spec must be named
  in the rewrite's `adds_inputs`), and stand-ins (node -> the node that runs in its place when an
  output needs it).

`rewrite_prompt` applies every declared rewrite in order to a copy: the prompt it is given is left
as it is, and what a rewrite changed is all in the Prompt it returns (`nodes`, `stand_ins`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from execution.graph import Prompt, PromptNode
from execution.spec import GraphCheck, Registry

@dataclass(frozen=True)
class RewriteResult:
    """What one rewrite changes."""

    replaced: dict[str, PromptNode] = field(default_factory=dict)  # node id -> its replacement
    stand_ins: dict[str, str] = field(default_factory=dict)  # node id -> the node that runs in its place


class GraphRewrite:
    """A graph check whose passing prompts are then rewritten (see the module docstring)."""

    def __init__(self, name: str, check: GraphCheck,
                 rewrite: Callable[[Prompt, Registry, Mapping[str, Any]], RewriteResult], *,
                 adds_inputs: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.name = name
        self.check = check
        self.rewrite = rewrite
        self.adds_inputs = dict(adds_inputs or {})  # class_type -> inputs the rewrite may add to it

    def __call__(self, prompt: Prompt, registry: Registry,
                 options: Mapping[str, Any]) -> Mapping[str, list[dict]] | None:
        """The check (validation calls graph checks as functions)."""
        return self.check(prompt, registry, options)

    def __repr__(self) -> str:
        return f"GraphRewrite({self.name})"

    def apply(self, prompt: Prompt, registry: Registry, options: Mapping[str, Any]) -> Prompt:
        """`prompt` with this rewrite's result applied, as a new Prompt (`prompt` is not changed)."""
        result = self.rewrite(prompt, registry, options)
        if not result.replaced and not result.stand_ins:
            return prompt
        for node_id, node in result.replaced.items():
            old = prompt.nodes.get(node_id)
            if old is None or old.class_type != node.class_type or node.id != node_id:
                raise ValueError(f"graph rewrite {self.name} may only replace a node by one of the same id and "
                                 f"class; it replaced {node_id!r}")
            if node is old:
                raise ValueError(f"graph rewrite {self.name} changed node {node_id!r} in place; it must return "
                                 "a new node")
            spec = registry.get(node.class_type)
            allowed = self.adds_inputs.get(node.class_type, ())
            extra = [name for name in node.inputs if name not in old.inputs and name not in allowed
                     and (spec is None or name not in spec.instance_inputs(node.inputs))]
            if extra:
                raise ValueError(f"graph rewrite {self.name} added undeclared inputs {extra} to node {node_id!r}")
        nodes = dict(prompt.nodes)
        nodes.update(result.replaced)
        return Prompt(nodes, prompt.raw, {**prompt.stand_ins, **result.stand_ins})


def rewrite_prompt(prompt: Prompt, registry: Registry, options: Mapping[str, Any] | None = None) -> Prompt:
    """The graph to run: `prompt` with the registry's declared rewrites applied in order."""
    for check in registry.graph_checks:
        if isinstance(check, GraphRewrite):
            prompt = check.apply(prompt, registry, options or {})
    return prompt
