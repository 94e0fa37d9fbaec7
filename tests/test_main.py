"""The headless runner through its command line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "main.py", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_default_workflow_runs_and_reports_files(tmp_path):
    done = run_cli("run", "workflows/default.json", "--base-directory", tmp_path, "--json",
                   "--profile-json", tmp_path / "profile.json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "success" and report["prompt_id"]
    assert report["files"] and all(Path(f).is_file() for f in report["files"])
    assert all(Path(f).resolve().is_relative_to(tmp_path.resolve() / "output") for f in report["files"])
    assert report["profile"] and json.loads((tmp_path / "profile.json").read_text()) == report["profile"]


def test_set_overrides_an_input(tmp_path):
    done = run_cli("run", "workflows/default.json", "--base-directory", tmp_path, "--json", "--set", "2.width=64",
                   "--set", "2.height=32")
    assert done.returncode == 0, done.stderr
    from PIL import Image

    path = json.loads(done.stdout.strip().splitlines()[-1])["files"][0]
    assert Image.open(path).size == (64, 32)


def test_text_mode_prints_written_paths_and_time_table(tmp_path):
    done = run_cli("run", "workflows/default.json", "--base-directory", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote " in done.stdout and "wall ms" in done.stdout


def test_invalid_workflow_exits_nonzero_with_structured_error(tmp_path):
    prompt = {"1": {"class_type": "EmptyImage", "inputs": {"width": 0, "height": 8, "batch_size": 1, "color": 0}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(prompt))
    done = run_cli("run", path, "--base-directory", tmp_path, "--json")
    assert done.returncode != 0
    body = json.loads(done.stdout)
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"]["errors"][0]["type"] == "value_smaller_than_min"
    checked = run_cli("validate", path, "--base-directory", tmp_path)
    assert checked.returncode != 0 and json.loads(checked.stdout)["node_errors"]


def test_validate_accepts_the_default_workflow(tmp_path):
    done = run_cli("validate", "workflows/default.json", "--base-directory", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["valid"] is True


def test_missing_file_and_bad_json_are_reported(tmp_path):
    missing = run_cli("run", tmp_path / "nope.json", "--base-directory", tmp_path)
    assert missing.returncode != 0 and "does not exist" in missing.stdout
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad = run_cli("run", broken, "--base-directory", tmp_path)
    assert bad.returncode != 0 and "not valid JSON" in bad.stdout


def test_ui_workflow_with_subgraphs_bypass_and_mute_runs_headless(tmp_path):
    """A UI file of core nodes with nested subgraphs, a bypassed instance and a muted node."""
    done = run_cli("run", "tests/execution/ui_workflows/core_subgraph.json", "--base-directory", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["status"] == "success", report["error"]
    saved = {node: ui["images"][0]["filename"] for node, ui in report["outputs"].items() if "images" in ui}
    assert saved["10:22"].startswith("linked-prefix_") and saved["11:22"].startswith("second_")
    assert report["outputs"]["4"]["text"] == ["200"]
    assert all(Path(f).is_file() for f in report["files"])


@pytest.mark.parametrize("command", [[], ["run"], ["validate"]], ids=["server", "run", "validate"])
def test_help_imports_neither_torch_nor_a_node_pack(command):
    probe = ("import sys, main\n"
             "try:\n    main.main(sys.argv[1:] + ['--help'])\nexcept SystemExit:\n    pass\n"
             "from nodes import BUILTIN_PACKS\n"
             "heavy = [m for m in ('torch', 'aiohttp', *BUILTIN_PACKS) if m in sys.modules]\n"
             "print('HEAVY', heavy)\n")
    done = subprocess.run([sys.executable, "-c", probe, *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: main.py" in done.stdout and "HEAVY []" in done.stdout


def test_every_flag_has_help_and_validate_lists_only_what_it_uses():
    import main

    parsers = {"server": main.server_parser(), "run": main.run_parser(), "validate": main.validate_parser()}
    for name, parser in parsers.items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings or action.dest)
    validate_flags = {flag for action in parsers["validate"]._actions for flag in action.option_strings}
    assert {"--set", "--base-directory", "--input-directory", "--custom-nodes-directory"} <= validate_flags
    for flag in ("--cache-ram", "--cache-none", "--vram-budget", "--lowvram", "--fast", "--disable-fused-kernels",
                 "--output-directory", "--temp-directory", "--profile-json"):
        assert flag not in validate_flags, flag


def test_set_naming_an_undeclared_input_is_refused_with_the_node_inputs(tmp_path):
    done = run_cli("run", "workflows/default.json", "--base-directory", tmp_path, "--set", "2.nosuchinput=3")
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert "'nosuchinput'" in error["message"] and "ImageScale" in error["message"]
    assert "width" in error["details"] and "height" in error["details"]


def test_validate_warns_about_a_workflow_files_undeclared_inputs(tmp_path):
    prompt = json.loads((ROOT / "workflows" / "default.json").read_text())
    prompt = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0,
                                                           "colour": 3}},
              "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "x"}}}
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(prompt))
    done = run_cli("validate", path, "--base-directory", tmp_path / "base")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["valid"] and len(report["warnings"]) == 1 and "'colour'" in report["warnings"][0]
    assert "warning:" in done.stderr and "'colour'" in done.stderr


def test_validate_creates_nothing(tmp_path):
    base = tmp_path / "base"
    missing = run_cli("validate", tmp_path / "nope.json", "--base-directory", base)
    assert missing.returncode == 2 and "does not exist" in missing.stdout
    fine = run_cli("validate", "workflows/default.json", "--base-directory", base)
    assert fine.returncode == 0, fine.stdout + fine.stderr
    assert not base.exists()


def test_loader_errors_on_an_empty_base_say_how_to_get_models(tmp_path):
    done = run_cli("validate", "workflows/h3_t2va.json", "--base-directory", tmp_path)
    assert done.returncode == 2
    errors = json.loads(done.stdout)["node_errors"]
    unet = errors["1"]["errors"][0]["message"]
    models = tmp_path.resolve() / "models"
    assert f"python -m models.h3.make_tiny --models-dir {models}" in unet
    assert str(models / "diffusion_models") in unet
