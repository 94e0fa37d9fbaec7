"""The official templates that load a LoRA run unchanged with the tiny PDD adapter and the tiny FastH3 adapter
chosen in their LoRA loader (the same node and inputs; only the file name differs), on the released formats."""
from __future__ import annotations

import pytest

from execution.convert import ui_to_api
from models.h3.tiny_released import FASTH3_ADAPTER, LORAS, PDD_LORAS
from tests.test_templates import (  # noqa: F401 (fixtures)
    RUNNABLE, _has_turbo_switch, check_outputs, configured_paths, env, load_template, nodes_of, released_models,
    run_prompt,
)

TURBO_TEMPLATES = [name for name in RUNNABLE if _has_turbo_switch(name)]


def _template_for(lora: str) -> str:
    """The first turbo template whose LoRA loader names the released turbo LoRA made for `lora`'s DiT."""
    base = PDD_LORAS.get(lora, "minimax_h3_fl2va_pruned_int8_convrot.safetensors")
    turbo = next(name for name, dit in LORAS.items() if dit == base)
    for name in TURBO_TEMPLATES:
        if turbo in str(load_template(name)):
            return name
    pytest.skip(f"no runnable template loads {turbo}")


@pytest.mark.parametrize("lora", [next(iter(PDD_LORAS)), FASTH3_ADAPTER])
def test_a_turbo_template_runs_with_the_adapter_in_its_lora_loader(env, lora):
    name = _template_for(lora)
    prompt = ui_to_api(load_template(name), env.registry)
    loaders = nodes_of(prompt, "LoraLoaderModelOnly")
    assert loaders
    for node_id in loaders:
        prompt[node_id]["inputs"]["lora_name"] = lora
    result, _ = run_prompt(env, prompt, turbo=True)
    check_outputs(env, prompt, result)
    assert "LoraLoaderModelOnly" in [row["class_type"] for row in result.profile.values()]
