"""The custom-node plugin loader: the example pack runs, broken packs are isolated and reported,
editor extensions are listed and confined, and the ComfyUI compatibility modules behave."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from execution import context as run_context
from execution.cache import make_cache
from execution.events import EventBus
from execution.paths import Paths, UnsafePathError
from execution.scheduler import Executor
from execution.validation import validate_prompt
from nodes import plugins
from nodes.registry import builtin_registry
from web.object_info import object_info

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PACK = ROOT / "examples" / "custom_nodes" / "example_pack"
STARTUP = Path(__file__).resolve().parent / "plugin_fixtures" / "startup"

# Every broken fixture plugin and a fragment its reported reason must contain.
BROKEN = {
    "syntax_error": "syntax error: invalid syntax (syntax_error.py:3)",
    "syntax_error_pkg": "syntax error",
    "missing_dependency": "missing module 'weft_fixture_not_installed'",
    "unsupported_comfy_module": "missing module 'comfy.sd'; Weft's compatibility layer provides only",
    "server_missing_attribute": "AttributeError while importing: PromptServer.instance has no attribute "
                                "'user_manager': Weft's compatibility layer does not provide it",
    "missing_chain": "missing modules 'comfy.sd', 'comfy.samplers', 'comfy_extras' (the import stopped at "
                     "'comfy.sd'); Weft's compatibility layer provides only",
    "import_error_name": "cannot import name 'set_output_directory' from 'folder_paths'",
    "comfy_nodes_import": "cannot import name 'common_ksampler' from 'nodes'",
    "relative_missing": "missing module 'custom_nodes.relative_missing.not_here'",
    "raises_at_import": "KeyError while importing: 'threshold' (nodes.py:3)",
    "exits_at_import": "called sys.exit(3) while importing",
    "input_types_raises": "node 'FixtureInputTypesRaises': INPUT_TYPES raised RuntimeError: cannot list inputs",
    "input_types_exits": "SystemExit while declaring nodes: 2 (input_types_exits.py:8)",
    "input_types_not_dict": "INPUT_TYPES: must return a dict, got list",
    "function_missing": "FUNCTION: names no method of the class: 'execute'",
    "return_names_mismatch": "RETURN_NAMES: 2 names for 1 RETURN_TYPES",
    "duplicate_builtin": "node 'PreviewAny' from custom_nodes.duplicate_builtin: id already registered by nodes.primitives",
    "dup_b_second": "id already registered by custom_nodes.dup_a_first",
    "mappings_not_dict": "NODE_CLASS_MAPPINGS must be a dict",
    "entry_raises": "weft_nodes() raised OSError: model folder unreadable",
    "entry_returns_junk": "weft_nodes() item 0 is a str, not a NodeSpec",
    "declares_nothing": "declares no nodes",
    "v3_entrypoint_only": "comfy_entrypoint() returned NoneType, not a comfy_api ComfyExtension",
    "no_init_folder": "folder has no __init__.py",
    "web_dir_escapes": "WEB_DIRECTORY '../../..' is outside the plugin's folder",
}
LOADED = {"good_single": ("FixtureGood",), "slow_import": ("FixtureSlow",), "dup_a_first": ("FixtureShared",),
          "web_only": (), "default_out_of_range": ("FixtureBadDefault",), "unknown_hidden": ("FixtureBadHidden",),
          "partial_pack": ("FixturePartialGood",)}


def run_prompt(registry, paths, prompt, events=None):
    executor = Executor(registry, cache=make_cache("classic"), paths=paths, events=events)
    return executor.run(validate_prompt(prompt, registry), prompt_id=str(uuid.uuid4()))


@pytest.fixture(scope="module")
def startup():
    """The fixture folder loaded once over the built-in nodes: (registry, {name: report})."""
    registry = builtin_registry()
    reports = plugins.load_plugins(registry, [STARTUP], slow_import_seconds=0.25)
    return registry, {r.name: r for r in reports}


# ---------------------------------------------------------------------- the example pack
def test_example_pack_declares_its_nodes_with_its_module_name():
    registry = builtin_registry()
    report = plugins.load_plugin(registry, EXAMPLE_PACK)
    assert report.status == "loaded", report.reason
    assert set(report.node_ids) == {"ExampleGradient", "ExampleInvertImage", "ExampleLazySwitch",
                                    "ExampleSplitText", "ExampleJoinText", "ExamplePreviewImage"}
    info = object_info(registry)
    for node_id in report.node_ids:
        assert info[node_id]["python_module"] == "custom_nodes.example_pack"
        assert registry.origin(node_id) == "custom_nodes.example_pack"
    assert info["ExampleLazySwitch"]["input"]["required"]["first"][1]["lazy"] is True
    assert info["ExampleSplitText"]["output_is_list"] == [True]
    assert info["ExamplePreviewImage"]["output_node"] is True
    assert info["ExampleInvertImage"]["display_name"] == "Invert Image (example)"
    assert report.web_directory == EXAMPLE_PACK / "web"


def test_example_pack_runs_in_a_workflow(paths):
    registry = builtin_registry()
    assert plugins.load_plugin(registry, EXAMPLE_PACK).status == "loaded"
    prompt = {
        "1": {"class_type": "ExampleGradient",
              "inputs": {"width": 8, "height": 4, "left": 0x000000, "right": 0xFFFFFF, "batch_size": 1}},
        "2": {"class_type": "ExampleInvertImage", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "ExampleGradient",
              "inputs": {"width": 16, "height": 16, "left": 0xFF0000, "right": 0x00FF00, "batch_size": 1}},
        "4": {"class_type": "ExampleLazySwitch", "inputs": {"use_first": True, "first": ["2", 0], "second": ["3", 0]}},
        "5": {"class_type": "ExamplePreviewImage", "inputs": {"images": ["4", 0]}},
        "6": {"class_type": "ExampleSplitText", "inputs": {"text": "x, y,,z", "separator": ","}},
        "7": {"class_type": "ExampleJoinText", "inputs": {"pieces": ["6", 0], "separator": "+"}},
        "8": {"class_type": "PreviewAny", "inputs": {"source": ["7", 0]}},
    }
    events = EventBus()
    seen = []
    events.subscribe(lambda event, data: seen.append((event, data)))
    validated = validate_prompt(prompt, registry)
    assert validated.node_errors == {} and sorted(validated.outputs) == ["5", "8"]
    result = run_prompt(registry, paths, prompt, events)
    assert result.status == "success", result.error
    assert "3" not in result.executed  # the lazy switch never asked for its second branch
    assert result.outputs["7"]["text"] == ["x+y+z"]  # the list output reached the list-taking node whole
    images = result.outputs["5"]["images"]
    assert len(images) == 1 and images[0]["type"] == "temp"
    written = np.asarray(Image.open(paths.temp / images[0]["subfolder"] / images[0]["filename"]))
    assert written.shape == (4, 8, 3)
    assert written[0, 0].tolist() == [255, 255, 255] and written[0, -1].tolist() == [0, 0, 0]  # inverted ramp
    progress = [d for e, d in seen if e == "progress" and d["node"] == "5"]
    assert progress and progress[-1]["value"] == progress[-1]["max"] == 1  # comfy.utils.ProgressBar


def test_testing_pack_is_loaded_through_the_plugin_loader(registry):
    assert object_info(registry, "TestAdd")["TestAdd"]["python_module"] == "custom_nodes.nodes_pack"


# ---------------------------------------------------------------------- failure isolation
def test_every_broken_pack_is_reported_and_start_up_continues(startup):
    registry, reports = startup
    assert len(BROKEN) >= 20
    for name, fragment in BROKEN.items():
        report = reports[name]
        assert report.status == "failed", name
        assert fragment in report.reason, (name, report.reason)
        assert report.node_ids == () and report.web_directory is None
        assert report.module not in sys.modules  # nothing of a failed plugin stays imported
    for name, node_ids in LOADED.items():
        assert reports[name].status == "loaded", reports[name].reason
        assert reports[name].node_ids == node_ids
    assert reports["old_pack"].status == "disabled"
    assert set(reports) == set(BROKEN) | set(LOADED) | {"old_pack"}
    # The built-ins and the loaded plugins still work side by side.
    assert registry.origin("PreviewAny") == "nodes.primitives"
    assert registry.origin("FixtureShared") == "custom_nodes.dup_a_first"
    for refused in ("FixturePartialBad", "FixtureEscape", "FixtureInputTypesRaises"):
        assert refused not in registry
    # A node that cannot be declared is refused alone, with a warning naming it; its pack still loads.
    assert reports["partial_pack"].warnings == [
        "node refused: node 'FixturePartialBad': FUNCTION: names no method of the class: 'not_a_method'"]


def test_loaded_fixture_nodes_run(startup, paths):
    registry, _ = startup
    prompt = {"1": {"class_type": "FixtureGood", "inputs": {"value": 4}},
              "2": {"class_type": "FixtureShared", "inputs": {"value": 4}},
              "3": {"class_type": "ComfyMathExpression", "inputs": {"expression": "a + b", "values.a": ["1", 0],
                                                                    "values.b": ["2", 0]}},
              "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 1]}}}
    result = run_prompt(registry, paths, prompt)
    assert result.status == "success", result.error
    assert result.outputs["4"]["text"] == ["20"]  # 4*2 + 4*3 (the first FixtureShared kept its id)


def test_slow_import_is_reported_with_its_time(startup):
    _, reports = startup
    slow = reports["slow_import"]
    assert slow.slow and slow.import_seconds >= 0.3
    assert not reports["good_single"].slow
    assert all(r.import_seconds >= 0 for r in reports.values())
    assert plugins.failures(reports.values())[0].keys() == {"name", "path", "reason", "import_seconds"}


def test_one_log_line_names_each_failed_plugin_and_its_reason(caplog):
    caplog.set_level(logging.INFO, logger="nodes.plugins")
    plugins.load_plugins(builtin_registry(), [STARTUP], slow_import_seconds=0.25)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name, fragment in BROKEN.items():
        lines = [w for w in warnings if w.startswith(f"custom node plugin '{name}' ")]
        assert len(lines) == 1 and fragment in lines[0], (name, lines)
    assert any("'slow_import' took" in w and "s to import (slow)" in w for w in warnings)
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("import times")]
    assert len(summary) == 1 and "slow_import" in summary[0] and "syntax_error (FAILED)" in summary[0]


def test_override_lets_the_later_plugin_replace_a_node():
    registry = builtin_registry()
    first = plugins.load_plugin(registry, STARTUP / "dup_a_first.py")
    second = plugins.load_plugin(registry, STARTUP / "dup_b_second.py", allow_override=True)
    assert first.status == second.status == "loaded"
    assert registry.origin("FixtureShared") == "custom_nodes.dup_b_second"
    assert second.warnings == ["node 'FixtureShared' replaces the one from custom_nodes.dup_a_first"]


def test_same_plugin_name_in_two_folders_is_refused(tmp_path):
    other = tmp_path / "more_nodes"
    other.mkdir()
    (other / "good_single.py").write_text((STARTUP / "good_single.py").read_text())
    registry = builtin_registry()
    reports = plugins.load_plugins(registry, [STARTUP, other])
    clash = [r for r in reports if r.name == "good_single"]
    assert [r.status for r in clash] == ["loaded", "failed"]
    assert f"already loaded from {STARTUP / 'good_single.py'}" in clash[1].reason


def test_reload_re_imports_a_package_from_scratch(tmp_path):
    pack = tmp_path / "reload_pack"
    pack.mkdir()
    (pack / "__init__.py").write_text("from .nodes import NODE_CLASS_MAPPINGS\n")
    (pack / "nodes.py").write_text((STARTUP / "good_single.py").read_text())
    assert plugins.load_plugin(builtin_registry(), pack).status == "loaded"
    (pack / "nodes.py").write_text("raise RuntimeError('edited')\n")
    report = plugins.load_plugin(builtin_registry(), pack)
    assert report.status == "failed" and "RuntimeError while importing: edited (nodes.py:1)" in report.reason


def _self_importing_pack(folder: Path, name: str) -> Path:
    pack = folder / name
    pack.mkdir(parents=True)
    (pack / "__init__.py").write_text(f"from {name}.nodes import NODE_CLASS_MAPPINGS\n")
    (pack / "nodes.py").write_text((STARTUP / "good_single.py").read_text())
    return pack


def test_a_pack_imports_itself_by_its_folder_name(tmp_path):
    pack = _self_importing_pack(tmp_path, f"self_pack_{uuid.uuid4().hex[:8]}")
    report = plugins.load_plugin(builtin_registry(), pack)
    assert report.status == "loaded" and report.alias == pack.name and report.warnings == []
    assert sys.modules[pack.name] is sys.modules[plugins.module_name_for(pack.name)]
    assert importlib.import_module(f"{pack.name}.nodes").FixtureGood(  # the pack's own submodule, by name
        ).run(4) == (8,)
    (pack / "nodes.py").write_text("raise RuntimeError('edited')\n")
    assert plugins.load_plugin(builtin_registry(), pack).status == "failed"
    assert pack.name not in sys.modules  # a failed re-load leaves no alias behind


@pytest.mark.parametrize("name, why", [("execution", "one of Weft's own top-level modules"),
                                       ("json", "a module named 'json' is already imported")])
def test_a_clashing_folder_name_refuses_the_alias_but_loads_the_pack(tmp_path, caplog, name, why):
    import json

    own = sys.modules[name]
    pack = tmp_path / name
    pack.mkdir()
    (pack / "__init__.py").write_text("from .nodes import NODE_CLASS_MAPPINGS\n")
    (pack / "nodes.py").write_text((STARTUP / "good_single.py").read_text().replace("FixtureGood", "FixtureClash"))
    caplog.set_level(logging.INFO, logger="nodes.plugins")
    registry = builtin_registry()
    [report] = plugins.load_plugins(registry, [tmp_path])
    assert report.status == "loaded" and report.alias == "" and "FixtureClash" in registry
    assert sys.modules[name] is own and json.dumps([1]) == "[1]"
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(line.startswith(f"custom node plugin '{name}': not importable as '{name}'") and why in line
               for line in lines), lines


def test_a_node_of_a_pack_that_failed_to_load_is_reported_with_the_pack_and_its_failure(tmp_path, startup):
    from execution.convert import ui_to_api
    from execution.errors import PromptError

    pack = tmp_path / "needs_server"
    pack.mkdir()
    (pack / "__init__.py").write_text("import comfy.sd\nfrom .nodes import NODE_CLASS_MAPPINGS\n")
    (pack / "nodes.py").write_text("NODE_CLASS_MAPPINGS = {'FixtureNeedsServer': object}\n")
    registry = builtin_registry()
    [report] = plugins.load_plugins(registry, [tmp_path])
    assert report.status == "failed"
    prompt = {"1": {"class_type": "FixtureNeedsServer", "inputs": {}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    with pytest.raises(PromptError) as info:
        validate_prompt(prompt, registry)
    error = info.value.to_json()["error"]
    assert error["type"] == "missing_node_type"
    assert ("node type 'FixtureNeedsServer' is not registered; it comes from the custom node pack "
            "'needs_server', which failed to load: missing module 'comfy.sd'") in error["message"]
    assert error["extra_info"]["pack"] == "needs_server" and error["extra_info"]["pack_error"] == report.reason
    # A UI-format workflow is traced the same way, and an unrelated unknown type blames no pack.
    ui = {"nodes": [{"id": 1, "type": "FixtureNeedsServer", "mode": 0}, {"id": 2, "type": "NoSuchType", "mode": 0}],
          "links": []}
    with pytest.raises(PromptError) as info:
        ui_to_api(ui, registry)
    missing = {m["class_type"]: m for m in info.value.extra_info["missing"]}
    assert "'needs_server', which failed to load" in info.value.message
    assert missing["FixtureNeedsServer"]["pack"] == "needs_server" and "pack" not in missing["NoSuchType"]
    # A pack that imported but whose nodes were refused is traced by its mapping keys; a node refused
    # alone, by its own refusal.
    startup_registry, reports = startup
    cause = startup_registry.missing_cause("FixtureInputTypesRaises")
    assert cause == {"source": "input_types_raises", "reason": reports["input_types_raises"].reason}
    cause = startup_registry.missing_cause("FixturePartialBad")
    assert cause == {"source": "partial_pack", "reason": reports["partial_pack"].warnings[0].removeprefix("node refused: ")}
    assert startup_registry.missing_cause("NoSuchType") is None
    # Once the pack loads (its missing module now there), it is no longer blamed.
    (pack / "__init__.py").write_text("from .nodes import NODE_CLASS_MAPPINGS\n")
    (pack / "nodes.py").write_text((STARTUP / "good_single.py").read_text().replace("FixtureGood", "FixtureNeedsServer"))
    assert plugins.load_plugin(registry, pack).status == "loaded"
    assert registry.missing_cause("FixtureNeedsServer") is None


# ---------------------------------------------------------------------- command line and runtime
@pytest.fixture
def restore_runtime():
    saved = list(run_context._configured)
    yield
    run_context._configured[:] = saved
    try:
        from models import memory

        memory.unconfigure()
    except ImportError:
        pass


def make_runtime(tmp_path, *flags):
    import main

    parser = argparse.ArgumentParser()
    main.add_common_arguments(parser)
    return main.Runtime(parser.parse_args(["--base-directory", str(tmp_path), *flags]))


def test_runtime_loads_base_and_extra_folders_and_honours_the_disable_flags(tmp_path, restore_runtime):
    (tmp_path / "custom_nodes").mkdir()
    (tmp_path / "custom_nodes" / "base_pack.py").write_text(
        (STARTUP / "good_single.py").read_text().replace("FixtureGood", "FixtureBase"))
    runtime = make_runtime(tmp_path, "--custom-nodes-directory", str(STARTUP), "--disable-custom-node", "good_single")
    reports = {r.name: r for r in runtime.plugin_reports}
    assert runtime.plugin_reports[0].name == "base_pack"  # <base>/custom_nodes first
    assert reports["base_pack"].status == "loaded" and "FixtureBase" in runtime.registry
    assert reports["good_single"].status == "disabled" and "FixtureGood" not in runtime.registry
    assert reports["slow_import"].status == "loaded" and reports["syntax_error"].status == "failed"

    runtime = make_runtime(tmp_path, "--custom-nodes-directory", str(STARTUP), "--disable-all-custom-nodes")
    assert {r.status for r in runtime.plugin_reports} == {"disabled"}
    assert "FixtureBase" not in runtime.registry and "PreviewAny" in runtime.registry

    runtime = make_runtime(tmp_path, "--custom-nodes-directory", str(STARTUP), "--allow-node-override")
    assert runtime.registry.origin("PreviewAny") == "custom_nodes.duplicate_builtin"


# ---------------------------------------------------------------------- editor extensions
def test_extension_js_is_listed_and_served(startup):
    _, reports = startup
    web_dirs = plugins.web_directories(reports.values())
    assert web_dirs == {"web_only": STARTUP / "web_only" / "js"}
    assert plugins.extension_urls(web_dirs) == ["/extensions/web_only/main.js", "/extensions/web_only/sub/more.js"]
    assert plugins.extension_file(web_dirs, "web_only", "sub/more.js").read_text().startswith("// nested")
    assert plugins.extension_file(web_dirs, "web_only", "style.css").name == "style.css"
    with pytest.raises(FileNotFoundError):
        plugins.extension_file(web_dirs, "web_only", "absent.js")
    with pytest.raises(KeyError):
        plugins.extension_file(web_dirs, "web_dir_escapes", "x.js")  # a failed plugin serves nothing


@pytest.mark.parametrize("name", ["../secret.txt", "../../good_single.py", "sub/../../secret.txt", "/etc/passwd",
                                  "..\\secret.txt", "main.js\x00.png", ".."])
def test_extension_path_traversal_is_refused(startup, name):
    _, reports = startup
    with pytest.raises(UnsafePathError):
        plugins.extension_file(plugins.web_directories(reports.values()), "web_only", name)


def test_extension_symlink_leaving_the_folder_is_neither_listed_nor_served(tmp_path):
    outside = tmp_path / "outside.js"
    outside.write_text("secret")
    web = tmp_path / "pack" / "web"
    web.mkdir(parents=True)
    (web / "ok.js").write_text("ok")
    (web / "leak.js").symlink_to(outside)
    assert plugins.extension_urls({"pack": web}) == ["/extensions/pack/ok.js"]
    with pytest.raises(UnsafePathError):
        plugins.extension_file({"pack": web}, "pack", "leak.js")


def test_example_pack_extension_is_listed():
    report = plugins.load_plugin(builtin_registry(), EXAMPLE_PACK)
    assert plugins.extension_urls(plugins.web_directories([report])) == ["/extensions/example_pack/example_pack.js"]


# ---------------------------------------------------------------------- the compatibility layer
@pytest.fixture
def compat(tmp_path, restore_runtime):
    """The compat modules with the configured folders pointing at a fresh base folder."""
    plugins.enable_compat()
    paths = Paths(tmp_path).ensure()
    run_context.configure(paths)
    return paths


def test_folder_paths_answers_from_the_configured_folders(compat):
    import folder_paths

    (compat.models / "loras" / "sub").mkdir(parents=True, exist_ok=True)
    (compat.models / "loras" / "sub" / "style.safetensors").write_bytes(b"x")
    (compat.models / "loras" / "old.ckpt").write_bytes(b"x")
    assert folder_paths.get_filename_list("loras") == ["sub/style.safetensors"]  # safetensors only
    assert folder_paths.get_full_path("loras", "sub/style.safetensors") == str(compat.models / "loras/sub/style.safetensors")
    assert folder_paths.get_full_path("loras", "../loras/old.ckpt") is None
    with pytest.raises(FileNotFoundError):
        folder_paths.get_full_path_or_raise("loras", "absent.safetensors")
    with pytest.raises(KeyError, match="unknown model folder 'nonsense'"):
        folder_paths.get_filename_list("nonsense")
    extra = compat.base / "elsewhere"
    extra.mkdir()
    (extra / "more.safetensors").write_bytes(b"x")
    folder_paths.add_model_folder_path("loras", str(extra))
    assert folder_paths.get_filename_list("loras") == ["more.safetensors", "sub/style.safetensors"]
    assert folder_paths.get_filename_list("clip") == []  # old name of text_encoders
    assert folder_paths.get_output_directory() == str(compat.output) == folder_paths.output_directory
    assert folder_paths.get_directory_by_type("temp") == str(compat.temp)
    assert folder_paths.get_directory_by_type("models") is None
    assert folder_paths.get_annotated_filepath("a.png [output]") == str(compat.output / "a.png")
    assert folder_paths.get_annotated_filepath("a.png") == str(compat.input / "a.png")
    with pytest.raises(UnsafePathError):
        folder_paths.get_annotated_filepath("../../etc/passwd [output]")
    assert folder_paths.exists_annotated_filepath("../x.png") is False
    assert folder_paths.filter_files_content_types(["a.png", "b.txt", "c.mp4"], ["image", "video"]) == ["a.png", "c.mp4"]


def test_folder_paths_accepts_an_absolute_path_inside_a_readable_folder_only(compat, tmp_path):
    import os

    import folder_paths

    (compat.input / "sub").mkdir()
    (compat.input / "sub" / "cat.png").write_bytes(b"x")
    inside = str(compat.input / "sub" / "cat.png")
    assert folder_paths.get_annotated_filepath(inside) == inside  # as ComfyUI returns it
    assert folder_paths.exists_annotated_filepath(inside) is True
    made = str(compat.output / "made.png")
    assert folder_paths.get_annotated_filepath(made) == made  # the output folder may be read too
    assert folder_paths.get_annotated_filepath(made + " [output]") == made
    outside = tmp_path.parent / f"{tmp_path.name}_elsewhere.png"
    for name in (str(outside), "/etc/passwd", str(compat.input / ".." / "escape.png"), str(compat.models / "a.png")):
        with pytest.raises(UnsafePathError):
            folder_paths.get_annotated_filepath(name)
        assert folder_paths.exists_annotated_filepath(name) is False
    with pytest.raises(UnsafePathError):
        folder_paths.get_annotated_filepath(made + " [temp]")  # annotated: only that folder
    # A symlink inside the input folder that points out of it is refused, absolute or not.
    os.symlink("/etc", compat.input / "link")
    for name in (str(compat.input / "link" / "passwd"), "link/passwd"):
        with pytest.raises(UnsafePathError, match="outside"):
            folder_paths.get_annotated_filepath(name)


def test_folder_paths_save_path_counts_up_and_stays_inside(compat):
    import folder_paths

    out = folder_paths.get_output_directory()
    folder, stem, counter, subfolder, _ = folder_paths.get_save_image_path("shots/run_%width%", out, 64, 32)
    assert (Path(folder), stem, counter, subfolder) == (compat.output / "shots", "run_64", 1, "shots")
    (Path(folder) / "run_64_00007_.png").write_bytes(b"x")
    (Path(folder) / "run_64_extra_00009_.png").write_bytes(b"x")
    assert folder_paths.get_save_image_path("shots/run_%width%", out, 64, 32)[2] == 8
    with pytest.raises(UnsafePathError):
        folder_paths.get_save_image_path("../escape", out)


def test_progress_bar_reports_to_the_running_node_and_stops_when_interrupted(compat):
    import comfy.utils

    seen = []
    interrupted = [False]

    def emit(event, data):  # as the executor does: a step's preview travels inside its progress event
        seen.extend(data.pop(run_context.SHOWN_KEY, ()))
        seen.append((event, data))

    ctx = run_context.RunContext("job", "7", "7", compat, emit=emit, is_interrupted=lambda: interrupted[0])
    token = run_context.activate(ctx)
    try:
        bar = comfy.utils.ProgressBar(4)
    finally:
        run_context.deactivate(token)
    bar.update(1)  # outside the node call: still its node (the bar captured it)
    bar.update_absolute(3, preview=("JPEG", "image", 512))
    assert [(d["node"], d["value"], d["max"]) for e, d in seen if e == "progress"] == [("7", 1, 4), ("7", 3, 4)]
    assert [d["image"] for e, d in seen if e == "preview"] == [("JPEG", "image", 512)]
    interrupted[0] = True
    import comfy.model_management as mm

    with pytest.raises(mm.InterruptProcessingException):
        bar.update(1)


def test_comfy_utils_tensor_helpers(compat):
    import comfy.utils

    samples = torch.rand(2, 4, 8, 12)  # (B, C, H, W): a latent-like tensor
    assert comfy.utils.common_upscale(samples, 6, 4, "nearest-exact", "disabled").shape == (2, 4, 4, 6)
    cropped = comfy.utils.common_upscale(samples, 8, 8, "bilinear", "center")
    assert cropped.shape == (2, 4, 8, 8)
    assert torch.allclose(cropped, comfy.utils.common_upscale(samples[..., 2:10], 8, 8, "bilinear", "disabled"))
    with pytest.raises(ValueError, match="unknown upscale method 'sinc'"):
        comfy.utils.common_upscale(samples, 4, 4, "sinc", "disabled")
    assert comfy.utils.repeat_to_batch_size(torch.arange(3), 7).tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert comfy.utils.repeat_to_batch_size(torch.arange(3), 2).tolist() == [0, 1]


def test_comfy_utils_loads_safetensors_and_refuses_pickles(compat, tmp_path):
    import comfy.utils

    path = tmp_path / "weights.safetensors"
    comfy.utils.save_torch_file({"w": torch.ones(2, 3)}, path, metadata={"kind": "test"})
    tensors, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    assert torch.equal(tensors["w"], torch.ones(2, 3)) and metadata == {"kind": "test"}
    (tmp_path / "weights.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="Weft loads only safetensors"):
        comfy.utils.load_torch_file(str(tmp_path / "weights.ckpt"))


def test_model_management_and_node_helpers(compat):
    import comfy.model_management as mm
    import node_helpers
    from models import memory

    assert mm.get_torch_device() == memory.compute_device()
    assert mm.intermediate_device() == torch.device("cpu")
    assert mm.get_free_memory(torch.device("cpu")) > 0
    assert mm.processing_interrupted() is False
    mm.throw_exception_if_processing_interrupted()  # nothing running: no interruption
    assert node_helpers.string_to_torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype string 'fp8'"):
        node_helpers.string_to_torch_dtype("fp8")
    assert node_helpers.hasher()(b"x").hexdigest() == importlib.import_module("hashlib").sha256(b"x").hexdigest()
    image = compat.input / "a.png"
    Image.new("RGB", (2, 2)).save(image)
    assert node_helpers.pillow(Image.open, image).size == (2, 2)


def test_only_the_documented_comfy_modules_exist(compat):
    importlib.import_module("comfy.utils")
    with pytest.raises(ModuleNotFoundError, match="comfy.samplers"):
        importlib.import_module("comfy.samplers")


def test_the_example_packs_are_loaded_only_when_asked_for():
    """A server's default plugin folder (<base>/custom_nodes) ships empty: the example packs live in
    examples/custom_nodes and load with --custom-nodes-directory."""
    import subprocess

    try:
        shipped = subprocess.run(["git", "ls-files", "custom_nodes"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    assert shipped == ["custom_nodes/README.md"]
    assert (EXAMPLE_PACK / "__init__.py").is_file()
