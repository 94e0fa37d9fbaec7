"""Node pack routes never replace Weft's own: the editor's files, the templates and the API win, and a
pack route that would take one of them is refused with a log line."""
from __future__ import annotations

import json
import logging

from aiohttp import web

from nodes.pack_server import PackServer
from tests.web.conftest import http
from tests.web.serve import ServerThread
from web.state import default_front_end_root


def _hostile_pack_server(static_folder) -> PackServer:
    packs = PackServer()
    routes = packs.routes

    async def takeover(request):
        return web.Response(text="TAKEN OVER")

    async def ping(request):
        return web.json_response({"pack": "pong", "name": request.match_info.get("name")})

    for path in ("/", "/index.html", "/scripts/app.js", "/assets/{name}", "/templates/{name}",
                 "/templates/index.json", "/extensions/weft/x.js", "/prompt", "/settings/theme", "/{tail:.*}"):
        routes.get(path)(takeover)
    routes.post("/prompt")(takeover)
    routes.static("/assets", str(static_folder))
    routes.static("/", str(static_folder))
    routes.get("/goodpack/ping")(ping)
    routes.get("/goodpack/item/{name}")(ping)
    routes.static("/goodpack/files", str(static_folder))
    return packs


def test_a_pack_cannot_replace_the_editor_templates_or_api(tmp_path, caplog):
    static_folder = tmp_path / "pack_static"
    static_folder.mkdir()
    (static_folder / "app.js").write_text("TAKEN OVER")
    asset = next(p for p in (default_front_end_root() / "assets").iterdir() if p.is_file())

    def install(runtime):
        runtime.pack_server = _hostile_pack_server(static_folder)

    with caplog.at_level(logging.WARNING, logger="web.server"):
        running = ServerThread(tmp_path / "base", light=True, runtime_changes=install)
    try:
        url = running.url
        for path in ("/", "/index.html", f"/assets/{asset.name}", "/templates/index.json", "/prompt",
                     "/api/prompt", "/settings/theme", "/scripts/app.js", "/some/unclaimed/page"):
            status, _, body = http("GET", url + path)
            assert b"TAKEN OVER" not in body, (path, status)
        assert http("GET", url + "/")[2] == (default_front_end_root() / "index.html").read_bytes()
        assert http("GET", f"{url}/assets/{asset.name}")[2] == asset.read_bytes()
        status, _, body = http("POST", url + "/prompt", {"prompt": {}})
        assert status == 400 and b"TAKEN OVER" not in body
        # What does not clash is served, bare and under /api.
        for path in ("/goodpack/ping", "/api/goodpack/ping"):
            status, _, body = http("GET", url + path)
            assert status == 200 and json.loads(body)["pack"] == "pong", path
        assert json.loads(http("GET", url + "/goodpack/item/a")[2])["name"] == "a"
        assert http("GET", url + "/goodpack/files/app.js")[2] == b"TAKEN OVER"
    finally:
        running.stop()
    refused = [r.getMessage() for r in caplog.records if "is not served: it would take" in r.getMessage()]
    for described in ("GET / (", "GET /index.html", "GET /scripts/app.js", "GET /assets/{name}",
                      "GET /templates/{name}", "GET /templates/index.json", "GET /extensions/weft/x.js",
                      "GET /prompt", "POST /prompt", "GET /api/prompt", "GET /settings/theme", "GET /{tail:.*}",
                      "static /assets", "static /"):
        assert any(described in line for line in refused), (described, refused)
    assert not any("goodpack" in line for line in refused), refused
