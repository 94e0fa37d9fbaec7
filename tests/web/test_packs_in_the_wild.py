"""Node packs written the way packs are written in the wild (issue 31): each pack below reproduces one
thing real packs do, is written into a scratch `custom_nodes/` unchanged, and is loaded and run by one
real server whose jobs run in a worker process."""
from __future__ import annotations

import json
import sys
import textwrap
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
