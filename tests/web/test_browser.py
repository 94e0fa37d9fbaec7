"""The official editor in a real headless Chromium, driven over the DevTools protocol, against Weft's server."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from tests.web.cdp import Browser, find_chromium

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = find_chromium()
APP = "window.comfyAPI.app.app"


def _external(text: str, origin: str) -> bool:
    """An error about a request to another host (the editor checks for releases online; tests run offline)."""
    urls = re.findall(r"(?:https?|wss?)://[^\s'\"]+", text)
    return bool(urls) and all(not u.replace("ws://", "http://").startswith(origin) for u in urls)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`; .ci/run installs "
                                             "it when run as root)")
def test_editor_loads_lists_nodes_runs_the_default_workflow_and_shows_the_output(server, tmp_path):
    origin = server.url
    default = json.loads((ROOT / "workflows" / "default.json").read_text())

    async def scenario() -> Path:
        browser = Browser(CHROMIUM, tmp_path / "profile")
        await browser.start()
        try:
            await browser.navigate(origin + "/")
            # A fresh editor opens Weft's default graph (settings from the first start + our extension).
            await browser.wait_for(f"window.comfyAPI?.app?.app?.graph?.nodes?.length > 0", timeout=120)
            types = await browser.evaluate(f"{APP}.graph.nodes.map(n => n.type)")
            assert sorted(types) == sorted(n["type"] for n in default["nodes"])
            registered = await browser.evaluate("Object.keys(LiteGraph.registered_node_types)")
            assert {"EmptyImage", "ImageScale", "SaveImage", "GetImageSize", "TestConst", "WebTestPreviews"} <= set(registered)
            listed = await browser.evaluate("fetch('api/object_info').then(r => r.json()).then(o => Object.keys(o))")
            assert set(listed) <= set(registered), set(listed) - set(registered)

            # Load the default workflow explicitly, as a user opening the file would, and queue it.
            await browser.evaluate(f"{APP}.loadGraphData({json.dumps(default)})")
            await browser.wait_for(f"{APP}.graph.nodes.length === {len(default['nodes'])}")
            assert await browser.evaluate(f"{APP}.queuePrompt(0, 1).then(r => r !== false)")
            source = await browser.wait_for(
                f"(() => {{ const n = {APP}.graph.nodes.find(n => n.type === 'SaveImage');"
                " const img = n && n.imgs && n.imgs[0];"
                " return img && img.complete && img.naturalWidth > 0 ? `${img.naturalWidth}x${img.naturalHeight} ${img.src}` : null; })()",
                timeout=120)
            size, url = source.split(" ", 1)
            assert size == "512x384" and url.startswith(origin + "/api/view?") and "default_" in url
            await asyncio.sleep(1.0)  # let the queue and history panels refresh after the run
            shot = await browser.screenshot(tmp_path / "editor.png")
            errors = [e for e in browser.console_errors() if not _external(e, origin)]
            failed = browser.failed_requests(origin)
            assert not failed, failed
            assert not errors, errors
            return shot
        finally:
            await browser.close()

    shot = asyncio.run(scenario())
    print(f"\nscreenshot of the editor after the run: {shot}")
    assert shot.stat().st_size > 10_000
    # The job the editor queued carried its workflow and ran to success.
    jobs, _ = server.state.store.list(["success"])
    editor_jobs = [j for j in jobs if (j.extra_data.get("extra_pnginfo") or {}).get("workflow")]
    assert editor_jobs and editor_jobs[0].outputs["3"]["images"][0]["filename"].startswith("default_")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`; .ci/run installs "
                                             "it when run as root)")
def test_h3_default_run_moves_the_sampler_progress_and_draws_previews(server, tmp_path, tmp_path_factory):
    """The H3 default workflow in the editor: the sampler node's own progress reaches 1.0, live previews
    arrive and are drawn, and nothing Weft serves fails."""
    from tests.nodes.test_h3_nodes import install, tiny_weights

    install(tiny_weights(tmp_path_factory), server.runtime.paths.base)
    origin = server.url
    workflow = json.loads((ROOT / "workflows" / "h3_t2va.json").read_text())
    (sampler,) = [str(n["id"]) for n in workflow["nodes"] if n["type"] == "SamplerCustomAdvanced"]

    async def scenario() -> tuple[Path, dict]:
        browser = Browser(CHROMIUM, tmp_path / "profile")
        await browser.start()
        try:
            await browser.navigate(origin + "/")
            await browser.wait_for(f"window.comfyAPI?.app?.app?.graph?.nodes?.length > 0", timeout=120)
            # Record what the editor hears, from the editor's own api object.
            await browser.evaluate("""(() => {
                const seen = window.__weftSeen = {previews: 0, progress: {}, done: null, failed: null};
                const api = window.comfyAPI.api.api;
                api.addEventListener('b_preview', () => { seen.previews += 1; });
                api.addEventListener('progress_state', ({detail}) => {
                    for (const [id, node] of Object.entries(detail.nodes))
                        seen.progress[id] = Math.max(seen.progress[id] ?? 0, node.value / node.max);
                });
                api.addEventListener('execution_success', ({detail}) => { seen.done = detail.prompt_id; });
                api.addEventListener('execution_error', ({detail}) => { seen.failed = detail.exception_message; });
            })()""")
            await browser.evaluate(f"{APP}.loadGraphData({json.dumps(workflow)})")
            await browser.wait_for(f"{APP}.graph.nodes.length === {len(workflow['nodes'])}")
            assert await browser.evaluate(f"{APP}.queuePrompt(0, 1).then(r => r !== false)")
            await browser.wait_for("window.__weftSeen.done || window.__weftSeen.failed", timeout=600)
            seen = await browser.evaluate("window.__weftSeen")
            assert seen["failed"] is None, seen["failed"]
            # The sampler node drew a preview: the editor keeps it as the node's preview image.
            drawn = await browser.wait_for(
                f"(() => {{ const n = {APP}.graph.getNodeById({sampler});"
                " const img = n && n.imgs && n.imgs[0];"
                " return img && img.complete && img.naturalWidth > 0 ? img.naturalWidth : null; })()", timeout=60)
            await asyncio.sleep(1.0)
            shot = await browser.screenshot(tmp_path / "editor_h3.png")
            errors = [e for e in browser.console_errors() if not _external(e, origin)]
            failed = browser.failed_requests(origin)
            assert not failed, failed
            assert not errors, errors
            return shot, {**seen, "drawn_width": drawn}
        finally:
            await browser.close()

    shot, seen = asyncio.run(scenario())
    print(f"\nscreenshot of the editor after the H3 run: {shot}")
    assert shot.stat().st_size > 10_000
    assert seen["progress"].get(sampler) == 1.0, seen["progress"]
    assert seen["previews"] >= 1 and seen["drawn_width"] > 0
