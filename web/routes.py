"""The protocol routes: prompts, the queue and history, the jobs interface, node and system information.

Every route is registered bare and under `/api` (clients use bare paths, the editor `/api`). Shapes
follow ComfyUI's server (its HTTP routes and JSON bodies).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import sys
import uuid
from typing import Any

from aiohttp import web

from execution.errors import PromptError
from execution.job_store import API_TO_STORE, Job, workflow_id_of
from execution.paths import MODEL_FOLDERS, UnsafePathError
from execution.types import AUDIO_HEALTH_KEY
from web.files import refuses_os_errors
from web.object_info import object_info
from web.security import JsonTooDeep, check_json_depth, json_error, loads_bounded
from web.state import JOBS_LOG, STATE_KEY, WEFT_VERSION, ServerState

logger = logging.getLogger(__name__)

MEDIA_KEYS = ("images", "video", "audio", "gifs", "animated_images")  # ui output lists the editor can preview


def state_of(request: web.Request) -> ServerState:
    """The server state of the application serving `request`."""
    return request.app[STATE_KEY]


async def read_json(request: web.Request, *, allow_empty: bool = False) -> Any:
    """The body as JSON (any content type, as ComfyUI clients send it without one); 400 when it is not."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return None
        raise web.HTTPBadRequest(text=json.dumps({"error": {"type": "invalid_prompt", "message": "empty request body",
                                                           "details": "", "extra_info": {}}, "node_errors": {}}),
                                 content_type="application/json")
    try:
        # Bounded depth: a job's prompt crosses to its worker by pickle, which a value nested hundreds
        # deep overflows; every body is held to the same bound at the door.
        return loads_bounded(raw, what="the request body is JSON")
    except JsonTooDeep as exc:
        raise web.HTTPBadRequest(text=json.dumps({"error": {"type": "invalid_prompt", "message": str(exc),
                                                           "details": "", "extra_info": {}}, "node_errors": {}}),
                                 content_type="application/json") from None
    except ValueError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"error": {"type": "invalid_prompt", "message": "body is not valid JSON",
                                                           "details": str(exc)[:300], "extra_info": {}},
                                                 "node_errors": {}}), content_type="application/json") from None


def _bad(message: str, details: str = "") -> web.Response:
    return json_error(400, message, error_type="invalid_prompt", details=details)


# ---------------------------------------------------------------------- prompts
async def post_prompt(request: web.Request) -> web.Response:
    """Accept a prompt (API or editor format): validate, store durably, queue; 400 with the engine's errors."""
    state = state_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        return _bad("the body must be a JSON object with a 'prompt'")
    if state.packs is not None and state.packs.has_prompt_handlers:  # node packs may rewrite the body first
        body = await asyncio.get_running_loop().run_in_executor(None, state.packs.trigger_on_prompt, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, dict):
        return _bad("'prompt' must be an object: {node_id: {class_type, inputs}} or an editor workflow")
    client_id = body.get("client_id")
    if client_id is not None and not isinstance(client_id, str):
        return _bad("'client_id' must be a string")
    prompt_id = body.get("prompt_id")
    if prompt_id is not None:
        if not isinstance(prompt_id, str):
            return _bad("'prompt_id' must be a string (a UUID)")
        try:
            prompt_id = str(uuid.UUID(prompt_id))
        except ValueError:
            return _bad(f"'prompt_id' {prompt_id[:100]!r} is not a UUID")
    else:
        prompt_id = str(uuid.uuid4())
    number = body.get("number")
    if number is not None and (isinstance(number, bool) or not isinstance(number, (int, float))
                               or number != number or abs(number) > 1e15):
        return _bad("'number' must be a finite number")
    front = body.get("front", False)
    if not isinstance(front, bool):
        return _bad("'front' must be true or false")
    extra_data = body.get("extra_data")
    extra_data = {} if extra_data is None else extra_data
    if not isinstance(extra_data, dict):
        return _bad("'extra_data' must be an object")
    targets = body.get("partial_execution_targets")
    if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, (str, int)) for t in targets)):
        return _bad("'partial_execution_targets' must be a list of node ids")
    targets = [str(t) for t in targets] if targets is not None else None

    loop = asyncio.get_running_loop()
    try:
        job, validated = await loop.run_in_executor(None, lambda: state.enqueue(
            prompt, prompt_id=prompt_id, number=number, front=front, client_id=client_id, extra_data=extra_data,
            targets=targets))
    except PromptError as error:
        return web.json_response(error.to_json(), status=400)
    except (RecursionError, MemoryError) as exc:
        return _bad("the prompt is too deeply nested or too large", type(exc).__name__)
    except Exception as exc:  # a malformed prompt that tripped a check: still the client's request to fix
        logger.warning("prompt %s could not be validated", prompt_id, exc_info=True)
        return web.json_response({"error": {"type": "invalid_prompt", "message": "the prompt could not be validated",
                                            "details": f"{type(exc).__name__}: {exc}"[:500], "extra_info": {}},
                                  "node_errors": {}}, status=400)
    shown = int(job.number) if float(job.number).is_integer() else job.number
    return web.json_response({"prompt_id": prompt_id, "number": shown, "node_errors": validated.node_errors})


async def get_prompt(request: web.Request) -> web.Response:
    """The queue length: `{exec_info: {queue_remaining}}`."""
    return web.json_response(state_of(request).queue_status())


# ---------------------------------------------------------------------- queue and history
async def get_queue(request: web.Request) -> web.Response:
    """Running and pending jobs as ComfyUI queue entries."""
    running, pending = state_of(request).store.active()
    return web.json_response({"queue_running": [j.queue_item() for j in running],
                              "queue_pending": [j.queue_item() for j in pending]})


def _ids(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise web.HTTPBadRequest(text=json.dumps({"error": {"type": "invalid_request", "message":
                                                           "expected a list of prompt ids", "details": "",
                                                           "extra_info": {}}, "node_errors": {}}),
                                 content_type="application/json")
    return value


async def post_queue(request: web.Request) -> web.Response:
    """Cancel pending jobs: `{clear: true}` or `{delete: [ids]}` (each gets its cancelled record)."""
    state = state_of(request)
    body = await read_json(request, allow_empty=True) or {}
    if not isinstance(body, dict):
        return json_error(400, "expected {clear: true} or {delete: [ids]}")
    if body.get("clear"):
        cancelled = state.store.cancel_pending()
        state.queue_changed()
        return web.json_response({"cancelled": cancelled})
    if "delete" in body:
        cancelled = state.store.cancel_pending(_ids(body["delete"]))
        state.queue_changed()
        return web.json_response({"cancelled": cancelled})
    return web.json_response({"cancelled": []})


def _int_query(request: web.Request, name: str, default: int | None) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} must be an integer, got {raw[:50]!r}") from None
    if value < 0:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} must not be negative")
    return value


async def get_history(request: web.Request) -> web.Response:
    """Finished jobs by id, oldest first (`max_items` keeps the most recent, after `offset`)."""
    jobs = state_of(request).store.history(max_items=_int_query(request, "max_items", None),
                                           offset=_int_query(request, "offset", 0) or 0)
    return web.json_response({j.id: j.history_record() for j in jobs})


async def get_history_item(request: web.Request) -> web.Response:
    """One job's history record; `{}` while it is queued or running; 404 when unknown."""
    job = state_of(request).store.get(request.match_info["prompt_id"])
    if job is None:
        return json_error(404, f"no job {request.match_info['prompt_id'][:100]!r}", error_type="not_found")
    if not job.terminal:  # known but not finished: no record yet (clients poll until outputs appear)
        return web.json_response({})
    return web.json_response({job.id: job.history_record()})


async def post_history(request: web.Request) -> web.Response:
    """Forget finished jobs: `{clear: true}` or `{delete: [ids]}`."""
    state = state_of(request)
    body = await read_json(request, allow_empty=True) or {}
    if not isinstance(body, dict):
        return json_error(400, "expected {clear: true} or {delete: [ids]}")
    removed = 0
    if body.get("clear"):
        removed = state.store.delete_history()
    elif "delete" in body:
        removed = state.store.delete_history(_ids(body["delete"]))
    return web.json_response({"deleted": removed})


async def post_interrupt(request: web.Request) -> web.Response:
    """Interrupt the running job (only if it is `prompt_id`, when one is given)."""
    state = state_of(request)
    body = await read_json(request, allow_empty=True)
    prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
    if prompt_id is not None and not isinstance(prompt_id, str):
        return json_error(400, "'prompt_id' must be a string")
    return web.json_response({"interrupted": state.runner.interrupt(prompt_id)})


async def post_free(request: web.Request) -> web.Response:
    """Clear the output cache and unload models, between jobs."""
    state = state_of(request)
    body = await read_json(request, allow_empty=True) or {}
    if not isinstance(body, dict):
        return json_error(400, "expected {unload_models: bool, free_memory: bool}")
    unload, free = bool(body.get("unload_models")), bool(body.get("free_memory"))
    if unload or free:  # done by the worker between jobs: the cache and the models are not in use then
        state.runner.free(unload_models=unload)
    return web.json_response({"unload_models": unload, "free_memory": free})


# ---------------------------------------------------------------------- the jobs interface
def _output_items(outputs: dict) -> list[tuple[str, str, dict]]:
    items = []
    for node_id, ui in (outputs or {}).items():
        if not isinstance(ui, dict):
            continue
        for key, value in ui.items():
            if key in ("animated", AUDIO_HEALTH_KEY) or not isinstance(value, list):
                continue
            for item in value:
                items.append((str(node_id), key, item))
    return items


def _execution_error(job: Job) -> dict | None:
    if job.status not in ("error", "interrupted") or not job.error:
        return None
    error = dict(job.error)
    error["node_id"] = "" if error.get("node_id") is None else str(error["node_id"])
    error["node_type"] = "" if error.get("node_type") is None else str(error["node_type"])
    error.setdefault("exception_message", "")
    error.setdefault("exception_type", "")
    error["traceback"] = [str(t) for t in error.get("traceback") or []]
    return error


def job_summary(job: Job) -> dict:
    """A job as the editor's queue and history panels list it."""
    items = _output_items(job.outputs or {})
    previewable = [(n, k, i) for n, k, i in items if k in MEDIA_KEYS and isinstance(i, dict) and "filename" in i]
    preview = None
    if previewable:
        node_id, key, item = next((p for p in reversed(previewable) if p[2].get("type") == "output"), previewable[-1])
        preview = {**item, "nodeId": node_id, "mediaType": key}
    number = int(job.number) if float(job.number).is_integer() else job.number
    return {
        "id": job.id, "status": job.api_status, "create_time": job.create_time,
        "execution_start_time": job.start_time, "execution_end_time": job.end_time,
        "preview_output": preview, "outputs_count": len(items) if job.terminal else None,
        "previewable_outputs_count": len(previewable) if job.terminal else None,
        "execution_error": _execution_error(job), "workflow_id": workflow_id_of(job), "priority": number,
    }


def job_detail(job: Job) -> dict:
    """One job with its prompt, outputs and status messages."""
    detail = job_summary(job)
    record = job.history_record() if job.terminal else None
    detail.update({
        "workflow": {"prompt": job.prompt, "extra_data": job.extra_data},
        "outputs": job.outputs or {},
        "update_time": job.end_time or job.start_time or job.create_time,
        "execution_status": record["status"] if record else None,
        "execution_meta": job.meta or {},
        "worker": job.worker,  # the worker it was handed to (its last attempt's)
        "profile": job.profile,  # {worker, nodes: {node: {class_type, wall_ms, cpu_ms, ...}}} once it finished
    })
    return detail


async def get_jobs(request: web.Request) -> web.Response:
    """The jobs interface: filtered by status, sorted and paged."""
    state = state_of(request)
    wanted = [s.strip() for s in request.query.get("status", "").split(",") if s.strip()] or list(API_TO_STORE)
    unknown = [s for s in wanted if s not in API_TO_STORE]
    if unknown:
        return json_error(400, f"unknown job status {unknown[0][:40]!r}; expected {', '.join(API_TO_STORE)}")
    sort_by = request.query.get("sort_by", "create_time")
    if sort_by not in ("create_time", "execution_duration"):
        return json_error(400, f"sort_by must be create_time or execution_duration, got {sort_by[:40]!r}")
    sort_order = request.query.get("sort_order", "desc")
    if sort_order not in ("asc", "desc"):
        return json_error(400, f"sort_order must be asc or desc, got {sort_order[:40]!r}")
    limit = _int_query(request, "limit", None)
    offset = _int_query(request, "offset", 0) or 0
    statuses = [s for api in wanted for s in API_TO_STORE[api]]
    jobs, total = state.store.list(statuses, limit=limit, offset=offset, sort_by=sort_by,
                                   descending=sort_order == "desc", workflow_id=request.query.get("workflow_id"))
    return web.json_response({"jobs": [job_summary(j) for j in jobs], "pagination": {
        "offset": offset, "limit": limit if limit is not None else total, "total": total,
        "has_more": offset + len(jobs) < total}})


async def get_job(request: web.Request) -> web.Response:
    """One job in detail; 404 when unknown."""
    job = state_of(request).store.get(request.match_info["job_id"])
    if job is None:
        return json_error(404, f"no job {request.match_info['job_id'][:100]!r}", error_type="not_found")
    return web.json_response(job_detail(job))


async def post_job_cancel(request: web.Request) -> web.Response:
    """Cancel one job (pending: cancelled at once; running: interrupted)."""
    state = state_of(request)
    job_id = request.match_info["job_id"]
    job = state.store.get(job_id)
    if job is None:
        return json_error(404, f"no job {job_id[:100]!r}", error_type="not_found")
    cancelled = state.runner.cancel([job_id])
    return web.json_response({"id": job_id, "cancelled": bool(cancelled), "status": job.api_status if not cancelled
                              else "cancelled"})


async def post_jobs_cancel(request: web.Request) -> web.Response:
    """Cancel several jobs: `{job_ids: [...]}`."""
    state = state_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        return json_error(400, "expected {job_ids: [ids]}")
    ids = _ids(body.get("job_ids"))
    return web.json_response({"cancelled": state.runner.cancel(ids)})


# ---------------------------------------------------------------------- nodes and system
async def get_object_info(request: web.Request) -> web.Response:
    """Every node's definition, generated from its NodeSpec."""
    registry = state_of(request).runtime.registry
    info = await asyncio.get_running_loop().run_in_executor(None, object_info, registry)
    return web.json_response(info)


async def get_object_info_node(request: web.Request) -> web.Response:
    """One node's definition (`{}` when unknown)."""
    registry = state_of(request).runtime.registry
    return web.json_response(object_info(registry, request.match_info["node_class"]))


def _plugin_json(report: Any) -> Any:
    if callable(getattr(report, "to_json", None)):
        return report.to_json()
    if isinstance(report, dict):
        return report
    return str(report)


def _devices() -> list[dict]:
    import psutil

    memory = psutil.virtual_memory()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        devices = []
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            reserved = torch.cuda.memory_reserved(index)
            allocated = torch.cuda.memory_allocated(index)
            devices.append({"name": f"cuda:{index} {torch.cuda.get_device_name(index)}", "type": "cuda",
                            "index": index, "vram_total": total, "vram_free": free,
                            "torch_vram_total": reserved, "torch_vram_free": reserved - allocated})
        return devices
    return [{"name": "cpu", "type": "cpu", "index": None, "vram_total": memory.total, "vram_free": memory.available,
             "torch_vram_total": memory.total, "torch_vram_free": memory.available}]


async def get_system_stats(request: web.Request) -> web.Response:
    """Versions, memory, the compute devices and the plugins loaded, failed or disabled."""
    import psutil

    state = state_of(request)
    memory = psutil.virtual_memory()
    torch_version = ""
    if "torch" in sys.modules:
        torch_version = getattr(sys.modules["torch"], "__version__", "")
    reports = [_plugin_json(r) for r in state.runtime.plugin_reports]
    return web.json_response({
        "system": {"os": os.name, "platform": platform.platform(), "ram_total": memory.total,
                   "ram_free": memory.available, "comfyui_version": WEFT_VERSION, "weft_version": WEFT_VERSION,
                   "required_frontend_version": "", "python_version": sys.version, "pytorch_version": torch_version,
                   "embedded_python": False, "argv": sys.argv},
        "devices": await asyncio.get_running_loop().run_in_executor(None, _devices),
        # The job workers: name, kind (in-process, process, ray), state, the job running, jobs run, restarts,
        # host and devices, and the models the dispatcher counts as loaded there.
        "workers": state.runner.describe_workers(),
        "plugins": {"loaded": [r for r in reports if isinstance(r, dict) and r.get("status") == "loaded"],
                    "failed": [r for r in reports if not isinstance(r, dict) or r.get("status") == "failed"],
                    "disabled": [r for r in reports if isinstance(r, dict) and r.get("status") == "disabled"]},
    })


def server_features(state: ServerState) -> dict:
    """The feature flags the editor asks for (HTTP /features and the websocket answer)."""
    return {"supports_preview_metadata": True, "max_upload_size": state.config.security.max_body_bytes}


async def get_features(request: web.Request) -> web.Response:
    """The server's feature flags."""
    return web.json_response(server_features(state_of(request)))


def _model_folders(state: ServerState) -> list[str]:
    return sorted(set(MODEL_FOLDERS) | set(getattr(state.paths, "extra_model_dirs", {}) or {}))


async def get_embeddings(request: web.Request) -> web.Response:
    """Embedding names (files in models/embeddings, without extension)."""
    names = state_of(request).paths.list_models("embeddings")
    return web.json_response([os.path.splitext(n)[0] for n in names])


async def get_models(request: web.Request) -> web.Response:
    """The model folder names."""
    return web.json_response(_model_folders(state_of(request)))


async def get_models_folder(request: web.Request) -> web.Response:
    """Model files in one folder; 404 for an unknown folder."""
    state = state_of(request)
    folder = request.match_info["folder"]
    if folder not in _model_folders(state):
        return json_error(404, f"no model folder {folder[:100]!r}", error_type="not_found")
    return web.json_response(state.paths.list_models(folder))


async def get_experiment_models(request: web.Request) -> web.Response:
    """Model folders as the editor's model library lists them."""
    state = state_of(request)
    return web.json_response([{"name": f, "folders": [f"models/{f}"]} for f in _model_folders(state)])


async def get_experiment_models_folder(request: web.Request) -> web.Response:
    """Model files of one folder as the editor's model library lists them."""
    state = state_of(request)
    folder = request.match_info["folder"]
    if folder not in _model_folders(state):
        return json_error(404, f"no model folder {folder[:100]!r}", error_type="not_found")
    return web.json_response([{"name": n, "pathIndex": 0} for n in state.paths.list_models(folder)])


@refuses_os_errors
async def get_view_metadata(request: web.Request) -> web.Response:
    """The `__metadata__` of a safetensors model file (header only; the tensors are not read)."""
    state = state_of(request)
    folder = request.match_info["folder"]
    filename = request.query.get("filename", "")
    if folder not in _model_folders(state) or not filename:
        return json_error(404, "no such model file", error_type="not_found")
    try:
        path = state.paths.model_path(folder, filename)
    except (UnsafePathError, FileNotFoundError) as exc:
        return json_error(404, str(exc)[:300], error_type="not_found")
    if path.suffix.lower() not in (".safetensors", ".sft"):
        return json_error(404, "metadata is only read from safetensors files", error_type="not_found")
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size <= 0 or size > 100 * 2**20:
                raise ValueError(f"header length {size} is not plausible")
            raw = handle.read(size)
    except (OSError, ValueError) as exc:
        return json_error(404, f"{filename[:100]!r} is not a readable safetensors file: {exc}"[:300],
                          error_type="not_found")
    try:
        header = loads_bounded(raw)
    except JsonTooDeep as exc:
        return json_error(400, f"{filename[:100]!r}: the safetensors header is {exc}")
    except ValueError as exc:
        return json_error(400, f"{filename[:100]!r}: the safetensors header is not valid JSON: {exc}"[:300])
    if not isinstance(header, dict):
        return json_error(400, f"{filename[:100]!r}: the safetensors header is a JSON {type(header).__name__}, "
                               "not an object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        return json_error(400, f"{filename[:100]!r}: the header's __metadata__ is not a JSON object")
    return web.json_response(metadata)


async def get_folder_paths(request: web.Request) -> web.Response:
    """Model folder name -> the folders searched for it."""
    state = state_of(request)
    return web.json_response({f: [str(p) for p in state.paths.model_dirs(f)] for f in _model_folders(state)})


async def get_empty_object(request: web.Request) -> web.Response:
    """An empty object (no translations, no global subgraphs on this server)."""
    return web.json_response({})


async def get_workflow_templates(request: web.Request) -> web.Response:
    """Plugins' example workflows by plugin name (none are offered yet: plugins' templates are not read)."""
    return web.json_response({})


async def get_global_subgraph(request: web.Request) -> web.Response:
    """No global subgraphs are published: always 404."""
    return json_error(404, f"no global subgraph {request.match_info['subgraph_id'][:100]!r}", error_type="not_found")


def add_routes(table: list[tuple[str, str, Any]]) -> None:
    """Append this module's (method, path, handler) rows; the server registers each bare and under /api."""
    table.extend([
        ("POST", "/prompt", post_prompt), ("GET", "/prompt", get_prompt),
        ("GET", "/queue", get_queue), ("POST", "/queue", post_queue),
        ("GET", "/history", get_history), ("POST", "/history", post_history),
        ("GET", "/history/{prompt_id}", get_history_item),
        ("POST", "/interrupt", post_interrupt), ("POST", "/free", post_free),
        ("GET", "/jobs", get_jobs), ("POST", "/jobs/cancel", post_jobs_cancel),
        ("GET", "/jobs/{job_id}", get_job), ("POST", "/jobs/{job_id}/cancel", post_job_cancel),
        ("GET", "/object_info", get_object_info), ("GET", "/object_info/{node_class}", get_object_info_node),
        ("GET", "/system_stats", get_system_stats), ("GET", "/features", get_features),
        ("GET", "/embeddings", get_embeddings), ("GET", "/models", get_models),
        ("GET", "/models/{folder}", get_models_folder), ("GET", "/view_metadata/{folder}", get_view_metadata),
        ("GET", "/experiment/models", get_experiment_models),
        ("GET", "/experiment/models/{folder}", get_experiment_models_folder),
        ("GET", "/global_subgraphs", get_empty_object), ("GET", "/global_subgraphs/{subgraph_id}", get_global_subgraph),
        ("GET", "/internal/folder_paths", get_folder_paths),
        ("GET", "/i18n", get_empty_object), ("GET", "/workflow_templates", get_workflow_templates),
    ])

