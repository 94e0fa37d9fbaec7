"""The official text-to-video template with its turbo LoRA: loaded through LoraLoaderBypassModelOnly it samples
what LoraLoaderModelOnly samples, on the released int8-convrot (pruned) DiT, within that format's rounding.

Both loaders put the quantized layers' patches on the side path; they differ on the float layers (take-time
patches for the ordinary loader, the side path for the bypass one), so the two latents agree to float32
rounding carried through the sampler's steps. The run is the one tests/test_templates.py makes (tiny sizes,
two steps), with the saved video replaced by a probe on the sampled latent.
"""
from __future__ import annotations

import json
import re

import torch

from execution.convert import ui_to_api
from tests.official_templates import T2V
from tests.test_templates import (  # noqa: F401 (env, configured_paths and released_models are fixtures)
    add_inputs, configured_paths, env, fit_to_tiny, load_template, nodes_of, probe, released_models,
)


def _probed(prompt: dict) -> dict:
    """The prompt with its saved outputs replaced by a probe on each sampler's latent."""
    for node_id in nodes_of(prompt, "SaveVideo") + nodes_of(prompt, "SaveImage"):
        del prompt[node_id]
    for n, node_id in enumerate(nodes_of(prompt, "SamplerCustomAdvanced")):
        prompt[f"probe_{n}"] = {"class_type": "TestOutput", "inputs": {"value": [node_id, 0]}}
    return prompt


def test_turbo_lora_through_the_bypass_loader_samples_what_the_ordinary_loader_does_on_int8(env):
    prompt = ui_to_api(load_template(T2V), env.registry)
    add_inputs(env, prompt)
    fit_to_tiny(prompt, turbo=True)
    ordinary = _probed(prompt)
    (lora,) = nodes_of(ordinary, "LoraLoaderModelOnly")
    bypass = json.loads(json.dumps(ordinary))
    bypass[lora]["class_type"] = "LoraLoaderBypassModelOnly"
    results = {"ordinary": env.run(ordinary), "bypass": env.run(bypass)}
    probes = [node_id for node_id in ordinary if node_id.startswith("probe_")]
    assert probes
    for probe_id in probes:
        a, b = (probe(results[kind], probe_id)["samples"] for kind in ("ordinary", "bypass"))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * a.abs().max().item())
    # Every entry of the turbo LoRA is on a quantized layer of the int8 DiT: both loaders ran them beside it.
    for result in results.values():
        (text,) = result.outputs[lora]["text"]
        bound = re.search(r"DiT: (\d+) of (\d+) entries applied at 1 \(0 projected\), (\d+) on the side path$", text)
        assert bound and bound[1] == bound[2] == bound[3] != "0", text
