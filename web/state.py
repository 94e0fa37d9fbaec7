"""What every route handler reaches: the runtime, the job store and worker, the websocket hub, the folders."""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from aiohttp import web

from execution.errors import PromptError
from execution.job_runner import JobHooks, JobRunner
from execution.job_store import STORE_FILE, JobStore
from execution.placement import model_bytes, named_files
from execution.worker import LocalProcessTransport, RemoteWorker
from web.security import JsonTooDeep, SecurityConfig, check_json_depth
from web.websocket import EventBridge, Hub

if TYPE_CHECKING:
    from execution.events import EventBus
    from execution.paths import Paths
    from execution.scheduler import Executor
    from execution.spec import Registry
    from execution.validation import ValidatedPrompt

WEB_DIR = Path(__file__).resolve().parent
REPO_ROOT = WEB_DIR.parent
WEFT_VERSION = "0.1.0"
logger = logging.getLogger(__name__)
JOBS_LOG = logging.getLogger("weft.jobs")  # what a person follows jobs by (web/logs.py sets it to INFO)
SINGLE_USER = "default"  # the user folder under --user-directory when one person uses the server


@dataclass
class ServerConfig:
    """How the server is set up (from the command line, or by tests)."""

    host: str = "127.0.0.1"  # listen addresses, comma-separated (ComfyUI's --listen)
    port: int = 8188
    security: SecurityConfig = field(default_factory=SecurityConfig)
    front_end_root: Path | None = None  # None: the installed comfyui-frontend-package's static folder
    workflows_dir: Path = REPO_ROOT / "workflows"  # served as the editor's templates
    extensions_dir: Path = WEB_DIR / "extensions"  # our own editor extensions, at /extensions/weft/
    history_cap: int = 10_000  # finished jobs kept in the history
    max_pixels: int = 64_000_000  # uploaded / decoded images: total pixels
    max_edge: int = 16_384  # uploaded / decoded images: pixels on either edge
    # How the job worker process builds its runtime (execution.worker.RuntimeRecipe). None: jobs run on
    # a thread of the server's own process (a node that never yields then stalls the server).
    worker_recipe: Any = None
    # Several workers (execution.worker.WorkerPool), built from (runtime, config) when the server starts:
    # main.py wires the Ray pool here for --workers / --ray-address. None: one worker, as above.
    worker_pool: Callable[[Any, "ServerConfig"], Any] | None = None
    interrupt_grace_s: float = 10.0  # after an interrupt, a node gets this long before its worker is killed


class AppRuntime(Protocol):
    """What the server needs of the runtime main.py wires (`main.Runtime`)."""

    paths: Paths
    registry: Registry
    events: EventBus
    executor: Executor
    plugin_reports: Sequence[Any]  # the plugin loader's reports, one per plugin found
    # Optional `pack_server`: what node packs see as ComfyUI's PromptServer.instance (nodes/pack_server.py):
    # its `routes` are served, `trigger_on_prompt(body)` sees every POST /prompt body, and
    # `attach(app, loop)` / `detach(app)` tell it the server runs.

    def validate(self, prompt: dict, *, partial_targets: list[str] | None = None) -> ValidatedPrompt:
        """Validate an API prompt (PromptError when nothing can run)."""

    def prepare(self, data: Any, *, partial_targets: list[str] | None = None,
                adjust: Callable[[Any], None] | None = None) -> tuple[Any, ValidatedPrompt]:
        """(API prompt, validated prompt) from a UI- or API-format workflow."""

    def unload_models(self) -> None:
        """Forget the loaded models, so their memory can be freed."""


def default_front_end_root() -> Path | None:
    """The official editor's static folder from the installed `comfyui-frontend-package`."""
    try:
        import importlib.resources as resources

        root = Path(str(resources.files("comfyui_frontend_package") / "static"))
    except (ModuleNotFoundError, TypeError):
        return None
    return root if (root / "index.html").is_file() else None


class ServerState:
    """The server's parts, wired once per application."""

    def __init__(self, runtime: AppRuntime, config: ServerConfig) -> None:
        from execution.scheduler import JobControl

        self.runtime = runtime
        self.config = config
        self.paths = runtime.paths
        self.user_root = Path(self.paths.user) / SINGLE_USER
        self.front_end_root = Path(config.front_end_root).resolve() if config.front_end_root else default_front_end_root()
        self.store = JobStore(Path(self.paths.user) / STORE_FILE, history_cap=config.history_cap)
        self.hub = Hub()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.bridge: EventBridge | None = None
        self.plugin_web_dirs: dict[str, Path] = {}
        self.packs = getattr(runtime, "pack_server", None)  # node packs' PromptServer.instance, when plugins load
        self._job_clients: dict[str, str | None] = {}
        self._status_scheduled = False
        self._lock = threading.Lock()
        workers = None
        self.pool = None
        if config.worker_pool is not None:
            self.pool = config.worker_pool(runtime, config)
            workers = self.pool.workers
        elif config.worker_recipe is not None:
            recipe = config.worker_recipe
            workers = [RemoteWorker(lambda: LocalProcessTransport(recipe), runtime.events,
                                    grace_s=config.interrupt_grace_s)]
        placing = workers is not None and len(workers) > 1
        self.runner = JobRunner(self.store, JobHooks(
            validate=lambda prompt, targets: runtime.validate(prompt, partial_targets=targets),
            run=runtime.executor.run, make_control=JobControl, on_start=self._on_start,
            on_finish=self._on_finish, on_queue_change=self.queue_changed, emit=runtime.events.emit,
            free=self._free_in_process,
            files_of=(lambda job: named_files(job.prompt, runtime.registry, self.paths)) if placing else None,
            model_sizes=lambda models: model_bytes(self.paths, models)),
            workers=workers, output_folders=(Path(self.paths.output), Path(self.paths.temp)))
        for report in runtime.plugin_reports:
            web_dir = getattr(report, "web_directory", None)
            if getattr(report, "status", "") == "loaded" and web_dir:
                self.plugin_web_dirs[report.name] = Path(web_dir)

    # ------------------------------------------------------------------ plugins
    def add_plugin_web_dirs(self, dirs: dict[str, Path]) -> None:
        """Serve each plugin's web folder at /extensions/<name>/ and list its .js files in /extensions."""
        for name, folder in dirs.items():
            if not name or "/" in name or name in ("weft", "core") or name.startswith("."):
                raise ValueError(f"plugin web folder name {name!r} cannot be served under /extensions/")
            self.plugin_web_dirs[name] = Path(folder).resolve()

    def _free_in_process(self, unload_models: bool) -> None:
        """Jobs running in this process: clear the output cache (and unload models)."""
        self.runtime.executor.cache.clear()
        if unload_models:
            self.runtime.unload_models()

    # ------------------------------------------------------------------ accepting prompts
    def enqueue(self, prompt: Any, *, prompt_id: str, number: float | None = None, front: bool = False,
                client_id: str | None = None, extra_data: dict | None = None,
                targets: list[str] | None = None) -> tuple[Any, ValidatedPrompt]:
        """Validate `prompt` (API or editor format), store it durably and hand it to the runner: what
        POST /prompt and a pack's re-queue both do. Blocking (validation): call it off the event loop.
        PromptError when it cannot run or cannot be queued."""
        extra_data = {} if extra_data is None else extra_data
        api_prompt, validated = self.runtime.prepare(prompt, partial_targets=targets)
        try:  # node packs' prompt handlers and the workflow conversion ran since the body was read
            check_json_depth(api_prompt, what="the prompt is")
            check_json_depth(extra_data, what="'extra_data' is")
        except JsonTooDeep as exc:
            raise PromptError("invalid_prompt", str(exc)) from None
        queue_number = float(number) if number is not None else self.store.next_number(front=front)
        if number is not None and front:
            queue_number = -abs(queue_number)
        try:
            job = self.store.add(prompt_id, api_prompt, number=queue_number, client_id=client_id,
                                 extra_data=extra_data, outputs_to_execute=list(validated.outputs),
                                 partial_targets=targets)
        except ValueError as exc:
            raise PromptError("invalid_prompt", str(exc)) from None
        JOBS_LOG.info("got prompt %s", prompt_id)  # the logs panel's first line of every job, as in ComfyUI
        self.runner.submitted(prompt_id, validated)
        self.queue_changed()
        return job, validated

    def _pack_requeued(self, event: str, data: dict) -> None:
        """EventBus subscriber: a node pack put a prompt back on the queue (nodes/pack_server.py)."""
        if event != "pack_requeue" or self.loop is None:
            return

        def accept() -> None:
            try:
                self.enqueue(data["prompt"], prompt_id=data["prompt_id"], number=data.get("number"),
                             client_id=(data.get("extra_data") or {}).get("client_id"),
                             extra_data=data.get("extra_data"))
            except PromptError as error:
                logger.warning("a node pack re-queued prompt %s, which was refused: %s", data.get("prompt_id"),
                               error.to_json().get("error", {}).get("message"))
            except Exception:
                logger.warning("a node pack re-queued prompt %s, which could not be queued", data.get("prompt_id"),
                               exc_info=True)

        self.loop.call_soon_threadsafe(self.loop.run_in_executor, None, accept)

    # ------------------------------------------------------------------ queue status
    def queue_status(self) -> dict:
        """The `status` payload: jobs pending or running."""
        return {"exec_info": {"queue_remaining": self.store.queue_remaining()}}

    def queue_changed(self) -> None:
        """Tell every websocket the queue length (coalesced; callable from any thread)."""
        if self.loop is None:
            return
        with self._lock:
            if self._status_scheduled:
                return
            self._status_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._send_status)
        except RuntimeError:
            pass

    def _send_status(self) -> None:
        with self._lock:
            self._status_scheduled = False
        self.hub.send_json("status", {"status": self.queue_status()}, broadcast=True)

    # ------------------------------------------------------------------ job events
    def client_of(self, prompt_id: str) -> str | None:
        """The client id that submitted a running job (None: broadcast)."""
        return self._job_clients.get(prompt_id)

    def _on_start(self, job) -> None:
        self._job_clients[job.id] = job.client_id

    def _on_finish(self, job, status: str) -> None:
        if self.bridge is not None:
            self.bridge.job_finished(job.id, drop=status == "requeued")
        self._job_clients.pop(job.id, None)

    # ------------------------------------------------------------------ lifecycle
    async def startup(self, app: web.Application) -> None:
        """Subscribe the websocket bridge to the engine's events and start the job worker."""
        self.loop = asyncio.get_running_loop()
        self.bridge = EventBridge(self.loop, self.hub, self.client_of)
        self._unsubscribe = self.runtime.events.subscribe(self.bridge)
        self._unsubscribe_requeue = self.runtime.events.subscribe(self._pack_requeued)
        if self.packs is not None:
            self.packs.attach(app, self.loop)
        self.runner.start()

    async def shutdown(self, app: web.Application) -> None:
        """Stop the worker (a running job goes back to the queue), close sockets and the store."""
        await asyncio.get_running_loop().run_in_executor(None, self.runner.stop)
        if self.pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.pool.close)
        self._unsubscribe()
        self._unsubscribe_requeue()
        if self.packs is not None:
            self.packs.detach(app)
        await self.hub.close_all()
        self.store.close()


STATE_KEY = web.AppKey("weft_state", ServerState)
