"""Node packs written the way packs are written in the wild (issue 31): each pack below reproduces one
thing real packs do, is written into a scratch `custom_nodes/` unchanged, and is loaded and run by one
real server whose jobs run in a worker process."""
from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from execution.isolation import OWN_ROOT
from tests.web.conftest import const_prompt, get_json, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

# {pack folder: {file inside it: source}}; a key ending in ".py" at top level is a single-file pack.
PACKS: dict[str, dict[str, str]] = {}

# Defect 1: a pack puts its own folder first on sys.path, and that folder holds packages named like
# Weft's. It also swaps builtins.__import__ and plants a module under one of Weft's names. Its node
# reports, from the worker process, which files Weft's names resolve to there.
PACKS["shadow_pack"] = {
    "__init__.py": '''
        import builtins, os, sys, types
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        _real_import = builtins.__import__
        def _redirecting_import(name, *args, **kwargs):
            return _real_import(name, *args, **kwargs)
        builtins.__import__ = _redirecting_import
        sys.modules["kernels"] = types.ModuleType("kernels")

        class ShadowProbe:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"names": ("STRING", {"default": "nodes,execution,models,media,kernels"})}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "probe"
            CATEGORY = "testing"

            def probe(self, names):
                import importlib
                files = [importlib.import_module(name).__file__ for name in names.split(",")]
                return {"ui": {"files": files, "path0": [sys.path[0]]}}

        NODE_CLASS_MAPPINGS = {"ShadowProbe": ShadowProbe}
    ''',
    "nodes/__init__.py": "SHADOW = True\n",
    "execution/__init__.py": "SHADOW = True\n",
    "models/__init__.py": "SHADOW = True\n",
    "media/__init__.py": "SHADOW = True\n",
}
# ...and one that does the same through a helper module it imports, then fails to load.
PACKS["shadow_failing"] = {
    "__init__.py": '''
        from . import path_helper
        raise RuntimeError("this pack fails after its helper edited sys.path")
    ''',
    "path_helper.py": '''
        import os, sys
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ''',
    "nodes/__init__.py": "raise RuntimeError('the pack nodes package must never be imported')\n",
    "execution/__init__.py": "raise RuntimeError('the pack execution package must never be imported')\n",
}

# Defect 5: a pack imported by its folder name and relatively gets one module object per file.
PACKS["self_named"] = {
    "__init__.py": '''
        from .sub import counter
        import self_named.sub.state as by_name
        from .sub import state as relative
        assert by_name is relative, "one file gave two modules"
        assert counter.RUNS == 1

        class SelfNamedRuns:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ("INT",)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self):
                import self_named.sub.counter as again
                return {"ui": {"runs": [again.RUNS], "same": [again is counter]}, "result": (again.RUNS,)}

        NODE_CLASS_MAPPINGS = {"SelfNamedRuns": SelfNamedRuns}
    ''',
    "sub/__init__.py": '''
        import self_named.sub.state as m
        from . import counter
    ''',
    "sub/state.py": "VALUE = 1\n",
    "sub/counter.py": '''
        import builtins
        RUNS = getattr(builtins, "_self_named_runs", 0) + 1
        builtins._self_named_runs = RUNS
    ''',
}


# Defect 2: what ComfyUI tolerates in a declaration, and one node that cannot be declared at all.
PACKS["tolerant_pack"] = {
    "__init__.py": """
        import os

        WEB_DIRECTORY = os.path.join(os.path.dirname(__file__), "web")

        class TolerantSum:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"count": ("INT", {"default": 1, "description": "read by an editor extension"}),
                                     "strength": ("FLOAT", {"default": 5.0, "min": 0.0, "max": 1.0}),
                                     "value": ("INT", {"default": 1})},
                        "optional": {"value": ("INT", {"default": 2})},
                        "hidden": {"extra": ("INT",)}}
            RETURN_TYPES = ("INT",)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, count, strength, value, extra=None):
                return {"ui": {"sum": [count + value + (extra or 0)], "strength": [strength]}, "result": (count,)}

        class NamesNoMethod:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ()
            FUNCTION = "missing"

        NODE_CLASS_MAPPINGS = {"TolerantSum": TolerantSum, "NamesNoMethod": NamesNoMethod}
    """,
    "web/tolerant.js": "// an editor extension\n",
}

# Defects 3 and 4: a V3 input named like a hidden value, and link types of current ComfyUI.
PACKS["v3_wild"] = {
    "__init__.py": """
        from comfy_api.latest import ComfyExtension, io

        class PromptEcho(io.ComfyNode):
            @classmethod
            def define_schema(cls):
                return io.Schema(node_id="PromptEcho", category="testing", is_output_node=True,
                                 inputs=[io.String.Input("prompt")], outputs=[io.String.Output()],
                                 hidden=[io.Hidden.prompt, io.Hidden.unique_id])

            @classmethod
            def execute(cls, prompt):
                graph = cls.hidden.prompt
                return io.NodeOutput(prompt, ui={"text": [prompt], "classes": [graph[cls.hidden.unique_id]["class_type"]]})

        class MeshPass(io.ComfyNode):
            @classmethod
            def define_schema(cls):
                return io.Schema(node_id="MeshPass", category="testing",
                                 inputs=[io.File3DGLB.Input("glb", optional=True), io.File3DAny.Input("any", optional=True),
                                         io.FlowControl.Input("flow", optional=True), io.Accumulation.Input("acc", optional=True),
                                         io.LossMap.Input("loss", optional=True), io.File3DUSDZ.Input("usdz", optional=True)],
                                 outputs=[io.File3DGLTF.Output(), io.File3DFBX.Output(), io.File3DOBJ.Output(),
                                          io.File3DSTL.Output(), io.Load3D.Output()])

            @classmethod
            def execute(cls, **kwargs):
                return io.NodeOutput(None, None, None, None, None)

        class Extension(ComfyExtension):
            async def get_node_list(self):
                return [PromptEcho, MeshPass]

        async def comfy_entrypoint():
            return Extension()
    """,
}

# Defects 6, 7, 8, 9, 15 and 17: classic nodes the way packs write them.
PACKS["classic_wild"] = {
    "__init__.py": """
        import json, os
        from comfy.comfy_types import IO, ComfyNodeABC, InputTypeDict
        from comfy_execution.graph import ExecutionBlocker
        import folder_paths

        class NumberEcho(ComfyNodeABC):
            @classmethod
            def INPUT_TYPES(cls) -> InputTypeDict:
                return {"required": {"number": (IO.NUMBER, {"forceInput": True})}}
            RETURN_TYPES = (IO.NUMBER,)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, number):
                return {"ui": {"number": [number], "blocker": [ExecutionBlocker.__module__]}, "result": (number,)}

        class Variadic:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"input1": ("INT", {"forceInput": True})}}
            RETURN_TYPES = ("INT",)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, **kwargs):
                return {"ui": {"names": sorted(kwargs), "total": [sum(kwargs.values())]}, "result": (sum(kwargs.values()),)}

        def _validate(value):
            return True if value % 2 == 0 else f"value {value} is odd"

        def _is_changed(value):
            return value

        class AssignedHooks:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"value": ("INT", {"default": 0})}}
            RETURN_TYPES = ("INT",)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, value):
                return {"ui": {"value": [value]}, "result": (value,)}

        setattr(AssignedHooks, "VALIDATE_INPUTS", _validate)
        setattr(AssignedHooks, "IS_CHANGED", _is_changed)

        class LinkedFingerprint:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"source": ("INT", {"forceInput": True}), "value": ("INT", {"default": 0})}}
            RETURN_TYPES = ("INT",)
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            @classmethod
            def IS_CHANGED(cls, source, value):
                folder = folder_paths.get_output_directory()
                with open(os.path.join(folder, "fingerprint.json"), "w") as out:
                    json.dump({"source": source, "value": value}, out)
                return value

            def run(self, source, value):
                return {"ui": {"value": [source + value]}, "result": (source + value,)}

        class HiddenSettings:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"frames": ("INT", {"default": 1})},
                        "hidden": {"crf": ("INT", {"default": 23}), "ten_bit": ("BOOLEAN", {"default": False}),
                                   "node_id": "UNIQUE_ID"}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, frames, crf=23, ten_bit=False, node_id=None):
                return {"ui": {"crf": [crf], "ten_bit": [ten_bit], "node_id": [node_id]}}

        class FloatOrInt(str):
            def __ne__(self, other):
                return other not in ("FLOAT", "INT")

        class TakesFloatOrInt:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"x": (FloatOrInt("FLOAT"), {"forceInput": True})}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"
            CATEGORY = "testing"

            def run(self, x):
                return {"ui": {"x": [x]}}

        NODE_CLASS_MAPPINGS = {"NumberEcho": NumberEcho, "Variadic": Variadic, "AssignedHooks": AssignedHooks,
                               "LinkedFingerprint": LinkedFingerprint, "HiddenSettings": HiddenSettings,
                               "TakesFloatOrInt": TakesFloatOrInt}
    """,
}


# Defects 10 and 11: ComfyUI's `execution` imported whole, and `from nodes import X` in a pack that
# misses other modules too.
PACKS["imports_execution"] = {
    "__init__.py": """
        import execution

        class UsesExecution:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ()
            FUNCTION = "run"

            def run(self):
                return execution.validate_prompt({})

        NODE_CLASS_MAPPINGS = {"UsesExecution": UsesExecution}
    """,
}
PACKS["nodes_import_chain"] = {
    "__init__.py": """
        from nodes import common_ksampler
        import comfy.sd
        from .helpers import masks
    """,
    "helpers.py": "from comfy_extras.nodes_mask import composite as masks\n",
}

# Defects 12, 14, 16 and 18: values and folders the way packs hand them over.
PACKS["values_wild"] = {
    "__init__.py": """
        import os
        from collections.abc import Mapping

        import folder_paths
        import numpy as np
        import torch

        EXTRA_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "my_models")
        folder_paths.folder_names_and_paths["wild_models"] = ([EXTRA_MODELS], {".safetensors"})

        class Scalars:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ("*", "*")
            FUNCTION = "run"

            def run(self):
                return (np.float64(3.5), torch.tensor(7))

        class Folders:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"name": ("STRING", {"default": "a.png [output]"})}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, name):
                table = folder_paths.folder_names_and_paths
                plain, folder = folder_paths.annotated_filepath(name)
                return {"ui": {"plain": [plain], "folder": [folder],
                               "checkpoints": [table["checkpoints"][0][0]], "wild": table["wild_models"][0],
                               "has_loras": ["loras" in table]}}

        class TextFiles:
            @classmethod
            def INPUT_TYPES(cls):
                folder = folder_paths.get_input_directory()
                names = sorted(f for f in os.listdir(folder) if f.endswith(".txt")) if os.path.isdir(folder) else []
                return {"required": {"text_file": (names or ["none"],)}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, text_file):
                with open(os.path.join(folder_paths.get_input_directory(), text_file)) as handle:
                    return {"ui": {"text": [handle.read()]}}

        class LazyAudio(Mapping):
            def __init__(self):
                self._values = {"waveform": torch.zeros(1, 2, 800), "sample_rate": 8000}
            def __getitem__(self, key):
                return self._values[key]
            def __iter__(self):
                return iter(self._values)
            def __len__(self):
                return len(self._values)

        class LoadsVideo:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ("IMAGE", "AUDIO")
            FUNCTION = "run"

            def run(self):
                return (torch.zeros(2, 16, 16, 3), LazyAudio())

        NODE_CLASS_MAPPINGS = {"Scalars": Scalars, "Folders": Folders, "TextFiles": TextFiles, "LoadsVideo": LoadsVideo}
    """,
}


# Defect 19: the next ring of what a video pack imports (ComfyUI-VideoHelperSuite's), made real.
PACKS["video_ring"] = {
    "__init__.py": """
        import os

        import folder_paths
        import latent_preview
        from comfy.k_diffusion.utils import FolderOfImages
        from nodes import EmptyLatentImage, LoadImage, SaveImage, VAEDecode, VAEEncode, CLIPTextEncode
        from server import PromptServer, web

        @PromptServer.instance.routes.get("/video_ring/ping")
        async def ping(request):
            return web.json_response({"pong": True})

        class FramesFolder:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"folder": ("STRING", {"default": "frames"})}}
            RETURN_TYPES = ("IMAGE",)
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, folder):
                import numpy as np
                import torch
                frames = FolderOfImages(os.path.join(folder_paths.get_input_directory(), folder),
                                        transform=lambda image: torch.from_numpy(np.asarray(image, dtype=np.float32) / 255))
                images = torch.stack([frames[i][0] for i in range(len(frames))])
                saved = SaveImage().save_images(images, "wild/facade")
                loaded, mask = LoadImage().load_image(os.path.join(folder, "f0.png"))
                latent = EmptyLatentImage().generate(64, 32, 1)[0]
                return {"ui": {"frames": [len(frames)], "saved": [len(saved["ui"]["images"])],
                               "loaded": [list(loaded.shape)], "latent": [list(latent["samples"].shape)],
                               "previewer": [latent_preview.get_previewer() is None],
                               "functions": [VAEEncode.FUNCTION, VAEDecode.FUNCTION, CLIPTextEncode.FUNCTION]},
                        "result": (images,)}

        prompt_queue = PromptServer.instance.prompt_queue  # read once at import, as the video pack does

        class Requeue:  # queues its own prompt once more with `round` bumped, as a batch manager re-queues
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"round": ("INT", {"default": 0})}, "hidden": {"unique_id": "UNIQUE_ID"}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, round, unique_id):
                import server
                [(number, prompt_id, prompt, extra_data, outputs)] = prompt_queue.currently_running.values()
                running, pending = prompt_queue.get_current_queue()
                if round < 1:
                    prompt = dict(prompt)
                    prompt[unique_id] = {**prompt[unique_id], "inputs": {"round": round + 1}}
                    PromptServer.instance.number += 1
                    prompt_queue.put((-PromptServer.instance.number, str(server.uuid.uuid4()), prompt, extra_data,
                                      outputs))
                return {"ui": {"running": [prompt_id], "queued": [len(running) + len(pending)],
                               "round": [round], "outputs": [outputs]}}

        NODE_CLASS_MAPPINGS = {"FramesFolder": FramesFolder, "Requeue": Requeue}
    """,
}


# Defect 19, found running ComfyUI-VideoHelperSuite: a pack declares a folder kind of its own for files
# that are not models, with no folders yet, reads the entry back and adds to its extension set.
PACKS["own_folder_kind"] = {
    "__init__.py": """
        import os

        import folder_paths

        if "wild_formats" not in folder_paths.folder_names_and_paths:
            folder_paths.folder_names_and_paths["wild_formats"] = ((), {".json", ".pt"})
        folder_paths.folder_names_and_paths["wild_formats"][1].add(".yaml")
        folder_paths.add_model_folder_path("wild_formats",
                                           os.path.join(os.path.dirname(os.path.abspath(__file__)), "formats"))

        class ListFormats:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self):
                names = folder_paths.get_filename_list("wild_formats")
                return {"ui": {"names": names, "extensions": sorted(folder_paths.folder_names_and_paths["wild_formats"][1]),
                               "first": [folder_paths.get_full_path("wild_formats", names[0])]}}

        NODE_CLASS_MAPPINGS = {"ListFormats": ListFormats}
    """,
    "formats/a.json": "{}\n",
    "formats/b.yaml": "x: 1\n",
    "formats/c.pt": "not listed: a pickle format\n",
    "formats/d.txt": "not listed: not declared\n",
}


# Defect 19, found running ComfyUI-VideoHelperSuite: an output node whose `hidden` section claims every
# name receives every constant of its prompt entry (the options its chosen format adds), as in ComfyUI.
PACKS["every_input"] = {
    "__init__.py": """
        class ClaimsEveryName(dict):
            def __contains__(self, name):
                return True
            def __getitem__(self, name):
                return super().get(name, (None, {}))

        class FormatOptions:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"format": (["video/a", "video/b"],)},
                        "hidden": ClaimsEveryName({"unique_id": "UNIQUE_ID"})}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, format, unique_id=None, **options):
                return {"ui": {"options": [sorted(options.items())], "node": [unique_id]}}

        class DeclaredOnly:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"format": (["video/a", "video/b"],)}}
            RETURN_TYPES = ()
            OUTPUT_NODE = True
            FUNCTION = "run"

            def run(self, format, **options):
                return {"ui": {"options": [sorted(options.items())]}}

        NODE_CLASS_MAPPINGS = {"FormatOptions": FormatOptions, "DeclaredOnly": DeclaredOnly}
    """,
}


def write_packs(custom: Path, packs: dict[str, dict[str, str]]) -> None:
    for name, files in packs.items():
        for relative, source in files.items():
            path = custom / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))


@pytest.fixture(scope="module")
def wild(tmp_path_factory):
    base = tmp_path_factory.mktemp("wild-packs")
    write_packs(base / "custom_nodes", PACKS)
    running = ServerThread(base)
    yield running
    running.stop()


def reports(server) -> dict:
    return {r.name: r for r in server.runtime.plugin_reports}


def run(server, prompt: dict, timeout: float = 120) -> dict:
    status, reply = post_json(server.url + "/prompt", {"prompt": prompt})
    assert status == 200, reply
    return wait_terminal(server.url, reply["prompt_id"], timeout=timeout)


def outputs(record: dict, node: str) -> dict:
    assert record["status"]["status_str"] == "success", record["status"]
    return record["outputs"][node]


# ---------------------------------------------------------------------- defect 1
def test_a_pack_shadowing_weft_names_on_sys_path_leaves_the_server_and_worker_on_weft(wild):
    loaded = reports(wild)
    assert loaded["shadow_pack"].status == "loaded", loaded["shadow_pack"].reason
    assert any("builtins.__import__" in w and "sys.modules['kernels']" in w for w in loaded["shadow_pack"].warnings)
    assert loaded["shadow_failing"].status == "failed"
    assert "fails after its helper edited sys.path" in loaded["shadow_failing"].reason
    for name in ("nodes", "execution", "models", "media", "kernels"):  # in the server's process
        assert Path(sys.modules[name].__file__).is_relative_to(OWN_ROOT), name
    # Built-in and pack nodes still run in the worker, which resolves every name to Weft's files.
    assert outputs(run(wild, const_prompt(5)), "2")
    probe = outputs(run(wild, {"1": {"class_type": "ShadowProbe", "inputs": {"names": "nodes,execution,models,media,kernels"}}}), "1")
    assert all(Path(f).is_relative_to(OWN_ROOT) for f in probe["files"]), probe
    assert probe["path0"] == [str(OWN_ROOT)]


# ---------------------------------------------------------------------- defect 5
def test_a_pack_file_is_one_module_by_its_folder_name_and_relatively(wild):
    assert reports(wild)["self_named"].status == "loaded", reports(wild)["self_named"].reason
    ran = outputs(run(wild, {"1": {"class_type": "SelfNamedRuns", "inputs": {}}}), "1")
    assert ran == {"runs": [1], "same": [True]}


# ---------------------------------------------------------------------- defect 2
def test_what_comfyui_tolerates_in_a_declaration_loads_and_one_bad_node_is_refused_alone(wild):
    report = reports(wild)["tolerant_pack"]
    assert report.status == "loaded", report.reason
    assert report.node_ids == ("TolerantSum",)
    assert report.warnings == ["node refused: node 'NamesNoMethod': FUNCTION: names no method of the class: 'missing'"]
    status, info = get_json(wild.url + "/object_info/TolerantSum")
    inputs = info["TolerantSum"]["input"]
    assert inputs["required"]["count"][1]["description"] == "read by an editor extension"
    assert inputs["required"]["strength"][1]["default"] == 5.0
    assert inputs["hidden"]["extra"] == ["INT"]
    status, urls = get_json(wild.url + "/extensions")
    assert "/extensions/tolerant_pack/tolerant.js" in urls
    ran = outputs(run(wild, {"1": {"class_type": "TestConst", "inputs": {"value": 4}},
                             "2": {"class_type": "TolerantSum", "inputs": {"count": 1, "strength": 0.5, "value": 3,
                                                                           "extra": ["1", 0]}}}), "2")
    assert ran == {"sum": [8], "strength": [0.5]}
    status, reply = post_json(wild.url + "/prompt", {"prompt": {"1": {"class_type": "NamesNoMethod", "inputs": {}}}})
    assert status == 400 and "tolerant_pack" in json.dumps(reply)


# ---------------------------------------------------------------------- defects 3 and 4
def test_v3_input_named_like_a_hidden_value_and_current_link_types(wild):
    report = reports(wild)["v3_wild"]
    assert report.status == "loaded", report.reason
    assert set(report.node_ids) == {"PromptEcho", "MeshPass"}
    ran = outputs(run(wild, {"5": {"class_type": "PromptEcho", "inputs": {"prompt": "a red fox"}}}), "5")
    assert ran == {"text": ["a red fox"], "classes": ["PromptEcho"]}
    status, info = get_json(wild.url + "/object_info/MeshPass")
    assert info["MeshPass"]["output"] == ["FILE_3D_GLTF", "FILE_3D_FBX", "FILE_3D_OBJ", "FILE_3D_STL", "LOAD_3D"]
    assert info["MeshPass"]["input"]["optional"]["flow"][0] == "FLOW_CONTROL"


# ---------------------------------------------------------------------- defects 6 and 17
def test_comfy_types_io_and_a_type_string_with_its_own_comparison(wild):
    assert reports(wild)["classic_wild"].status == "loaded", reports(wild)["classic_wild"].reason
    ran = run(wild, {"1": {"class_type": "TestConst", "inputs": {"value": 7}},
                     "2": {"class_type": "NumberEcho", "inputs": {"number": ["1", 0]}},
                     "3": {"class_type": "TakesFloatOrInt", "inputs": {"x": ["1", 0]}}})
    assert outputs(ran, "2") == {"number": [7], "blocker": ["execution.types"]}
    assert outputs(ran, "3") == {"x": [7]}


# ---------------------------------------------------------------------- defect 7
def test_linked_inputs_a_node_does_not_declare_reach_it(wild):
    prompt = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
              "2": {"class_type": "TestConst", "inputs": {"value": 10}},
              "3": {"class_type": "TestConst", "inputs": {"value": 100}},
              "4": {"class_type": "Variadic", "inputs": {"input1": ["1", 0], "input2": ["2", 0], "input3": ["3", 0],
                                                         "ignored_constant": 5}}}
    assert outputs(run(wild, prompt), "4") == {"names": ["input1", "input2", "input3"], "total": [111]}


# ---------------------------------------------------------------------- defect 8
def test_hooks_assigned_to_the_class_as_plain_functions_are_called_on_the_class(wild):
    assert outputs(run(wild, {"1": {"class_type": "AssignedHooks", "inputs": {"value": 4}}}), "1") == {"value": [4]}
    status, reply = post_json(wild.url + "/prompt", {"prompt": {"1": {"class_type": "AssignedHooks", "inputs": {"value": 3}}}})
    assert status == 400
    [error] = reply["node_errors"]["1"]["errors"]
    assert error["type"] == "custom_validation_failed" and "value 3 is odd" in error["details"]


# ---------------------------------------------------------------------- defect 9
def test_is_changed_gets_linked_inputs_as_none(wild):
    prompt = {"1": {"class_type": "TestConst", "inputs": {"value": 2}},
              "2": {"class_type": "LinkedFingerprint", "inputs": {"source": ["1", 0], "value": 5}}}
    assert outputs(run(wild, prompt), "2") == {"value": [7]}
    written = json.loads((wild.runtime.paths.output / "fingerprint.json").read_text())
    assert written == {"source": None, "value": 5}


# ---------------------------------------------------------------------- defect 15
def test_hidden_inputs_that_are_ordinary_inputs_get_the_prompt_values(wild):
    prompt = {"9": {"class_type": "HiddenSettings", "inputs": {"frames": 2, "crf": 30, "ten_bit": True}}}
    assert outputs(run(wild, prompt), "9") == {"crf": [30], "ten_bit": [True], "node_id": ["9"]}
    status, info = get_json(wild.url + "/object_info/HiddenSettings")
    assert info["HiddenSettings"]["input"]["hidden"] == {"crf": ["INT", {"default": 23}],
                                                         "ten_bit": ["BOOLEAN", {"default": False}],
                                                         "node_id": "UNIQUE_ID"}


# ---------------------------------------------------------------------- defects 10 and 11
def test_comfyuis_execution_module_and_nodes_names_are_refused_at_load_naming_every_missing_module(wild):
    execution_pack = reports(wild)["imports_execution"]
    assert execution_pack.status == "failed"
    assert "it imports ComfyUI's `execution` module, which Weft does not provide" in execution_pack.reason
    chain = reports(wild)["nodes_import_chain"]
    assert chain.status == "failed"
    assert "cannot import name 'common_ksampler' from 'nodes'" in chain.reason
    assert "missing modules also: 'comfy.sd', 'comfy_extras'" in chain.reason
    import execution

    with pytest.raises(AttributeError, match="ComfyUI's execution.py, which Weft does not provide"):
        execution.validate_prompt


# ---------------------------------------------------------------------- defect 12
def test_preview_any_shows_numpy_scalars_and_0d_tensors_as_values(wild):
    ran = run(wild, {"1": {"class_type": "Scalars", "inputs": {}},
                     "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
                     "3": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}}})
    assert outputs(ran, "2")["text"] == ["3.5"] and outputs(ran, "3")["text"] == ["7"]


# ---------------------------------------------------------------------- defect 14
def test_folder_paths_annotated_filepath_and_folder_names_and_paths(wild):
    shown = outputs(run(wild, {"1": {"class_type": "Folders", "inputs": {"name": "a.png [output]"}}}), "1")
    paths = wild.runtime.paths
    assert shown["plain"] == ["a.png"] and shown["folder"] == [str(paths.output)]
    assert shown["checkpoints"] == [str(paths.models / "checkpoints")]
    # A kind a pack adds is searched in models/<kind> and in the folders it gave.
    assert shown["wild"] == [str(paths.models / "wild_models"), str(reports(wild)["values_wild"].path / "my_models")]
    assert shown["has_loras"] == [True]


# ---------------------------------------------------------------------- defect 16
def test_input_types_is_read_again_for_object_info_and_validation(wild):
    (wild.runtime.paths.input / "added_later.txt").write_text("written after start-up")
    status, info = get_json(wild.url + "/object_info/TextFiles")
    assert "added_later.txt" in info["TextFiles"]["input"]["required"]["text_file"][0]
    ran = outputs(run(wild, {"1": {"class_type": "TextFiles", "inputs": {"text_file": "added_later.txt"}}}), "1")
    assert ran == {"text": ["written after start-up"]}


# ---------------------------------------------------------------------- defect 18
def test_audio_as_any_mapping_is_taken_by_the_audio_nodes(wild):
    ran = run(wild, {"1": {"class_type": "LoadsVideo", "inputs": {}},
                     "2": {"class_type": "SaveAudio", "inputs": {"audio": ["1", 1], "filename_prefix": "wild/audio"}},
                     "3": {"class_type": "PreviewAudio", "inputs": {"audio": ["1", 1]}},
                     "4": {"class_type": "CreateVideo", "inputs": {"images": ["1", 0], "fps": 8.0, "audio": ["1", 1]}},
                     "5": {"class_type": "SaveVideo", "inputs": {"video": ["4", 0], "filename_prefix": "wild/video",
                                                                 "format": "auto", "codec": "auto"}}})
    assert len(outputs(ran, "2")["audio"]) == 1 and len(outputs(ran, "3")["audio"]) == 1
    assert (wild.runtime.paths.output / outputs(ran, "2")["audio"][0]["subfolder"]
            / outputs(ran, "2")["audio"][0]["filename"]).is_file()
    assert outputs(ran, "5")


# ---------------------------------------------------------------------- defect 19
def test_a_video_packs_next_ring_of_imports_is_there_and_works(wild):
    from PIL import Image

    report = reports(wild)["video_ring"]
    assert report.status == "loaded", report.reason
    frames = wild.runtime.paths.input / "frames"
    frames.mkdir(exist_ok=True)
    for index, shade in enumerate((0, 255)):
        Image.new("RGB", (8, 4), (shade, shade, shade)).save(frames / f"f{index}.png")
    ran = outputs(run(wild, {"1": {"class_type": "FramesFolder", "inputs": {"folder": "frames"}}}), "1")
    assert ran["frames"] == [2] and ran["saved"] == [2] and ran["loaded"] == [[1, 4, 8, 3]]
    assert ran["latent"] == [[1, 24, 1, 2, 4]]
    assert ran["previewer"] == [True]  # no VAE loaded: nothing can draw previews, so there is no previewer
    assert ran["functions"] == ["encode", "decode", "encode"]
    status, body = get_json(wild.url + "/video_ring/ping")
    assert status == 200 and body == {"pong": True}


def test_a_folder_kind_of_the_packs_own_lists_the_extensions_it_declared(wild):
    assert reports(wild)["own_folder_kind"].status == "loaded", reports(wild)["own_folder_kind"].reason
    shown = outputs(run(wild, {"1": {"class_type": "ListFormats", "inputs": {}}}), "1")
    assert shown["names"] == ["a.json", "b.yaml"]
    assert shown["extensions"] == [".json", ".pt", ".yaml"]
    assert shown["first"] == [str(reports(wild)["own_folder_kind"].path / "formats" / "a.json")]


def test_a_hidden_section_claiming_every_name_receives_every_constant_of_the_prompt(wild):
    given = {"format": "video/b", "crf": 30, "pix_fmt": "yuv420p10le"}
    shown = outputs(run(wild, {"1": {"class_type": "FormatOptions", "inputs": given}}), "1")
    assert shown == {"options": [[["crf", 30], ["pix_fmt", "yuv420p10le"]]], "node": ["1"]}
    # Another value is another run, not a cached one.
    again = outputs(run(wild, {"1": {"class_type": "FormatOptions", "inputs": {**given, "crf": 12}}}), "1")
    assert again["options"] == [[["crf", 12], ["pix_fmt", "yuv420p10le"]]]
    # A node declaring its inputs plainly gets only those, as in ComfyUI.
    plain = outputs(run(wild, {"1": {"class_type": "DeclaredOnly", "inputs": given}}), "1")
    assert plain == {"options": [[]]}


def test_a_node_reads_the_running_item_and_puts_its_prompt_back_on_the_queue(wild):
    status, reply = post_json(wild.url + "/prompt", {"prompt": {"7": {"class_type": "Requeue", "inputs": {"round": 0}}}})
    assert status == 200, reply
    first = outputs(wait_terminal(wild.url, reply["prompt_id"], timeout=120), "7")
    assert first["running"] == [reply["prompt_id"]] and first["round"] == [0] and first["outputs"] == [["7"]]
    assert first["queued"][0] >= 1
    deadline = time.monotonic() + 120
    again = None
    while again is None and time.monotonic() < deadline:  # the re-queued job: found by its bumped input
        _, history = get_json(wild.url + "/history")
        again = next((record for record in history.values()
                      if record["prompt"][2].get("7", {}).get("inputs") == {"round": 1}
                      and record["status"]["completed"]), None)
        time.sleep(0.2)
    assert again is not None, "the prompt a node put back on the queue did not run"
    assert outputs(again, "7")["round"] == [1]
