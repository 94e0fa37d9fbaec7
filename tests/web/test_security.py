"""Security regressions, each named after what it guards against, against a real server."""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import random
import urllib.parse
import uuid
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from tests.web.conftest import const_prompt, get_json, http, post_json, wait_terminal
from tests.web.serve import ServerThread
from tests.web.test_routes import multipart, png_bytes

CANARY = f"CANARY-{uuid.uuid4()}"
WRITTEN = f"HOSTILE-WRITE-{uuid.uuid4()}"


# ---------------------------------------------------------------------- hostile file names
def hostile_names(count: int = 520) -> list[str]:
    """File names that try to leave their folder: traversal in many spellings, absolute paths, NUL
    bytes, backslashes, encodings (once and twice), and names of links that point out of the folder."""
    traversals = ["..", "%2e%2e", "%2E%2E", ".%2e", "%252e%252e", "..%c0%af", "....", ".. ", "..\\", "..%5c",
                  "\uff0e\uff0e", "..;", "..\x00"]
    separators = ["/", "\\", "%2f", "%5c", "%252f", "//", "/./"]
    targets = ["canary.txt", "../canary.txt", "etc/passwd", "user/jobs.sqlite3", "models/../canary.txt"]
    names: list[str] = []
    for traversal, separator, depth, target in itertools.product(traversals, separators, (1, 2, 4), targets):
        names.append((traversal + separator) * depth + target)
    specials = ["/etc/passwd", "//etc/passwd", "\\\\server\\share\\canary.txt", "C:\\canary.txt", "c:/canary.txt",
                "canary.txt\x00.png", "\x00", "", ".", "./", "sub/../../canary.txt", "link_out.txt",
                "linkdir_out/canary.txt", "linkdir_out", "%00", "file:///etc/passwd", "~/canary.txt",
                "..", "../", "/", "sub/\x00/x", "a" * 5000, "\u202e..\u202d/canary.txt"]
    rng = random.Random(4)
    rng.shuffle(names)
    return specials + names[:count - len(specials)]


@pytest.fixture(scope="module")
def fortress(tmp_path_factory):
    """A light server whose base folder holds canaries outside every root, and links pointing out."""
    outer = tmp_path_factory.mktemp("fortress")
    base = outer / "base"
    base.mkdir()
    for canary in (outer / "canary.txt", base / "canary.txt", base / "models" / "canary.txt"):
        canary.parent.mkdir(parents=True, exist_ok=True)
        canary.write_text(CANARY)
    running = ServerThread(base, light=True)
    paths = running.runtime.paths
    for root in (paths.input, paths.output, paths.temp, running.state.user_root):
        (root / "link_out.txt").symlink_to(base / "canary.txt")
        (root / "linkdir_out").symlink_to(outer, target_is_directory=True)
    (running.state.user_root / "workflows" / "link_out.json").symlink_to(base / "canary.txt")
    yield running, outer
    running.stop()


def _files_outside_roots(outer: Path, roots: list[Path]) -> dict[str, bytes]:
    found = {}
    for path in outer.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        if any(root == path or root in path.parents for root in roots):
            continue
        found[str(path)] = path.read_bytes()
    return found


async def _fire(requests: list[tuple[str, str, dict]], concurrency: int = 16) -> list[tuple[int, bytes]]:
    """Send (method, raw url, kwargs) requests, URLs taken as already encoded; (status, body) each."""
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def one(method, raw_url, kwargs):
            async with semaphore:
                try:
                    async with session.request(method, URL(raw_url, encoded=True), **kwargs) as response:
                        return response.status, await response.read()
                except (aiohttp.ClientError, ValueError) as exc:  # a name the client itself cannot send
                    return -1, str(exc).encode()
        return await asyncio.gather(*(one(*r) for r in requests))


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def test_hostile_file_names_never_reach_outside_the_roots(fortress):
    server, outer = fortress
    url = server.url
    paths = server.runtime.paths
    roots = [paths.input, paths.output, paths.temp, Path(paths.user), paths.models]
    before = _files_outside_roots(outer, roots)
    names = hostile_names()
    assert len(names) >= 500
    per_route: dict[str, list[tuple[str, str, dict]]] = {}
    for name in names:
        q = _q(name)
        per_route.setdefault("GET /view", []).append(("GET", f"{url}/view?filename={q}&type=input", {}))
        per_route.setdefault("GET /view subfolder", []).append(
            ("GET", f"{url}/api/view?filename=canary.txt&subfolder={q}&type=output", {}))
        body, content_type = multipart({"subfolder": name if "\x00" not in name else "x", "type": "input"},
                                       {"image": (name.replace('"', "%22").replace("\r", "").replace("\n", ""),
                                                  WRITTEN.encode(), "text/plain")})
        per_route.setdefault("POST /upload/image", []).append(
            ("POST", f"{url}/upload/image", {"data": body, "headers": {"Content-Type": content_type}}))
        body, content_type = multipart(
            {"original_ref": json.dumps({"filename": name, "subfolder": "", "type": "input"}), "type": "input"},
            {"image": ("mask.png", png_bytes(), "image/png")})
        per_route.setdefault("POST /upload/mask", []).append(
            ("POST", f"{url}/api/upload/mask", {"data": body, "headers": {"Content-Type": content_type}}))
        per_route.setdefault("GET /userdata/{file}", []).append(("GET", f"{url}/api/userdata/{q}", {}))
        per_route.setdefault("POST /userdata/{file}", []).append(
            ("POST", f"{url}/api/userdata/{q}", {"data": WRITTEN.encode()}))
        per_route.setdefault("DELETE /userdata/{file}", []).append(("DELETE", f"{url}/api/userdata/{q}", {}))
        per_route.setdefault("POST /userdata/{file}/move/{dest}", []).append(
            ("POST", f"{url}/api/userdata/comfy.templates.json/move/{q}?overwrite=false", {}))
        per_route.setdefault("GET /userdata?dir=", []).append(("GET", f"{url}/api/userdata?dir={q}&recurse=true", {}))
        per_route.setdefault("GET /v2/userdata?path=", []).append(("GET", f"{url}/api/v2/userdata?path={q}", {}))
        per_route.setdefault("GET /templates/{name}", []).append(("GET", f"{url}/templates/{q}", {}))
        per_route.setdefault("GET /view_metadata", []).append(
            ("GET", f"{url}/view_metadata/checkpoints?filename={q}", {}))
        raw_path = "".join(c if c.isalnum() or c in "/.%-_~" else _q(c) for c in name)
        per_route.setdefault("GET /{static}", []).append(("GET", f"{url}/{raw_path}", {}))
        per_route.setdefault("GET /extensions/weft/{file}", []).append(("GET", f"{url}/extensions/weft/{raw_path}", {}))
    for route, requests in per_route.items():
        assert len(requests) >= 500, route
        results = asyncio.run(_fire(requests))
        for (method, raw_url, _), (status, body) in zip(requests, results):
            assert CANARY.encode() not in body, f"{route}: {raw_url[:300]} served the canary"
            assert status != 500, f"{route}: {raw_url[:300]} crashed the handler: {body[:200]!r}"
    after = _files_outside_roots(outer, roots)
    assert after == before, f"files written or changed outside the roots: {set(after) ^ set(before)}"
    for path, data in after.items():
        assert WRITTEN.encode() not in data, path
    # The links out are still links to intact canaries, and the server still serves.
    assert (outer / "base" / "canary.txt").read_text() == CANARY
    assert get_json(url + "/prompt")[0] == 200


# ---------------------------------------------------------------------- cross-site requests
def test_cross_site_requests_never_queue_a_job(light_server):
    url = light_server.url
    port = light_server.server.port
    origins = [None, f"http://127.0.0.1:{port}", f"http://localhost:{port}", "null", "http://evil.example",
               f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}"]
    fetch_sites = [None, "same-origin", "same-site", "cross-site", "none"]
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"]
    content_types = ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
    accepted, refused = [], []
    for index, (origin, site, host, content_type) in enumerate(itertools.product(origins, fetch_sites, hosts,
                                                                                   content_types)):
        label = f"matrix-{index}"
        headers = {"Host": host, "Content-Type": content_type}
        if origin is not None:
            headers["Origin"] = origin
        if site is not None:
            headers["Sec-Fetch-Site"] = site
        status, body = post_json(url + "/prompt", {"prompt": const_prompt(index, label)}, headers=headers)
        host_name = host.rsplit(":", 1)[0]
        same_origin = origin is None or origin == f"http://{host}"
        allowed = host_name in ("127.0.0.1", "localhost") and site != "cross-site" and same_origin
        if allowed:
            assert status == 200, (origin, site, host, content_type, body)
            accepted.append(body["prompt_id"])
        else:
            assert status in (401, 403), (origin, site, host, content_type, status)
            refused.append(label)
    cross_site = [c for c in itertools.product(origins, fetch_sites, hosts, content_types)
                  if c[1] == "cross-site" or (c[0] is not None and c[0] != f"http://{c[2]}")]
    assert len(refused) >= len(cross_site) > 300
    for prompt_id in accepted:
        wait_terminal(url, prompt_id)
    labels = set()
    for job in light_server.state.store.list(["pending", "running", "success", "error", "cancelled"])[0]:
        labels.add(job.prompt["2"]["inputs"]["label"])
    assert not labels & set(refused), "a cross-site request queued a job"


def test_cross_site_websocket_and_reads_are_refused(light_server):
    port = light_server.server.port
    status, _, _ = http("GET", light_server.url + "/api/settings", headers={"Sec-Fetch-Site": "cross-site",
                                                                           "Sec-Fetch-Mode": "cors"})
    assert status == 403
    status, _, _ = http("GET", light_server.url + "/view?filename=x.png", headers={"Origin": "http://evil.example"})
    assert status == 403
    # Following a link to the editor from another site only displays the page.
    status, _, _ = http("GET", light_server.url + "/", headers={"Sec-Fetch-Site": "cross-site",
                                                               "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"})
    assert status == 200
    status, _, _ = http("POST", light_server.url + "/prompt", {"prompt": const_prompt(1)},
                        headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})
    assert status == 403

    async def scenario():
        async with aiohttp.ClientSession() as session:
            for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                            {"Host": f"rebound.example:{port}"}):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(light_server.url + "/ws?clientId=x", headers=headers)
                assert refused.value.status == 403
            async with session.ws_connect(light_server.url + "/ws?clientId=x",
                                          headers={"Origin": f"http://127.0.0.1:{port}"}) as ws:
                assert (await ws.receive_json(timeout=10))["type"] == "status"
    asyncio.run(scenario())


# ---------------------------------------------------------------------- malformed prompts
def malformed_bodies(count: int = 1000) -> list[bytes]:
    """Bodies no server should run: broken JSON, wrong shapes and types, deep nesting, bad links."""
    rng = random.Random(1234)
    good = const_prompt(1)
    structural = [
        b"", b" ", b"null", b"[]", b"1", b'"prompt"', b"{", b'{"prompt": }', b'{"prompt": NaN}', b"\xff\xfe\x00",
        b'{"prompt": {}}', b'{"prompt": []}', b'{"prompt": null}', b'{"prompt": "x"}', b'{"prompt": 5}',
        b"[" * 100_000 + b"]" * 100_000, b'{"prompt":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
        json.dumps({"prompt": good, "prompt_id": "../../etc"}).encode(),
        json.dumps({"prompt": good, "number": "first"}).encode(),
        json.dumps({"prompt": good, "front": "yes"}).encode(),
        json.dumps({"prompt": good, "client_id": 5}).encode(),
        json.dumps({"prompt": good, "extra_data": []}).encode(),
        json.dumps({"prompt": good, "partial_execution_targets": "2"}).encode(),
        json.dumps({"prompt": good, "partial_execution_targets": [{"x": 1}]}).encode(),
        json.dumps({"prompt": {"1": {"class_type": "TestConst", "inputs": {"value": 1}}}}).encode(),
        json.dumps({"prompt": {"1": {"class_type": "TestOutput", "inputs": {"value": ["1", 0]}}}}).encode(),
        json.dumps({"prompt": {"1": {"class_type": "TestOutput", "inputs": {"value": ["9", 0]}}}}).encode(),
        json.dumps({"prompt": {"1": {"class_type": "TestOutput", "inputs": {"value": ["2", 99]}},
                               "2": {"class_type": "TestConst", "inputs": {"value": 1}}}}).encode(),
        json.dumps({"prompt": {"nodes": "x", "links": 5}}).encode(),
        json.dumps({"prompt": {"nodes": [{"id": 1, "type": "Nope"}], "links": []}}).encode(),
        json.dumps({"prompt": {"nodes": [None, 5, "x"], "links": [[1, 2]]}}).encode(),
    ]
    # Values TestConst's INT input must refuse (TestOutput's input takes anything, so it is left alone).
    not_ints = [None, 2**70, -(2**70), float("inf"), "x" * 10, "\ud800", [], {}, [1], ["1"], ["1", 0], ["9", 0],
                ["1", 0, 0], {"__value__": "x"}, [[1, 2], 3]]
    not_nodes = [None, True, 5, "x", [], [1, 2], {}, {"inputs": {}}, {"class_type": None}]
    keys = ["class_type", "inputs", "_meta", "value", "label", "", "1", "__proto__"]
    bodies = list(structural)
    while len(bodies) < count:
        prompt = json.loads(json.dumps(good))
        kind = rng.randrange(7)
        node = rng.choice(["1", "2"])
        if kind == 0:
            prompt["1"]["inputs"]["value"] = rng.choice(not_ints)
        elif kind == 1:
            prompt[node]["class_type"] = rng.choice([None, 5, "", "Nope", "testconst", [], {}])
        elif kind == 2:
            prompt[node] = rng.choice(not_nodes)
        elif kind == 3:
            prompt[node]["inputs"] = rng.choice([None, 5, "x", [], [1], {}])
        elif kind == 4:
            prompt = {rng.choice(keys): rng.choice(not_nodes) for _ in range(rng.randrange(1, 4))}
        elif kind == 5:
            prompt["2"]["inputs"]["value"] = ["2", 0]  # a cycle onto itself
            prompt["1"]["inputs"]["value"] = ["2", rng.choice([0, -1, 1])]
        else:
            text = json.dumps({"prompt": prompt})
            cut = rng.randrange(1, len(text) - 1)
            bodies.append(text[:cut].encode() + bytes([rng.randrange(256)]) * rng.randrange(3))
            continue
        try:
            bodies.append(json.dumps({"prompt": prompt}, allow_nan=True).encode("utf-8", "surrogatepass"))
        except (TypeError, ValueError):
            continue
    return bodies[:count]


def test_malformed_prompt_bodies_are_all_4xx_and_the_server_keeps_serving(light_server):
    url = light_server.url
    bodies = malformed_bodies()
    assert len(bodies) == 1000
    results = asyncio.run(_fire([("POST", f"{url}/prompt", {"data": body,
                                                            "headers": {"Content-Type": "application/json"}})
                                 for body in bodies], concurrency=8))
    for body, (status, reply) in zip(bodies, results):
        assert 400 <= status < 500, (status, body[:200], reply[:300])
    status, reply = post_json(url + "/prompt", {"prompt": const_prompt(77)})
    assert status == 200
    assert wait_terminal(url, reply["prompt_id"])["outputs"]["2"]["values"] == [77]


# ---------------------------------------------------------------------- clients that stop reading
def test_clients_that_never_read_do_not_starve_the_readers(light_server):
    url = light_server.url
    state = light_server.state
    light_server.call(setattr, state.hub, "max_frames", 64)
    steps = 4

    async def scenario():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            # Non-readers subscribe to every job: they are sent every event and preview of all 90 jobs.
            stuck = [await session.ws_connect(f"{url}/ws?clientId=stuck{i}&subscribe=all", max_msg_size=0)
                     for i in range(10)]
            readers = [await session.ws_connect(f"{url}/ws?clientId=reader{i}") for i in range(90)]

            async def read(index: int, ws) -> list[dict]:
                hello = await ws.receive_json(timeout=30)
                assert hello["type"] == "status"
                prompt = {"1": {"class_type": "WebTestPreviews",
                                "inputs": {"steps": steps, "size": 192, "seed": index}}}
                async with session.post(url + "/prompt", json={"prompt": prompt, "client_id": f"reader{index}"}) as r:
                    prompt_id = (await r.json())["prompt_id"]
                events = []
                async with asyncio.timeout(120):
                    async for message in ws:
                        if message.type != aiohttp.WSMsgType.TEXT:
                            continue
                        data = json.loads(message.data)
                        if data["type"] == "status":
                            continue
                        events.append(data)
                        if data["type"] == "executing" and data["data"]["node"] is None:
                            break
                return prompt_id, events

            results = await asyncio.gather(*(read(i, ws) for i, ws in enumerate(readers)))
            for prompt_id, events in results:
                assert {e["data"].get("prompt_id") for e in events} == {prompt_id}
                types = [e["type"] for e in events]
                assert types[0] == "execution_start" and types[-1] == "executing"
                assert types.count("progress") == steps and "executed" in types and "execution_success" in types
            for ws in readers:
                await ws.close()
            # Every non-reader ends disconnected by the server.
            async with asyncio.timeout(60):
                while light_server.call(lambda: sum(1 for c in state.hub.clients if c.startswith("stuck"))):
                    await asyncio.sleep(0.2)
            for ws in stuck:
                await ws.close()
    asyncio.run(scenario())
    assert state.hub.disconnected_slow >= 10


# ---------------------------------------------------------------------- tokens and binding
def test_server_bound_beyond_loopback_demands_a_token():
    from tests.web.serve import parse_args
    from web.server import security_from_args

    announced = []
    config = security_from_args(parse_args(["--listen", "0.0.0.0"], light=True), announce=announced.append)
    assert config.token and len(config.token) >= 24 and config.token in announced[0]
    config = security_from_args(parse_args(["--listen"], light=True), announce=announced.append)
    assert config.token
    config = security_from_args(parse_args(["--listen", "10.1.2.3", "--token", "t0ken"], light=True))
    assert config.token == "t0ken" and "10.1.2.3" in config.allowed_hosts
    assert security_from_args(parse_args(["--listen", "0.0.0.0", "--insecure-no-auth"], light=True)).token is None
    assert security_from_args(parse_args([], light=True)).token is None
    assert security_from_args(parse_args(["--listen", "127.0.0.1,::1"], light=True)).token is None


def test_token_is_required_on_every_route_and_the_websocket(tmp_path):
    secret = "correct-horse-battery-staple"

    def with_token(config):
        config.security.token = secret

    running = ServerThread(tmp_path, light=True, config_changes=with_token)
    url = running.url
    try:
        for route in ("/", "/api/settings", "/object_info", "/history", "/view?filename=x.png"):
            assert http("GET", url + route)[0] == 401, route
            assert http("GET", url + route, headers={"Authorization": "Bearer " + "x" * len(secret)})[0] == 401
        assert post_json(url + "/prompt", {"prompt": const_prompt(1)})[0] == 401
        status, reply = post_json(url + "/prompt", {"prompt": const_prompt(1)},
                                  headers={"Authorization": f"Bearer {secret}"})
        assert status == 200
        basic = base64.b64encode(f"user:{secret}".encode()).decode()
        assert http("GET", url + "/api/settings", headers={"Authorization": f"Basic {basic}"})[0] == 200
        status, headers, _ = http("GET", f"{url}/?token={secret}")
        assert status == 200 and "weft_token=" in headers.get("Set-Cookie", "")
        assert http("GET", url + "/api/settings", headers={"Cookie": f"weft_token={secret}"})[0] == 200

        async def scenario():
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.WSServerHandshakeError):
                    await session.ws_connect(url + "/ws")
                async with session.ws_connect(url + "/ws", headers={"Authorization": f"Bearer {secret}"}) as ws:
                    assert (await ws.receive_json(timeout=10))["type"] == "status"
        asyncio.run(scenario())
    finally:
        running.stop()
