"""Plugins through the real command line: a pack in custom_nodes/ is loaded, its nodes listed, its
editor extension served and confined, a V3 pack's nodes listed and run, and a broken pack reported
while the server still starts."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def finished_record(base: str, prompt_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = fetch(f"{base}/api/history/{prompt_id}")
        if status == 200:
            record = json.loads(body).get(prompt_id)
            if record and record["status"]["completed"] is not None and record["status"]["status_str"] != "running":
                return record
        time.sleep(0.2)
    raise AssertionError(f"job {prompt_id} did not finish")


def test_example_pack_served_by_a_real_server(tmp_path):
    custom = tmp_path / "custom_nodes"
    shutil.copytree(ROOT / "examples" / "custom_nodes" / "example_pack", custom / "example_pack")
    shutil.copytree(ROOT / "examples" / "custom_nodes" / "example_v3_pack", custom / "example_v3_pack")
    (custom / "broken_pack.py").write_text("raise RuntimeError('this pack is broken on purpose')\n")
    port = free_port()
    server = subprocess.Popen([sys.executable, "main.py", "--port", str(port), "--base-directory", str(tmp_path)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if fetch(base + "/api/system_stats")[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.3)
        status, body = fetch(base + "/api/extensions")
        urls = json.loads(body)
        assert status == 200 and "/extensions/example_pack/example_pack.js" in urls
        status, script = fetch(base + "/extensions/example_pack/example_pack.js")
        assert status == 200 and script == (ROOT / "examples/custom_nodes/example_pack/web/example_pack.js").read_bytes()
        for escape in ("/extensions/example_pack/..%2f__init__.py", "/extensions/example_pack/%2e%2e/nodes.py",
                       "/extensions/example_pack/..%2f..%2f..%2fmain.py"):
            assert fetch(base + escape)[0] in (403, 404), escape
        info = json.loads(fetch(base + "/api/object_info")[1])
        pack_nodes = [name for name, entry in info.items() if entry["python_module"] == "custom_nodes.example_pack"]
        assert pack_nodes
        v3_nodes = sorted(name for name, entry in info.items() if entry["python_module"] == "custom_nodes.example_v3_pack")
        assert v3_nodes == ["ExampleV3AdjustImage", "ExampleV3InvertImage", "ExampleV3LazySwitch",
                            "ExampleV3PreviewImage", "ExampleV3SumValues"]
        prompt = {"1": {"class_type": "PrimitiveFloat", "inputs": {"value": 0.5}},
                  "2": {"class_type": "ExampleV3SumValues", "inputs": {"values.value0": ["1", 0],
                                                                      "values.value1": ["1", 0]}},
                  "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}
        status, reply = post(base + "/api/prompt", {"prompt": prompt})
        assert status == 200, reply
        record = finished_record(base, reply["prompt_id"])
        assert record["status"]["status_str"] == "success" and record["outputs"]["3"]["text"] == ["1.0"]
        stats = json.loads(fetch(base + "/api/system_stats")[1])
        failed = {entry["name"]: entry for entry in stats["plugins"]["failed"]}
        assert "this pack is broken on purpose" in failed["broken_pack"]["reason"]
    finally:
        server.terminate()
        server.wait(timeout=30)
