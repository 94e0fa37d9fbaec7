"""The HTTP protocol: every route bare and under /api, in ComfyUI's shapes, against a real server."""
from __future__ import annotations

import io
import json
import re
import time
import uuid
from pathlib import Path

import pytest
from PIL import Image

from tests.web.conftest import const_prompt, get_json, http, new_id, post_json, wait_terminal
from tests.web.serve import ServerThread

ROOT = Path(__file__).resolve().parents[2]

EDITOR_START_ROUTES = [
    "/users", "/settings", "/extensions", "/object_info", "/system_stats", "/features", "/i18n",
    "/userdata?dir=workflows&recurse=true&split=false&full_info=true",
    "/userdata?dir=subgraphs&recurse=true&split=false&full_info=true", "/global_subgraphs",
    "/experiment/models", "/embeddings", "/models", "/jobs?status=in_progress,pending&limit=200&offset=0",
    "/jobs?status=completed,failed,cancelled&limit=64&offset=0", "/prompt", "/queue", "/history",
    "/userdata/comfy.templates.json", "/userdata/user.css", "/internal/folder_paths", "/workflow_templates",
    "/internal/files/input",  # the assets panel's imported files
]


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart/form-data body and its content type."""
    boundary = uuid.uuid4().hex
    out = io.BytesIO()
    for name, value in fields.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, data, content_type) in files.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                  f"Content-Type: {content_type}\r\n\r\n".encode())
        out.write(data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def png_bytes(width: int = 8, height: int = 6, mode: str = "RGBA", color=(10, 20, 30, 128)) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def upload(url: str, filename: str, data: bytes, *, route: str = "/upload/image", **fields) -> tuple[int, dict]:
    body, content_type = multipart(fields, {"image": (filename, data, "application/octet-stream")})
    status, _, reply = http("POST", url + route, raw=body, headers={"Content-Type": content_type})
    return status, json.loads(reply) if reply.startswith(b"{") else {"raw": reply}


@pytest.mark.parametrize("prefix", ["", "/api"])
def test_editor_start_routes_answer_bare_and_under_api(server, prefix):
    for route in EDITOR_START_ROUTES:
        status, _, body = http("GET", server.url + prefix + route)
        assert status == 200, (prefix + route, status, body[:300])


def test_index_and_static_assets_come_from_the_frontend_package(server):
    status, headers, body = http("GET", server.url + "/")
    assert status == 200 and body.lstrip().lower().startswith(b"<!doctype html")
    asset = next(p for p in (server.state.front_end_root / "assets").iterdir() if p.suffix == ".js")
    status, headers, body = http("GET", f"{server.url}/assets/{asset.name}")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert http("GET", server.url + "/assets/not-there.js")[0] == 404
    assert http("GET", server.url + "/api/not-a-route")[0] == 404


def test_extensions_list_ours_and_plugins(server, tmp_path):
    plugin_web = tmp_path / "plugin_web"
    (plugin_web / "sub").mkdir(parents=True)
    (plugin_web / "sub" / "widget.js").write_text("export const x = 1;\n")
    server.call(server.state.add_plugin_web_dirs, {"my_pack": plugin_web})
    status, urls = get_json(server.url + "/api/extensions")
    assert status == 200
    assert "/extensions/weft/weft.js" in urls and "/extensions/my_pack/sub/widget.js" in urls
    for url in ("/extensions/weft/weft.js", "/extensions/my_pack/sub/widget.js"):
        status, headers, body = http("GET", server.url + url)
        assert status == 200 and headers["Content-Type"].startswith("text/javascript"), url
    assert http("GET", server.url + "/extensions/my_pack/../../serve.py")[0] == 404


def test_object_info_lists_builtin_and_plugin_nodes(server):
    status, info = get_json(server.url + "/object_info")
    assert status == 200 and {"EmptyImage", "SaveImage", "TestConst", "WebTestPreviews"} <= set(info)
    assert info["SaveImage"]["output_node"] is True
    status, one = get_json(server.url + "/api/object_info/TestConst")
    assert status == 200 and list(one) == ["TestConst"]
    assert get_json(server.url + "/object_info/NoSuchNode") == (200, {})


def test_system_stats_reports_device_and_plugins(server):
    status, stats = get_json(server.url + "/system_stats")
    assert status == 200
    assert {"os", "ram_total", "ram_free", "comfyui_version", "python_version", "pytorch_version",
            "embedded_python", "argv"} <= set(stats["system"])
    device = stats["devices"][0]
    assert device["type"] in ("cpu", "cuda")
    assert {"name", "index", "vram_total", "vram_free", "torch_vram_total", "torch_vram_free"} <= set(device)
    assert set(stats["plugins"]) == {"loaded", "failed", "disabled"}
    assert get_json(server.url + "/features")[1]["supports_preview_metadata"] is True


def test_prompt_runs_and_history_has_the_record(light_server):
    url = light_server.url
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(41), "client_id": "c1"})
    assert status == 200 and set(reply) == {"prompt_id", "number", "node_errors"}
    record = wait_terminal(url, reply["prompt_id"])
    assert record["status"] == {"status_str": "success", "completed": True, "messages": record["status"]["messages"]}
    assert record["outputs"]["2"]["values"] == [41]
    number, prompt_id, prompt, extra, outputs = record["prompt"]
    assert prompt_id == reply["prompt_id"] and prompt["1"]["class_type"] == "TestConst" and outputs == ["2"]
    assert extra["client_id"] == "c1"
    status, body = get_json(f"{url}/api/history/{reply['prompt_id']}")
    assert status == 200 and reply["prompt_id"] in body
    status, history = get_json(url + "/history?max_items=1")
    assert status == 200 and len(history) == 1


def test_prompt_validation_error_is_400_with_structured_errors(light_server):
    bad = {"1": {"class_type": "TestConst", "inputs": {"value": "not a number"}},
           "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0]}}}
    status, body = post_json(light_server.url + "/prompt", {"prompt": bad})
    assert status == 400
    assert set(body) == {"error", "node_errors"} and body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"]["errors"][0]["extra_info"]["input_name"] == "value"
    status, body = post_json(light_server.url + "/prompt", {"prompt": {"1": {"class_type": "Nope", "inputs": {}}}})
    assert status == 400 and body["error"]["type"] in ("missing_node_type", "invalid_prompt")


def test_prompt_accepts_the_editor_workflow_format(server):
    workflow = json.loads((ROOT / "workflows" / "default.json").read_text())
    status, reply = post_json(server.url + "/api/prompt", {"prompt": workflow, "client_id": "ui"})
    assert status == 200, reply
    record = wait_terminal(server.url, reply["prompt_id"])
    image = record["outputs"]["3"]["images"][0]
    status, headers, body = http("GET", f"{server.url}/view?filename={image['filename']}"
                                        f"&subfolder={image['subfolder']}&type={image['type']}")
    assert status == 200 and headers["Content-Type"] == "image/png"
    assert Image.open(io.BytesIO(body)).size == (512, 384)


def test_prompt_id_number_and_front(light_server):
    url = light_server.url
    chosen = new_id()
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(1), "prompt_id": chosen, "number": 7})
    assert status == 200 and reply["prompt_id"] == chosen and reply["number"] == 7
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(1), "prompt_id": chosen})
    assert status == 400 and "already used" in reply["error"]["message"]
    assert post_json(url + "/prompt", {"prompt": const_prompt(1), "prompt_id": "not-a-uuid"})[0] == 400
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(2), "front": True})
    assert status == 200 and reply["number"] < 0
    wait_terminal(url, chosen)


def test_unknown_job_is_404_never_done(light_server):
    unknown = new_id()
    for route in (f"/history/{unknown}", f"/jobs/{unknown}", f"/api/jobs/{unknown}"):
        assert http("GET", light_server.url + route)[0] == 404, route
    assert http("POST", f"{light_server.url}/jobs/{unknown}/cancel")[0] == 404


def test_jobs_interface_lists_pages_and_details(light_server):
    url = light_server.url
    ids = [post_json(url + "/prompt", {"prompt": const_prompt(i, f"job{i}")})[1]["prompt_id"] for i in range(3)]
    for prompt_id in ids:
        wait_terminal(url, prompt_id)
    status, body = get_json(url + "/api/jobs?status=completed&limit=2&offset=0&sort_by=create_time&sort_order=desc")
    assert status == 200 and len(body["jobs"]) == 2
    assert body["pagination"]["has_more"] is True and body["pagination"]["total"] >= 3
    job = body["jobs"][0]
    assert {"id", "status", "create_time", "outputs_count", "previewable_outputs_count", "priority"} <= set(job)
    assert job["status"] == "completed"
    status, detail = get_json(f"{url}/api/jobs/{ids[0]}")
    assert status == 200 and detail["outputs"]["2"]["values"] == [0]
    assert detail["workflow"]["prompt"]["1"]["class_type"] == "TestConst"
    assert get_json(url + "/jobs?status=bogus")[0] == 400
    assert get_json(url + "/jobs?sort_order=sideways")[0] == 400


def test_cancel_pending_and_running_jobs(light_server):
    url = light_server.url
    slow = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
            "2": {"class_type": "TestSlow", "inputs": {"value": ["1", 0], "seconds": 3.0}},
            "3": {"class_type": "TestOutput", "inputs": {"value": ["2", 0]}}}
    running = post_json(url + "/prompt", {"prompt": slow})[1]["prompt_id"]
    waiting = [post_json(url + "/prompt", {"prompt": const_prompt(i)})[1]["prompt_id"] for i in range(3)]
    status, queue = get_json(url + "/queue")
    assert status == 200 and {item[1] for item in queue["queue_pending"]} >= set(waiting[1:])
    assert post_json(url + "/queue", {"delete": [waiting[0]]})[0] == 200
    assert post_json(url + "/api/jobs/cancel", {"job_ids": [waiting[1]]})[1]["cancelled"] == [waiting[1]]
    assert post_json(f"{url}/jobs/{waiting[2]}/cancel", None)[0] == 200
    for prompt_id in waiting:
        record = wait_terminal(url, prompt_id)
        assert record["status"]["status_str"] == "error" and record["outputs"] == {}
        assert get_json(f"{url}/jobs/{prompt_id}")[1]["status"] == "cancelled"
    assert post_json(url + "/interrupt", {"prompt_id": running})[0] == 200
    record = wait_terminal(url, running)
    assert record["status"]["completed"] is False
    assert get_json(f"{url}/jobs/{running}")[1]["status"] == "cancelled"


def test_history_delete_and_clear(light_server):
    url = light_server.url
    prompt_id = post_json(url + "/prompt", {"prompt": const_prompt(5)})[1]["prompt_id"]
    wait_terminal(url, prompt_id)
    assert post_json(url + "/history", {"delete": [prompt_id]})[0] == 200
    assert http("GET", f"{url}/history/{prompt_id}")[0] == 404
    assert post_json(url + "/history", {"clear": True})[0] == 200
    assert get_json(url + "/history")[1] == {}
    assert post_json(url + "/free", {"unload_models": True, "free_memory": True})[0] == 200


def test_settings_and_first_start_persist_across_restart(tmp_path):
    first = ServerThread(tmp_path, light=True)
    try:
        assert get_json(first.url + "/api/settings")[1] == {"Comfy.TutorialCompleted": True}
        assert post_json(first.url + "/api/settings/Comfy.ColorPalette", "light")[0] == 200
        assert post_json(first.url + "/api/settings", {"A.b": [1, 2], "C": {"d": True}})[0] == 200
        assert get_json(first.url + "/api/settings/Comfy.ColorPalette") == (200, "light")
        assert get_json(first.url + "/api/users") == (200, {"storage": "server", "migrated": True})
        prompt_id = post_json(first.url + "/prompt", {"prompt": const_prompt(3)})[1]["prompt_id"]
        wait_terminal(first.url, prompt_id)
    finally:
        first.stop()
    second = ServerThread(tmp_path, light=True)
    try:
        settings = get_json(second.url + "/settings")[1]
        assert settings == {"Comfy.TutorialCompleted": True, "Comfy.ColorPalette": "light", "A.b": [1, 2],
                            "C": {"d": True}}
        assert wait_terminal(second.url, prompt_id)["outputs"]["2"]["values"] == [3]
    finally:
        second.stop()


def test_userdata_store_list_move_delete(light_server):
    url = light_server.url + "/api/userdata"
    workflow = json.dumps({"nodes": [], "links": []}).encode()
    status, _, body = http("POST", f"{url}/workflows%2Fdeep%2Fmine.json?overwrite=false&full_info=true", raw=workflow)
    assert status == 200 and json.loads(body)["path"] == "workflows/deep/mine.json"
    status, _, body = http("POST", f"{url}/workflows%2Fdeep%2Fmine.json?overwrite=false", raw=workflow)
    assert status == 409
    status, listing = get_json(url + "?dir=workflows&recurse=true&split=false&full_info=true")
    assert status == 200 and [i["path"] for i in listing] == ["deep/mine.json"]
    assert {"size", "modified"} <= set(listing[0])
    assert get_json(url + "?dir=workflows&recurse=false")[1] == []
    assert get_json(url + "?dir=workflows&recurse=true&split=true")[1] == [["deep/mine.json", "deep", "mine.json"]]
    status, _, body = http("GET", f"{url}/workflows%2Fdeep%2Fmine.json")
    assert status == 200 and body == workflow
    status, _, body = http("POST", f"{url}/workflows%2Fdeep%2Fmine.json/move/workflows%2Frenamed.json")
    assert status == 200 and json.loads(body) == "workflows/renamed.json"
    assert http("GET", f"{url}/workflows%2Fdeep%2Fmine.json")[0] == 404
    status, entries = get_json(light_server.url + "/api/v2/userdata?path=workflows")
    assert status == 200 and {e["name"] for e in entries} == {"deep", "renamed.json"}
    assert http("DELETE", f"{url}/workflows%2Frenamed.json")[0] == 204
    assert http("GET", f"{url}/workflows%2Frenamed.json")[0] == 404
    assert get_json(url + "?dir=nothing-here")[0] == 404


def test_upload_image_view_preview_and_channels(light_server):
    url = light_server.url
    status, reply = upload(url, "pic.png", png_bytes(), subfolder="sub", type="input")
    assert status == 200 and reply == {"name": "pic.png", "subfolder": "sub", "type": "input"}
    status, reply = upload(url, "pic.png", png_bytes(), subfolder="sub", type="input")
    assert status == 200 and reply["name"] == "pic (1).png"
    status, reply = upload(url, "pic.png", png_bytes(color=(1, 2, 3, 4)), subfolder="sub", overwrite="true")
    assert status == 200 and reply["name"] == "pic.png"
    view = f"{url}/api/view?filename=pic.png&subfolder=sub&type=input"
    status, headers, body = http("GET", view)
    assert status == 200 and Image.open(io.BytesIO(body)).getpixel((0, 0)) == (1, 2, 3, 4)
    status, headers, body = http("GET", view + "&preview=webp;50")
    assert status == 200 and headers["Content-Type"] == "image/webp" and Image.open(io.BytesIO(body)).format == "WEBP"
    status, headers, body = http("GET", view + "&preview=jpeg;80&channel=rgb")
    assert status == 200 and Image.open(io.BytesIO(body)).mode == "RGB"
    status, headers, body = http("GET", view + "&channel=a")
    assert status == 200 and Image.open(io.BytesIO(body)).getpixel((0, 0))[3] == 4
    assert http("GET", view + "&channel=bogus")[0] == 400
    assert http("GET", view + "&preview=gif;50")[0] == 400
    assert http("GET", f"{url}/view?filename=missing.png&type=input")[0] == 404
    assert http("GET", f"{url}/view?filename=pic.png&type=elsewhere")[0] == 400


def test_upload_mask_puts_the_alpha_into_the_original(light_server):
    url = light_server.url
    upload(url, "base.png", png_bytes(4, 4, "RGB", (200, 100, 50)), type="input")
    mask = png_bytes(4, 4, "RGBA", (0, 0, 0, 77))
    status, reply = upload(url, "masked.png", mask, route="/upload/mask", type="input",
                           original_ref=json.dumps({"filename": "base.png", "subfolder": "", "type": "input"}))
    assert status == 200 and reply["name"] == "masked.png"
    body = http("GET", f"{url}/view?filename=masked.png&type=input")[2]
    assert Image.open(io.BytesIO(body)).getpixel((1, 1)) == (200, 100, 50, 77)


def test_pixel_caps_refuse_oversize_images_before_decoding(light_server):
    url = light_server.url
    # 20000 x 1 pixels: over the per-edge cap though tiny in bytes.
    status, reply = upload(url, "wide.png", png_bytes(20_000, 1, "L", 0))
    assert status == 413 and "16384" in reply["error"]["message"]
    # 9000 x 9000 (81 MP) declared in the header: refused from the header, never decoded.
    buffer = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buffer, format="PNG")
    status, reply = upload(url, "huge.png", buffer.getvalue())
    assert status == 413
    assert not list((light_server.runtime.paths.input).glob("huge*"))


def test_active_content_is_served_as_attachment_with_nosniff(light_server):
    url = light_server.url
    for name, data in (("page.html", b"<script>alert(1)</script>"), ("pic.svg", b"<svg onload='alert(1)'/>"),
                       ("code.js", b"alert(1)"), ("thing.xhtml", b"<html/>"), ("noext", b"<script>")):
        status, reply = upload(url, name, data)
        assert status == 200, name
        status, headers, body = http("GET", f"{url}/view?filename={reply['name']}&type=input")
        assert status == 200 and body == data
        assert headers["Content-Disposition"].startswith("attachment"), name
        assert headers["Content-Type"] == "application/octet-stream" and headers["X-Content-Type-Options"] == "nosniff"


def test_body_over_the_cap_is_413_before_reading(tmp_path):
    running = ServerThread(tmp_path, light=True, extra_args=["--max-upload-size", "0.01"])
    try:
        big = b"x" * 20_000
        assert http("POST", running.url + "/prompt", raw=big)[0] == 413
        status, reply = upload(running.url, "big.png", big)
        assert status == 413
        # A declared length over the cap is refused without the body ever being sent.
        import socket

        with socket.create_connection(("127.0.0.1", running.server.port)) as sock:
            sock.sendall(b"POST /upload/image HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999999999\r\n"
                         b"Content-Type: multipart/form-data; boundary=x\r\n\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 413")
        assert get_json(running.url + "/features")[1]["max_upload_size"] == int(0.01 * 2**20)
    finally:
        running.stop()


def test_templates_serve_the_workflows_folder(light_server):
    status, index = get_json(light_server.url + "/templates/index.json")
    assert status == 200 and index[0]["moduleName"] == "default"
    names = {t["name"] for t in index[0]["templates"]}
    assert "default" in names
    status, workflow = get_json(light_server.url + "/templates/default.json")
    assert status == 200 and workflow == json.loads((ROOT / "workflows" / "default.json").read_text())
    status, headers, body = http("GET", light_server.url + "/templates/default-1.png")
    assert status == 200 and Image.open(io.BytesIO(body)).size == (400, 300)
    assert http("GET", light_server.url + "/templates/nothing.json")[0] == 404


def test_template_browser_lists_the_official_templates_grouped_as_their_index_groups_them(light_server):
    from execution import templates
    from tests.official_templates import T2V, official_template

    status, index = get_json(light_server.url + "/templates/index.json")
    assert status == 200 and index[0]["title"] == "Weft"
    official = {group["title"]: group for group in index[1:]}
    assert [c.title for c in templates.official_categories()] == list(official)
    video = {t["name"]: t for t in official["Video"]["templates"]}
    assert video["video_minimax_h3_t2v"]["title"] == "MiniMax H3: Text to Video"
    assert video["video_minimax_h3_t2v"]["mediaSubtype"] == "png" and official["Video"]["type"] == "video"
    status, workflow = get_json(light_server.url + "/templates/" + T2V)
    assert status == 200 and workflow == official_template(T2V)
    status, headers, body = http("GET", light_server.url + "/templates/video_minimax_h3_t2v-1.png")
    assert status == 200 and headers["Content-Type"] == "image/png" and Image.open(io.BytesIO(body)).size == (400, 300)
    assert http("GET", light_server.url + "/templates/index.schema.json")[0] == 404  # the index files are not templates
    assert http("GET", light_server.url + "/templates/video_minimax_h3_nothing-1.png")[0] == 404


def test_template_browser_logo_and_locale_indexes(light_server):
    """The template browser asks for a logo index and, outside English, a translated index: both answer."""
    status, headers, body = http("GET", light_server.url + "/templates/index_logo.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json") and json.loads(body) == {}
    status, french = get_json(light_server.url + "/templates/index.fr.json")
    assert status == 200 and french == get_json(light_server.url + "/templates/index.json")[1]
    assert get_json(light_server.url + "/templates/index.zh-TW.json")[0] == 200


def test_internal_files_lists_a_folder_newest_first(light_server):
    import os

    folder = light_server.runtime.paths.input
    for age, name in enumerate(["newest.png", "middle.png", "oldest.png"]):
        (folder / name).write_bytes(png_bytes())
        os.utime(folder / name, (1_000_000_000 - age * 100, 1_000_000_000 - age * 100))
    status, names = get_json(light_server.url + "/internal/files/input")
    assert status == 200
    listed = [n for n in names if n in ("newest.png", "middle.png", "oldest.png")]
    assert listed == ["newest.png", "middle.png", "oldest.png"]
    assert http("GET", light_server.url + "/internal/files/models")[0] == 400


def test_large_json_is_gzipped_only_when_accepted(server):
    import gzip

    status, headers, body = http("GET", server.url + "/object_info", headers={"Accept-Encoding": "gzip, deflate"})
    assert status == 200 and headers.get("Content-Encoding") == "gzip"
    plain = json.loads(gzip.decompress(body))
    assert "SaveImage" in plain and len(body) < len(json.dumps(plain)) / 4
    status, headers, body = http("GET", server.url + "/object_info")
    assert status == 200 and "Content-Encoding" not in headers and json.loads(body) == plain
    status, headers, _ = http("GET", server.url + "/features", headers={"Accept-Encoding": "gzip"})
    assert status == 200 and "Content-Encoding" not in headers  # small bodies go as they are


def test_logs_panel_gets_recent_lines_and_live_ones(light_server):
    """The editor's logs panel: recent lines as text and raw entries, then new lines pushed to a subscriber."""
    import asyncio
    import logging

    import aiohttp

    marker = f"log line {uuid.uuid4().hex}"
    logging.getLogger("weft.test").warning(marker)
    status, raw = get_json(light_server.url + "/internal/logs/raw")
    assert status == 200 and raw["size"]["cols"] > 0 and raw["size"]["rows"] > 0
    assert any(marker in entry["m"] and entry["t"] for entry in raw["entries"])
    status, text = get_json(light_server.url + "/internal/logs")
    assert status == 200 and marker in text
    assert http("PATCH", light_server.url + "/internal/logs/subscribe", {"clientId": 3})[0] == 400

    async def scenario() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(light_server.url + "/ws?clientId=logreader") as ws:
                async with session.patch(light_server.url + "/internal/logs/subscribe",
                                         json={"clientId": "logreader", "enabled": True}) as reply:
                    assert reply.status == 200
                logging.getLogger("weft.test").warning("pushed %s", marker)
                while True:
                    message = await ws.receive_json(timeout=10)
                    if message["type"] == "logs":
                        return message["data"]

    pushed = asyncio.run(scenario())
    assert any(f"pushed {marker}" in entry["m"] for entry in pushed["entries"]) and pushed["size"]["cols"] > 0


def test_logs_panel_shows_each_job_its_time_its_worker_lines_and_a_node_traceback(light_server):
    """Jobs run in a worker process; the panel (the server's log) still shows "got prompt", each run's time,
    the worker's own log lines and a failed node's traceback."""
    marker = uuid.uuid4().hex
    fine = post_json(light_server.url + "/prompt", {"prompt": const_prompt(4)})[1]["prompt_id"]
    failing = {"1": {"class_type": "TestConst", "inputs": {"value": 1}},
               "2": {"class_type": "TestFail", "inputs": {"value": ["1", 0], "message": marker}},
               "3": {"class_type": "TestOutput", "inputs": {"value": ["2", 0]}}}
    failed = post_json(light_server.url + "/prompt", {"prompt": failing})[1]["prompt_id"]
    assert wait_terminal(light_server.url, fine)["status"]["status_str"] == "success"
    assert wait_terminal(light_server.url, failed)["status"]["status_str"] == "error"
    deadline = time.monotonic() + 20
    while True:
        text = get_json(light_server.url + "/internal/logs")[1]
        if f"prompt {failed} failed" in text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert f"got prompt {fine}" in text and f"got prompt {failed}" in text
    assert re.search(rf"prompt {fine} executed in \d+\.\d\d seconds", text), text[-2000:]
    assert f"TestFail is failing on purpose: {marker}" in text  # logged inside the worker process
    failure = text[text.index(f"prompt {failed} failed"):]
    assert "node 2 (TestFail)" in failure and f"RuntimeError: {marker}" in failure and "Traceback" in failure


def test_a_log_line_through_the_logs_panel_handler_returns():
    """logging.Handler.handle holds the handler's own lock around emit(); the panel's buffer must not
    take that lock again (a second acquire of a plain Lock hung every INFO line of the server process)."""
    import logging
    import threading

    from web.logs import LogBuffer

    buffer = LogBuffer()
    logger = logging.getLogger("weft.test.logs_panel")
    logger.addHandler(buffer)
    logger.setLevel(logging.INFO)
    try:
        done = threading.Event()
        thread = threading.Thread(target=lambda: (logger.info("one line"), done.set()), daemon=True)
        thread.start()
        assert done.wait(10), "logging through the panel's buffer hung"
        assert [e["m"] for e in buffer.snapshot()] == ["INFO weft.test.logs_panel: one line\n"]
    finally:
        logger.removeHandler(buffer)


def test_server_start_clears_old_preview_pictures_only(tmp_path):
    from web.server import clear_previews

    (tmp_path / "sub").mkdir()
    old = [tmp_path / "ComfyUI_temp_abcde_00001_.png", tmp_path / "sub" / "ComfyUI_temp_xyzab_00002_.png"]
    for path in old:
        path.write_bytes(b"png")
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    assert clear_previews(tmp_path) == 2
    assert not any(p.exists() for p in old) and keep.read_text() == "mine"
    assert clear_previews(tmp_path / "absent") == 0
