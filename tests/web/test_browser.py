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


TEMPLATE = "video_minimax_h3_t2v"
DOCS_SHOT = ROOT / "docs" / "editor-h3.png"

# Collects every line the logs panel's terminal holds: it draws only the rows in view, so the test scrolls
# its viewport from top to bottom and reads the rows at each position.
READ_LOGS_PANEL = """(async () => {
    const viewport = document.querySelector('.xterm-viewport');
    if (!viewport) return null;
    const lines = [];
    const frame = () => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
    for (let top = 0; ; top += Math.max(1, viewport.clientHeight / 2)) {
        viewport.scrollTop = top;
        viewport.dispatchEvent(new Event('scroll'));
        await frame();
        for (const row of document.querySelectorAll('.xterm-rows > div')) lines.push(row.textContent);
        if (top >= viewport.scrollHeight - viewport.clientHeight) break;
    }
    return lines.join('\\n');
})()"""

# Every node's box (title bar included) on screen, and the canvas element's size, in CSS pixels.
NODES_ON_SCREEN = f"""(() => {{
    const canvas = {APP}.canvas, ds = canvas.ds, title = LiteGraph.NODE_TITLE_HEIGHT;
    const boxes = {APP}.graph.nodes.map(n => [n.id, n.type,
        (n.pos[0] + ds.offset[0]) * ds.scale, (n.pos[1] - title + ds.offset[1]) * ds.scale,
        (n.pos[0] + n.size[0] + ds.offset[0]) * ds.scale, (n.pos[1] + n.size[1] + ds.offset[1]) * ds.scale]);
    const rect = canvas.canvas.getBoundingClientRect();
    return {{boxes, width: rect.width, height: rect.height}};
}})()"""


def _released_models(tmp_path_factory) -> Path:
    """The tiny released-format files the official H3 templates name, written once per session."""
    from models.h3.tiny_released import write_released

    root = tmp_path_factory.getbasetemp() / "released_models_browser"
    if not (root / ".written").is_file():
        write_released(root)
        (root / ".written").touch()
    return root


def _link_tree(source: Path, target: Path) -> None:
    for path in (p for p in source.rglob("*") if p.is_file() and p.name != ".written"):
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            try:
                dest.hardlink_to(path)
            except OSError:
                dest.write_bytes(path.read_bytes())


def _save_small_png(shot: Path, target: Path, limit_bytes: int = 200_000) -> None:
    """The screenshot as a palette PNG under `limit_bytes` (the README shows it)."""
    from PIL import Image

    with Image.open(shot) as image:
        image = image.convert("RGB")
        for colours in (256, 128, 64):
            image.quantize(colours, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)
            if target.stat().st_size < limit_bytes:
                return
    raise AssertionError(f"{target} is {target.stat().st_size} bytes even at 64 colours")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package `chromium`; .ci/run installs "
                                             "it when run as root)")
def test_official_h3_template_from_the_browser_fits_runs_logs_and_shows_decode_progress(server, tmp_path,
                                                                                        tmp_path_factory):
    """A user's first run: the official H3 text-to-video template opened from the template browser is in
    view, runs with its widgets turned down, the logs panel shows the run's lines and a failed node's
    traceback, and the VAE decode node reports progress. WEFT_DOCS_SCREENSHOT=1 also writes the README's
    picture (docs/editor-h3.png)."""
    import os

    _link_tree(_released_models(tmp_path_factory), server.runtime.paths.base / "models")
    origin = server.url
    decode = "140:122"  # the template's VAE Decode, inside its subgraph node 140

    async def scenario() -> tuple[Path, dict]:
        browser = Browser(CHROMIUM, tmp_path / "profile")
        await browser.start()
        try:
            await browser.navigate(origin + "/")
            await browser.wait_for("window.comfyAPI?.app?.app?.graph?.nodes?.length > 0", timeout=120)
            await browser.evaluate("""(() => {
                const seen = window.__weftSeen = {progress: {}, done: null, failed: null, traceback: null};
                const api = window.comfyAPI.api.api;
                api.addEventListener('progress_state', ({detail}) => {
                    for (const [id, node] of Object.entries(detail.nodes))
                        (seen.progress[id] ??= []).push([node.value, node.max]);
                });
                api.addEventListener('execution_success', ({detail}) => { seen.done = detail.prompt_id; });
                api.addEventListener('execution_error', ({detail}) => {
                    seen.failed = detail.exception_message; seen.traceback = detail.traceback; });
            })()""")
            commands = f"{APP}.extensionManager.command"
            # Draw nodes in full at any zoom, so the picture shows their widgets (the editor simplifies small ones).
            await browser.evaluate(f"{APP}.extensionManager.setting.set('LiteGraph.Canvas.MinFontSizeForLOD', 0)")
            await browser.evaluate(f"{commands}.execute('Workspace.ToggleBottomPanelTab.logs-terminal')")
            await browser.wait_for("document.querySelector('.xterm-rows') !== null", timeout=30)

            # The template browser lists the official template (found with its search box, as the list shows
            # the first few dozen); a click on its card opens it.
            await browser.evaluate(f"{commands}.execute('Comfy.BrowseTemplates')")
            await browser.wait_for("document.querySelector('[role=dialog] input[type=text]') !== null", timeout=60)
            await browser.evaluate("""(() => {
                const box = document.querySelector('[role=dialog] input[type=text]');
                Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(box, 'MiniMax H3 text to video');
                box.dispatchEvent(new Event('input', {bubbles: true}));
            })()""")
            card = f"document.querySelector('[data-testid=\"template-workflow-{TEMPLATE}\"]')"
            await browser.wait_for(f"{card} !== null", timeout=60)
            await browser.evaluate(f"{card}.click()")
            await browser.wait_for(f"{APP}.graph.nodes.some(n => n.type === 'ResolutionSelector')", timeout=60)
            await browser.wait_for(f"!{card}", timeout=30)  # the browser closed
            await asyncio.sleep(0.5)
            view = await browser.evaluate(NODES_ON_SCREEN)
            outside = [b for b in view["boxes"] if b[2] < 0 or b[3] < 0 or b[4] > view["width"] or b[5] > view["height"]]
            assert not outside, (view["width"], view["height"], outside)

            # Turn the widgets down as a user would for a quick try, then queue it from the editor.
            turned = await browser.evaluate(f"""(() => {{
                const set = {{duration: 0.2, turbo_mode: true, turbo_steps: 2, megapixels: 0.1}};
                const changed = [];
                for (const node of {APP}.graph.nodes)  // a subgraph's widgets show their exposed name as label
                    for (const widget of node.widgets ?? []) {{
                        const shown = widget.label ?? widget.name;
                        if (shown in set) {{ widget.value = set[shown]; changed.push(shown); }}
                    }}
                return changed.sort();
            }})()""")
            assert turned == ["duration", "megapixels", "turbo_mode", "turbo_steps"], turned
            assert await browser.evaluate(f"{APP}.queuePrompt(0, 1).then(r => r !== false)")
            await browser.wait_for("window.__weftSeen.done || window.__weftSeen.failed", timeout=300)
            seen = await browser.evaluate("window.__weftSeen")
            assert seen["failed"] is None, seen["failed"]
            await asyncio.sleep(1.0)  # the panel receives its lines in batches
            shot = await browser.screenshot(tmp_path / "editor_template.png", scale=0.75)
            ran_log = await browser.evaluate(READ_LOGS_PANEL)

            # A node that fails: its traceback reaches the panel too.
            failing = {"1": {"class_type": "ManualSigmas", "inputs": {"sigmas": "no numbers"}},
                       "2": {"class_type": "TestOutput", "inputs": {"value": ["1", 0]}}}
            await browser.evaluate(f"window.comfyAPI.api.api.queuePrompt(0, {{output: {json.dumps(failing)}}})")
            await browser.wait_for("window.__weftSeen.failed", timeout=60)
            await browser.wait_for(f"{READ_LOGS_PANEL}.then(t => t && t.includes('Traceback'))", timeout=30)
            failed_log = await browser.evaluate(READ_LOGS_PANEL)
            errors = [e for e in browser.console_errors() if not _external(e, origin)]
            failed = browser.failed_requests(origin)
            assert not failed, failed
            assert not errors, errors
            return shot, {**seen, "ran_log": ran_log, "failed_log": failed_log}
        finally:
            await browser.close()

    shot, seen = asyncio.run(scenario())
    assert "got prompt" in seen["ran_log"] and re.search(r"executed in \d+\.\d+ seconds", seen["ran_log"]), \
        seen["ran_log"]
    assert "Traceback" in seen["failed_log"] and "ManualSigmas" in seen["failed_log"], seen["failed_log"]
    steps = seen["progress"].get(decode)
    assert steps and steps[-1][0] == steps[-1][1] > 0, seen["progress"]
    # The job ran the turned-down values the editor sent from the subgraph's widgets.
    jobs, _ = server.state.store.list(["success"])
    (job,) = [j for j in jobs if "140:133" in j.prompt]
    assert job.prompt["140:133"]["inputs"]["value"] == 0.2 and job.prompt["140:138"]["inputs"]["value"] == 2
    assert job.prompt["140:139"]["inputs"]["value"] is True and job.prompt["115"]["inputs"]["megapixels"] == 0.1
    assert max(total for _, total in seen["progress"]["140:125"]) == 2  # the sampler's two steps
    if os.environ.get("WEFT_DOCS_SCREENSHOT"):
        _save_small_png(shot, DOCS_SHOT)
