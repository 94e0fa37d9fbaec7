"""The aiohttp application: ComfyUI's protocol, the official editor, durable jobs, a guarded door.

    python main.py [--listen [HOST]] [--port 8188] [--max-upload-size MB] [--front-end-root DIR] ...

`create_app(runtime, config)` builds the application (tests start it on a free port with
`start_server`); `main(argv, ...)` is what `python main.py` runs.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
import secrets
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from execution.worker import RuntimeRecipe
from web import files, logs, routes
from web.flags import build_parser  # noqa: F401 (the server's flags, torch- and aiohttp-free)
from web.security import SecurityConfig, is_loopback_host, security_middleware
from web.state import STATE_KEY, AppRuntime, ServerConfig, ServerState

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def route_table() -> list[tuple[str, str, Any]]:
    """Every (method, path, handler) served both bare and under /api."""
    table: list[tuple[str, str, Any]] = []
    routes.add_routes(table)
    files.add_routes(table)
    logs.add_routes(table)
    return table


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    """The `/ws?clientId=` endpoint."""
    state = request.app[STATE_KEY]
    return await state.hub.handle(request, status=state.queue_status, features=routes.server_features(state))


# JSON bodies above this many bytes are gzipped for clients that accept it (/object_info is ~70 KB);
# smaller ones gain less than the compression costs.
GZIP_MIN_BYTES = 4096


@web.middleware
async def gzip_json_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Compress large JSON replies when the request's Accept-Encoding allows gzip."""
    response = await handler(request)
    if (type(response) is web.Response and response.content_type == "application/json"
            and isinstance(response.body, (bytes, bytearray)) and len(response.body) > GZIP_MIN_BYTES
            and "gzip" in request.headers.get("Accept-Encoding", "").lower()
            and "Content-Encoding" not in response.headers):
        response.enable_compression(web.ContentCoding.gzip)
        response.headers.add("Vary", "Accept-Encoding")
    return response


def create_app(runtime: AppRuntime, config: ServerConfig) -> web.Application:
    """The application for `runtime` (paths, registry, events, executor, validate)."""
    state = ServerState(runtime, config)
    files.ensure_user_folder(state)
    files.sweep_upload_spool(state)  # uploads a stopped server was receiving
    # client_max_size caps a body without Content-Length while it is read; the middleware refuses a
    # declared oversize body before reading it.
    app = web.Application(client_max_size=config.security.max_body_bytes,
                          middlewares=[security_middleware(config.security), gzip_json_middleware])
    app[STATE_KEY] = state
    files.init_app_keys(app)
    for prefix in ("", "/api"):
        app.router.add_get(prefix + "/ws", websocket_handler)
        for method, path, handler in route_table():
            app.router.add_route(method, prefix + path, handler)
    files.add_template_routes(app)
    mount_pack_routes(app, state.packs, claims=WeftClaims.of(app, state.front_end_root))
    files.add_editor_route(app)  # last: it matches every path no other route took
    logs.install(app)
    app.on_startup.append(state.startup)
    app.on_shutdown.append(_close_websockets)
    app.on_cleanup.append(state.shutdown)
    return app


@dataclass
class WeftClaims:
    """The paths Weft serves itself, which no node pack route may take: its API and template routes (as
    sample paths and as patterns), the editor's files and folders, and the extension folders."""

    paths: set[str]
    patterns: list[re.Pattern]
    folders: tuple[str, ...]  # prefixes ending in "/": everything below them is Weft's

    @classmethod
    def of(cls, app: web.Application, front_end_root: Path | None) -> "WeftClaims":
        """What `app`'s routes registered so far, plus the editor's files under `front_end_root`, claim."""
        paths = {"/", "/index.html", "/user.css"}
        patterns = []
        for resource in app.router.resources():
            info = resource.get_info()
            if "path" in info:
                paths.add(info["path"])
            elif "formatter" in info:
                paths.add(_sample_path(info["formatter"]))
                patterns.append(info["pattern"])
        folders = {"/extensions/"}  # Weft's own editor extensions and plugins' web folders
        if front_end_root is not None and front_end_root.is_dir():
            for path in front_end_root.rglob("*"):
                relative = "/" + path.relative_to(front_end_root).as_posix()
                if path.is_file():
                    paths.add(relative)
                elif path.parent == front_end_root:
                    folders.add(relative + "/")
        return cls(paths, patterns, tuple(sorted(folders)))

    def clash(self, mount: Any) -> str | None:
        """What of Weft's `mount` (a pack's RouteDef or StaticDef) would take; None when nothing."""
        if isinstance(mount, web.StaticDef):
            prefix = mount.prefix.rstrip("/")
            if not prefix:
                return "the whole site"
            taken = next((p for p in sorted(self.paths) if p == prefix or p.startswith(prefix + "/")), None)
            if taken:
                return taken
            return next((f for f in self.folders if (prefix + "/").startswith(f)), None)
        info = web.UrlDispatcher().add_resource(mount.path).get_info()
        if "path" in info:
            sample, matches = info["path"], info["path"].__eq__
        else:
            sample, matches = _sample_path(info["formatter"]), info["pattern"].fullmatch
        taken = next((p for p in sorted(self.paths) if matches(p)), None)
        if taken:
            return taken
        if any(pattern.fullmatch(sample) for pattern in self.patterns):
            return sample
        return next((f for f in self.folders if sample.startswith(f)), None)


def _sample_path(formatter: str) -> str:
    """A concrete path a route's formatter (`/settings/{setting_id}`) matches."""
    return re.sub(r"\{[^}]*\}", "x", formatter)


def mount_pack_routes(app: web.Application, packs: Any, *, claims: WeftClaims) -> None:
    """Serve the routes node packs declared on PromptServer.instance.routes, bare and under /api like
    Weft's own; a route that would take any path Weft serves itself (`claims`) is refused with a log
    line, so a pack can add pages but never replace the editor or the API. Static folders are served
    bare only."""
    for route in getattr(packs, "routes", ()):
        if isinstance(route, web.StaticDef):
            mounts = [web.StaticDef(route.prefix, route.path, route.kwargs)]
        elif isinstance(route, web.RouteDef):
            mounts = [web.RouteDef(route.method, prefix + route.path, route.handler, route.kwargs)
                      for prefix in ("", "/api")]
        else:
            logger.warning("node pack route %r is neither a route nor a static folder; not served", route)
            continue
        for mount in mounts:
            try:
                taken = claims.clash(mount)
                if taken:
                    logger.warning("node pack route %s is not served: it would take %s, which Weft serves",
                                   _describe(mount), taken)
                    continue
                mount.register(app.router)
            except (RuntimeError, ValueError) as exc:  # a malformed path, or one aiohttp refuses
                logger.warning("node pack route %s is not served: %s", _describe(mount), exc)


def _describe(route: Any) -> str:
    if isinstance(route, web.StaticDef):
        return f"static {route.prefix}"
    return f"{route.method} {route.path} ({getattr(route.handler, '__module__', '?')})"


async def _close_websockets(app: web.Application) -> None:
    await app[STATE_KEY].hub.close_all()


def add_plugin_web_dirs(app: web.Application, dirs: dict[str, Path]) -> None:
    """Serve plugins' web folders at /extensions/<name>/ (and list their .js files in /extensions)."""
    app[STATE_KEY].add_plugin_web_dirs(dirs)


# ---------------------------------------------------------------------- running
@dataclass
class RunningServer:
    """A started server (tests and the benchmark use it; `main` uses it too)."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        """The base URL clients use."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def state(self) -> ServerState:
        """The running application's state."""
        return self.app[STATE_KEY]

    async def stop(self) -> None:
        """Stop serving; a running job goes back to the queue."""
        await self.runner.cleanup()


async def start_server(runtime: AppRuntime, config: ServerConfig) -> RunningServer:
    """Start the application on config.host (comma-separated) and config.port (0: a free port)."""
    app = create_app(runtime, config)
    # auto_decompress=False: aiohttp would inflate a compressed body on the event loop as it arrives,
    # before any check; the security middleware inflates it after its checks, off the loop, bounded.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                           auto_decompress=False)
    await runner.setup()
    hosts = [h.strip() for h in config.host.split(",")] or ["127.0.0.1"]
    port = config.port
    listening, failures = [], []
    for host in hosts:
        site = web.TCPSite(runner, host or None, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:  # e.g. "::" on a machine without IPv6: serve on the other addresses
            failures.append(f"{host}: {exc}")
            continue
        listening.append(host)
        if port == 0:  # the others listen on the same port the first one got
            port = site._server.sockets[0].getsockname()[1]
    if not listening:
        await runner.cleanup()
        raise OSError("; ".join(failures))
    for failure in failures:
        logger.warning("not listening on %s", failure)
    return RunningServer(app, runner, listening[0] or "0.0.0.0", port)


def _local_names() -> set[str]:
    """Names and addresses of this machine (the hosts a wildcard listener may be reached by)."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            for address in addresses:
                if address.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(address.address.split("%")[0].lower())
    except Exception:  # interface listing is best effort; --allowed-hosts covers the rest
        pass
    return {n for n in names if n}


def security_from_args(args: argparse.Namespace, *, announce: Callable[[str], None] = print) -> SecurityConfig:
    """The security settings the flags ask for; generates and announces a token when one is needed."""
    hosts = [h.strip() for h in args.listen.split(",")]
    loopback_only = all(h and is_loopback_host(h) for h in hosts)
    allowed = {h.strip().lower() for h in (args.allowed_hosts or "").split(",") if h.strip()}
    for host in hosts:
        if host in WILDCARD_HOSTS:
            allowed |= _local_names()
        elif not is_loopback_host(host):
            allowed.add(host.strip("[]").lower())
    token = None
    if not loopback_only and not args.insecure_no_auth:
        token = args.token or secrets.token_urlsafe(24)
        if not args.token:
            announce(f"access token (needed because the server listens on {args.listen}): {token}")
    elif args.token:
        token = args.token
    return SecurityConfig(max_body_bytes=int(args.max_upload_size * 2**20), token=token,
                          allowed_hosts=frozenset(allowed))


def config_from_args(args: argparse.Namespace, *, announce: Callable[[str], None] = print) -> ServerConfig:
    """The server configuration the parsed flags ask for."""
    if args.front_end_root is not None and not (Path(args.front_end_root) / "index.html").is_file():
        raise SystemExit(f"--front-end-root {args.front_end_root}: no index.html in that folder")
    if args.interrupt_grace <= 0:
        raise SystemExit("--interrupt-grace must be a positive number of seconds")
    return ServerConfig(host=args.listen, port=args.port, security=security_from_args(args, announce=announce),
                        front_end_root=args.front_end_root, history_cap=args.history_size,
                        interrupt_grace_s=args.interrupt_grace)


async def _serve(runtime: AppRuntime, config: ServerConfig) -> None:
    server = await start_server(runtime, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    shown = "127.0.0.1" if server.host in WILDCARD_HOSTS else server.host
    host = f"[{shown}]" if ":" in shown else shown
    token = config.security.token
    suffix = f"/?token={token}" if token else ""
    print(f"Weft is serving the editor at http://{host}:{server.port}{suffix}", flush=True)
    await stop.wait()
    print("stopping (a running job goes back to the queue)", flush=True)
    await server.stop()


def main(argv: list[str], *, add_common_arguments: Callable[[argparse.ArgumentParser], None],
         runtime_factory: Callable[[argparse.Namespace], AppRuntime],
         worker_pool: Callable[[Any, ServerConfig], Any] | None = None) -> int:
    """`python main.py [flags]`: build the runtime and serve until interrupted."""
    parser = build_parser(add_common_arguments)
    return serve(parser, parser.parse_args(argv), runtime_factory, worker_pool=worker_pool)


def clear_previews(temp_dir: Path) -> int:
    from execution.paths import PREVIEW_FILE_PREFIX

    """Remove the preview pictures earlier runs left in the temporary folder (ComfyUI empties it at start-up;
    Weft removes only its own preview files, in case the folder holds anything else). Returns how many."""
    removed = 0
    for path in Path(temp_dir).glob(f"**/{PREVIEW_FILE_PREFIX}*") if Path(temp_dir).is_dir() else []:
        try:
            if path.is_file():
                path.unlink()
                removed += 1
        except OSError:  # a file in use or not ours to remove: left as it is
            continue
    return removed


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace,
          runtime_factory: Callable[[argparse.Namespace], AppRuntime], *,
          worker_pool: Callable[[Any, ServerConfig], Any] | None = None) -> int:
    """Serve with flags already parsed by `parser` (used for its usage errors) until interrupted;
    `worker_pool` builds the workers jobs run on (main.py's Ray pool), else one worker process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.port < 0 or args.port > 65535:
        parser.error(f"--port {args.port} is not a port number")
    if args.max_upload_size <= 0:
        parser.error("--max-upload-size must be positive")
    if worker_pool is not None and args.in_process_jobs:
        parser.error("--in-process-jobs runs jobs in the server's process; it cannot be used with --workers "
                     "or --ray-address")
    config = config_from_args(args)
    runtime = runtime_factory(args)
    clear_previews(runtime.paths.temp)
    config.worker_pool = worker_pool
    if not args.in_process_jobs:  # the worker process builds its own runtime the same way
        config.worker_recipe = RuntimeRecipe(runtime_factory, args)
    try:
        asyncio.run(_serve(runtime, config))
    except OSError as exc:
        print(f"cannot listen on {args.listen}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
