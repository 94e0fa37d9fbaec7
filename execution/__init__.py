"""Weft's execution layer: the node contract, the prompt graph, validation, the scheduler, jobs and workers.

This is Weft's own package, not ComfyUI's `execution.py`. A pack written for ComfyUI that reaches for
one of that module's names is told so, rather than given a bare AttributeError.
"""

# Names of ComfyUI's execution.py that packs use; Weft has none of them (its own are in the submodules).
COMFYUI_EXECUTION_NAMES = frozenset({
    "validate_prompt", "validate_inputs", "validate_node_input", "PromptExecutor", "PromptQueue",
    "get_input_data", "get_output_data", "execute", "ExecutionResult", "ExecutionList", "IsChangedCache",
    "CacheSet", "CacheType", "DynamicPrompt", "full_type_name", "format_value", "get_outputs_for_prompt",
})


def __getattr__(name: str):
    if name in COMFYUI_EXECUTION_NAMES:
        raise AttributeError(f"execution.{name} is a name of ComfyUI's execution.py, which Weft does not provide; "
                             "Weft's `execution` is its own package")
    raise AttributeError(f"module 'execution' has no attribute {name!r}")
