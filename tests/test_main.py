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
    assert missing.returncode != 0 and "does not exist" in missing.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad = run_cli("run", broken, "--base-directory", tmp_path)
    assert bad.returncode != 0 and "not valid JSON" in bad.stderr


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
    (line,) = done.stderr.strip().splitlines()  # one line for a person
    assert "'nosuchinput'" in line and "ImageScale" in line and "width" in line and "height" in line
    done = run_cli("run", "workflows/default.json", "--base-directory", tmp_path, "--set", "2.nosuchinput=3", "--json")
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


# ---------------------------------------------------------------------- templates by name, --set by title
def test_templates_lists_weft_and_official_templates_grouped():
    done = run_cli("templates", "h3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Weft (workflows/):" and "  h3_t2va" in lines
    video = lines.index("Video (official):")
    assert any(line.split()[0] == "video_minimax_h3_t2v" for line in lines[video + 1:] if line.startswith("  "))
    assert run_cli("templates", "no_such_words_anywhere").returncode == 1


def test_templates_write_examples_writes_the_pictures_the_h3_templates_load_and_keeps_existing_ones(tmp_path):
    from PIL import Image

    from execution.templates import example_input_names

    names = [n for n in example_input_names() if "/" not in n and "\\" not in n]
    assert names, "the official H3 templates load example pictures"
    kept = tmp_path / names[0]
    kept.write_bytes(b"a user's own picture")
    done = run_cli("templates", "--write-examples", tmp_path)
    assert done.returncode == 0, done.stderr
    assert kept.read_bytes() == b"a user's own picture"
    for name in names[1:]:
        with Image.open(tmp_path / name) as picture:
            assert picture.size == (96, 64)


def test_validate_and_show_inputs_by_template_name_and_set_by_title_and_subgraph_widget(tmp_path):
    shown = run_cli("validate", "video_minimax_h3_t2v", "--base-directory", tmp_path, "--show-inputs",
                    "--set", "Resolution Selector.megapixels=0.1", "--set", "duration=0.2")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    rows = {line.split()[1]: line for line in shown.stdout.splitlines()[1:]}
    assert "140:133.value" in rows["duration"] and " 0.2 " in rows["duration"]
    assert " 0.1 " in rows["115.megapixels"] and "(Resolution Selector)" in rows["115.megapixels"]
    assert "turbo_steps" in rows and "audio_vae" in rows
    # Validation by name on an empty base: it gets as far as the missing model files.
    checked = run_cli("validate", "video_minimax_h3_t2v.json", "--base-directory", tmp_path, "--set", "duration=0.2")
    assert checked.returncode == 2 and "minimax_h3_fl2va_pruned_int8_convrot" in checked.stdout
    unknown = run_cli("run", "video_minimax_h3_t2", "--base-directory", tmp_path)
    assert unknown.returncode == 2
    assert "no template is called that" in unknown.stderr and "video_minimax_h3_t2v" in unknown.stderr
    wrong = run_cli("validate", "video_minimax_h3_t2v", "--base-directory", tmp_path, "--set", "lenght=3")
    assert wrong.returncode == 2 and "duration" in wrong.stderr and "--show-inputs" in wrong.stderr


def test_parse_set_addresses_titles_and_subgraph_widgets():
    import main
    from execution.convert import ExposedWidget
    from execution.errors import PromptError

    prompt = {"1": {"class_type": "X", "inputs": {"a": 1}, "_meta": {"title": "Size.Picker"}},
              "2": {"class_type": "X", "inputs": {"a": 1}, "_meta": {"title": "Twin"}},
              "3": {"class_type": "X", "inputs": {"a": 1}, "_meta": {"title": "Twin"}},
              "9:4": {"class_type": "X", "inputs": {"v": 1}}, "9:5": {"class_type": "X", "inputs": {"v": 1}}}
    exposed = [ExposedWidget("9", "Inner", "value_1", "duration", 1, [("9:4", "v"), ("9:5", "v")])]
    main.parse_set(["Size.Picker.a=5", "duration=2.5", "Inner.value_1=[1, 2]"][:2], prompt, exposed=exposed)
    assert prompt["1"]["inputs"]["a"] == 5 and prompt["9:4"]["inputs"]["v"] == prompt["9:5"]["inputs"]["v"] == 2.5
    main.parse_set(["Inner.duration=3"], prompt, exposed=exposed)
    assert prompt["9:5"]["inputs"]["v"] == 3
    with pytest.raises(PromptError, match="2 nodes are titled 'Twin'"):
        main.parse_set(["Twin.a=1"], prompt, exposed=exposed)


def test_a_missing_input_picture_is_one_line_naming_the_file_the_folder_and_how_to_provide_it(tmp_path):
    done = run_cli("run", "video_minimax_h3_i2v", "--base-directory", tmp_path, "--set", "duration=0.2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert all(line.startswith("error: node ") for line in lines), lines  # one line per failing input
    (picture,) = [line for line in lines if "transparent_rgb_gaming_mouse.png" in line]
    assert "(LoadImage), input 'image'" in picture and f"searched folder: {tmp_path.resolve() / 'input'}" in picture
    assert "upload it in the editor" in picture


def test_run_prints_a_warning_line_for_a_faulty_sound(tmp_path):
    import math

    import torch

    from media.audio import write_flac

    (tmp_path / "input").mkdir()
    t = torch.arange(8000) / 16000
    left = 0.4 * torch.sin(2 * math.pi * 300 * t)
    write_flac(tmp_path / "input" / "flipped.flac", torch.stack([left, -left]), 16000)
    prompt = {"1": {"class_type": "LoadAudio", "inputs": {"audio": "flipped.flac"}},
              "2": {"class_type": "SaveAudio", "inputs": {"audio": ["1", 0], "filename_prefix": "take"}}}
    path = tmp_path / "sound.json"
    path.write_text(json.dumps(prompt))
    done = run_cli("run", path, "--base-directory", tmp_path)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert line.startswith("warning: node 2 (SaveAudio) take_00001_.flac: channels 1 and 2 correlate at -1.00")
    report = run_cli("run", path, "--base-directory", tmp_path, "--json")
    (entry,) = json.loads(report.stdout.strip().splitlines()[-1])["outputs"]["2"]["audio_health"]
    assert entry["file"] == "take_00002_.flac" and not entry["healthy"]


def test_several_workflows_run_in_one_process_and_the_later_ones_reuse_the_earlier_results(tmp_path):
    done = run_cli("run", "workflows/default.json", "workflows/default.json", "--base-directory", tmp_path, "--json",
                   "--profile-json", tmp_path / "profiles.json")
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert first["status"] == second["status"] == "success" and first["prompt_id"] != second["prompt_id"]
    assert not any(row["cached"] for row in first["profile"].values())
    assert all(row["cached"] for row in second["profile"].values())  # nothing changed: all of it from the cache
    assert json.loads((tmp_path / "profiles.json").read_text()) == [first["profile"], second["profile"]]


def test_several_workflows_stop_at_the_first_that_cannot_run(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"1": {"class_type": "NoSuchNode", "inputs": {}}}))
    done = run_cli("run", "workflows/default.json", broken, "workflows/default.json", "--base-directory", tmp_path)
    assert done.returncode == 2
    assert done.stdout.count("wall ms") == 1 and "NoSuchNode" in done.stderr
