"""PromptServer.instance as packs see it (nodes/pack_server.py) and the comfy.* modules H3 checkpoint tools
read: websocket frames, where messages go, the running job, prompt handlers, a failed pack's routes."""
from __future__ import annotations

import asyncio
import io
import json
import struct

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from execution import context as run_context
from execution.events import EventBus
from execution.paths import Paths
from nodes import pack_server, plugins
from nodes.pack_server import BinaryEventTypes, PackServer, websocket_frame
from nodes.registry import NodeRegistry

plugins.enable_compat()


def _image(seed: int = 0, size: tuple[int, int] = (5, 3)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_frames_are_json_for_names_binary_for_numbers_and_encoded_images():
    assert json.loads(websocket_frame("my_pack.status", {"done": 2})) == {"type": "my_pack.status", "data": {"done": 2}}
    assert websocket_frame(BinaryEventTypes.TEXT, b"abc") == struct.pack(">I", 3) + b"abc"
    image = _image()
    frame = websocket_frame(BinaryEventTypes.UNENCODED_PREVIEW_IMAGE, ["PNG", image, None])
    assert struct.unpack(">II", frame[:8]) == (BinaryEventTypes.PREVIEW_IMAGE, 2)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(frame[8:]))), np.asarray(image))  # PNG: lossless
    shrunk = websocket_frame(BinaryEventTypes.UNENCODED_PREVIEW_IMAGE, ("JPEG", _image(size=(40, 20)), 10))
    assert struct.unpack(">II", shrunk[:8]) == (1, 1) and Image.open(io.BytesIO(shrunk[8:])).size == (10, 5)


@pytest.mark.parametrize("event, data, error", [
    ("named", b"bytes", "binary data needs an integer event type"),
    (7, {"a": 1}, "a JSON message needs a string event name"),
    (BinaryEventTypes.UNENCODED_PREVIEW_IMAGE, ("PNG", "not an image", None), "needs a PIL image"),
    (BinaryEventTypes.UNENCODED_PREVIEW_IMAGE, ("GIF", _image(), None), "image format 'GIF' is not one of JPEG, PNG"),
])
def test_frames_that_cannot_be_sent_are_refused_with_the_reason(event, data, error):
    with pytest.raises((TypeError, ValueError), match=error):
        websocket_frame(event, data)


def test_messages_outside_a_node_go_to_the_runtime_events_and_inside_to_the_job(tmp_path):
    bus, job_events = EventBus(), []
    seen = []
    bus.subscribe(lambda event, data: seen.append((event, data)))
    server = PackServer(bus)
    assert (server.client_id, server.last_node_id, server.last_prompt_id) == (None, None, None)
    server.send_sync("hello", {"n": 1})
    assert seen == [("server_message", {"sid": None, "frame": '{"type": "hello", "data": {"n": 1}}'})]

    ctx = run_context.RunContext("job-1", "12", "7", Paths(tmp_path), emit=lambda e, d: job_events.append((e, d)),
                                 extra_data={"client_id": "krita"})
    token = run_context.activate(ctx)
    try:
        assert (server.client_id, server.last_node_id, server.last_prompt_id) == ("krita", "7", "job-1")
        server.send_progress_text("half way", server.last_node_id, server.client_id)
    finally:
        run_context.deactivate(token)
    assert len(seen) == 1
    [(event, data)] = job_events
    assert event == "server_message" and data["sid"] == "krita"
    assert data["frame"] == struct.pack(">II", 3, 1) + b"7" + b"half way"
    with pytest.raises(TypeError, match="sid must be a client id string"):
        server.send_sync("hello", {}, 5)


def test_the_pack_loop_runs_what_packs_schedule_and_app_exists_only_while_a_server_runs():
    bus, seen = EventBus(), []
    bus.subscribe(lambda event, data: seen.append(data["frame"]))
    server = PackServer(bus)
    asyncio.run_coroutine_threadsafe(server.send_json("from_loop", [1]), server.loop).result(10)
    assert seen == ['{"type": "from_loop", "data": [1]}']
    with pytest.raises(AttributeError, match="'app'.*only in the server process once it has started"):
        server.app
    assert not hasattr(server, "app") and not hasattr(server, "user_manager")
    with pytest.raises(AttributeError, match="no attribute 'user_manager'"):
        server.user_manager
    app, loop = object(), asyncio.new_event_loop()
    server.attach(app, loop)
    assert server.app is app and server.loop is loop
    server.detach(app)
    assert not hasattr(server, "app") and server.loop is not loop
    loop.close()
    assert server.supports == ["custom_nodes_from_web"]


def test_prompt_handlers_run_in_order_and_a_failing_one_is_skipped(caplog):
    server = PackServer()
    server.add_on_prompt_handler(lambda body: {**body, "seen": [*body.get("seen", []), "a"]})
    server.add_on_prompt_handler(lambda body: 1 / 0)
    server.add_on_prompt_handler(lambda body: None)
    server.add_on_prompt_handler(lambda body: {**body, "seen": [*body["seen"], "b"]})
    assert server.trigger_on_prompt({"prompt": {}}) == {"prompt": {}, "seen": ["a", "b"]}
    assert sum("prompt handler" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(TypeError, match="needs a function"):
        server.add_on_prompt_handler("not callable")


def test_a_pack_that_fails_after_adding_routes_and_handlers_leaves_none(tmp_path):
    server = pack_server.install(PackServer())
    (tmp_path / "good_routes.py").write_text(
        "from server import PromptServer\n"
        "@PromptServer.instance.routes.get('/good/ping')\n"
        "async def ping(request):\n    return None\n"
        "NODE_CLASS_MAPPINGS = {}\nWEB_DIRECTORY = '.'\n")
    (tmp_path / "later_fails.py").write_text(
        "from server import PromptServer\n"
        "PromptServer.instance.routes.get('/bad/ping')(lambda request: None)\n"
        "PromptServer.instance.add_on_prompt_handler(lambda body: body)\n"
        "raise RuntimeError('after registering')\n")
    reports = {r.name: r for r in plugins.load_plugins(NodeRegistry(), [tmp_path], server=server)}
    assert reports["good_routes"].status == "loaded" and reports["later_fails"].status == "failed"
    assert [route.path for route in server.routes] == ["/good/ping"] and not server.has_prompt_handlers


# ---------------------------------------------------------------------- comfy.* for H3 checkpoints
def test_safetensors_header_is_the_raw_json_header(tmp_path):
    import comfy.utils

    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(2, 3)}, str(path), metadata={"k": "v"})
    header = json.loads(comfy.utils.safetensors_header(str(path)).decode("utf-8"))
    assert header["a.weight"]["shape"] == [2, 3] and header["__metadata__"] == {"k": "v"}
    assert comfy.utils.safetensors_header(str(path), max_size=8) is None
    (tmp_path / "short.safetensors").write_bytes(struct.pack("<Q", 500) + b"{}")
    with pytest.raises(ValueError, match="declares a 500-byte header but holds only 2 bytes"):
        comfy.utils.safetensors_header(str(tmp_path / "short.safetensors"))


def test_model_detection_knows_h3_transformers_by_their_keys():
    import comfy.model_detection as detection
    import comfy.supported_models as supported

    keys = {"model.diffusion_model.video_patch_proj.weight": None, "model.diffusion_model.audio_patch_proj.weight": None}
    assert detection.detect_unet_config(keys, "model.diffusion_model.", "F32") == {"image_model": "minimax_h3"}
    assert detection.detect_unet_config(keys, "") is None
    assert detection.detect_unet_config({"model.diffusion_model.input_blocks.0.0.weight": None},
                                        "model.diffusion_model.") is None
    assert detection.unet_prefix_from_state_dict(keys) == "model.diffusion_model."
    found = detection.model_config_from_unet(keys, "model.diffusion_model.")
    assert isinstance(found, supported.MiniMaxH3) and found.sampling_settings == {"shift": 12.0, "audio_shift": 3.0}
    assert supported.models == [supported.MiniMaxH3]
    # Families Weft does not run exist by name (packs compare against them) and never match.
    assert supported.SDXLRefiner is not supported.MiniMaxH3 and not supported.SDXL.matches({"image_model": "x"})
    assert not hasattr(supported, "NoSuchFamily")


def test_compat_server_module_names_what_it_lacks():
    import protocol
    import server

    assert server.PromptServer.instance is pack_server.installed()
    assert server.BinaryEventTypes is protocol.BinaryEventTypes
    with pytest.raises(ImportError, match="cannot import name 'nodes'"):
        exec("from server import nodes", {})


def test_the_dry_pass_names_every_missing_module_of_an_import_chain(tmp_path):
    from nodes.plugin_imports import missing_modules

    pack = tmp_path / "chain_pack"
    (pack / "sub").mkdir(parents=True)
    (pack / "__init__.py").write_text("from . import sub\nimport chain_pack.other\nimport server\n")
    (pack / "sub" / "__init__.py").write_text("from .deep import x\nimport weft_fixture_absent_a.b\n")
    (pack / "sub" / "deep.py").write_text("from comfy_extras.nodes_mask import x\nfrom comfy import model_patcher\n"
                                          "if TYPE_CHECKING:\n    import weft_fixture_typing_only\n")
    (pack / "other.py").write_text("import folder_paths, weft_fixture_absent_c\n")
    found = missing_modules(pack, ("custom_nodes.chain_pack", "chain_pack"), plugins.COMPAT_DIR)
    # Breadth first through the pack's own modules; server and folder_paths exist, the TYPE_CHECKING one is skipped.
    assert found == ["weft_fixture_absent_a", "weft_fixture_absent_c", "comfy_extras", "comfy.model_patcher"]


class _ProjectedVAE:
    """A video VAE stand-in whose preview projection comes from its metadata (channel 0 -> red)."""

    kind, name, path = "video", "projected-vae", None

    def __init__(self) -> None:
        config = type("Config", (), {"latent_channels": 4, "spatial_ratio": 2})()
        self.model = type("Model", (), {"config": config})()
        weights = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
        self.metadata = {"weft_latent_rgb": json.dumps({"weights": weights, "bias": [0.0, 0.0, 0.0]})}


def test_latent_preview_callback_reports_progress_and_draws_previews(tmp_path):
    import latent_preview

    events = []
    services = run_context.Services(preview_method="latent2rgb", preview_size=64)

    def emit(event, data):  # as the executor does: a step's preview travels inside its progress event
        events.extend(data.pop(run_context.SHOWN_KEY, ()))
        events.append((event, data))

    ctx = run_context.RunContext("job-2", "3", "3", Paths(tmp_path), emit=emit, runtime=services)
    token = run_context.activate(ctx)
    try:
        from nodes.previews import register_vae

        register_vae(_ProjectedVAE())
        assert latent_preview.MAX_PREVIEW_RESOLUTION == 64
        x0 = torch.zeros(1, 4, 3, 5, 6)
        x0[:, 0] = 1.0  # all red
        kept = {}
        callback = latent_preview.prepare_callback(None, 2, kept)
        callback(0, x0, x0, 2)
        callback(1, x0, x0, 2)
    finally:
        run_context.deactivate(token)
    assert kept["x0"] is x0
    assert [(d["value"], d["max"]) for e, d in events if e == "progress"] == [(1, 2), (2, 2)]
    previews = [d["image"] for e, d in events if e == "preview"]
    assert previews and previews[-1][0] == "JPEG"
    image = previews[-1][1]
    assert image.size == (12, 10)
    assert np.abs(np.asarray(image, dtype=int) - [255, 0, 0]).max() <= 2
    with pytest.raises(AttributeError, match="no attribute 'set_preview_method'"):
        latent_preview.set_preview_method


def test_prompt_queue_reads_the_store_file_and_put_asks_the_server(tmp_path):
    from execution.job_store import JobStore

    events, seen = EventBus(), []
    events.subscribe(lambda event, data: seen.append((event, data)))
    headless = PackServer(events, queue_file=tmp_path / "none.sqlite3")
    assert headless.prompt_queue.get_current_queue() == ([], [])
    with pytest.raises(RuntimeError, match="no server queue in this run"):
        headless.prompt_queue.put((1, "x", {}, {}, []))
    store = JobStore(tmp_path / "jobs.sqlite3")
    try:
        for number, prompt_id in ((1.0, "a"), (2.0, "b")):
            store.add(prompt_id, {"1": {"class_type": "X", "inputs": {}}}, number=number, extra_data={"k": 1},
                      outputs_to_execute=["1"])
        store.claim_next()
        queue = PackServer(events, queue_file=tmp_path / "jobs.sqlite3").prompt_queue
        running, pending = queue.get_current_queue()
        [(number, prompt_id, prompt, extra_data, outputs)] = running
        assert (number, prompt_id, prompt, extra_data["k"], outputs) == (1, "a", {"1": {"class_type": "X", "inputs": {}}},
                                                                         1, ["1"])
        assert [item[1] for item in pending] == ["b"] and queue.get_tasks_remaining() == 2
        assert list(queue.currently_running.values()) == running
        with pytest.raises(TypeError, match="API prompt as a dict"):
            queue.put((1, "c", "not a prompt"))
        queue.put((-3, "not-a-uuid", {"1": {}}, {"client_id": "me"}, ["1"]))
    finally:
        store.close()
    [(event, data)] = seen
    assert event == "pack_requeue" and data["number"] == -3 and data["prompt"] == {"1": {}}
    assert len(data["prompt_id"]) == 36 and data["extra_data"] == {"client_id": "me"}
