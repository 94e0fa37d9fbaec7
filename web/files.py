"""File routes: uploads, /view, user data and settings, templates, extensions and the editor's static files.

Every file name that arrives in a request goes through `execution.paths.confine`, the one confinement
function. Uploaded images are checked in pixels from their header before anything decodes them. Files
whose type a browser would run (HTML, SVG, scripts, anything unknown) are served as attachments.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import mimetypes
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from execution.paths import UnsafePathError, atomic_write_bytes, check_name_characters, confine, find_staged
from web.security import JsonTooDeep, json_error, loads_bounded
from web.state import STATE_KEY, ServerState

logger = logging.getLogger(__name__)

SETTINGS_FILE = "comfy.settings.json"
FIRST_START_SETTINGS = {"Comfy.TutorialCompleted": True}  # the editor opens its default graph, not the template dialog
# Types a browser only displays: served inline. Everything else is an attachment.
INLINE_TYPES = frozenset({
    "image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp", "image/avif", "image/tiff",
    "video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "audio/wav", "audio/x-wav", "audio/mpeg",
    "audio/flac", "audio/x-flac", "audio/ogg", "audio/opus", "audio/mp4", "audio/aac", "audio/webm",
    "text/plain", "application/json", "model/gltf-binary",
})
MAX_FRAMES = 1024  # frames of one animated image (their pixels count together against max_pixels)
UPLOAD_FIELD_LIMIT = 64 * 1024  # bytes for a form field other than the file
CHUNK = 256 * 1024


def state_of(request: web.Request) -> ServerState:
    """The server state of the application serving `request`."""
    return request.app[STATE_KEY]


def refuses_os_errors(handler):
    """A path that leads out of its root, or a file name the file system itself refuses (too long, a
    component that is a file...), is a 400 naming the problem."""
    import functools

    @functools.wraps(handler)
    async def wrapped(request: web.Request):
        try:
            return await handler(request)
        except UnsafePathError as exc:
            return _bad(str(exc)[:300])
        except OSError as exc:
            return json_error(400, f"file name not usable: {exc.strerror or exc}"[:300], error_type="invalid_request")

    return wrapped


class PixelLimitError(ValueError):
    """An image larger than the server decodes."""


ERROR_TYPES = {400: "invalid_request", 404: "not_found", 413: "too_large"}  # the JSON error's "type" by status


def _bad(message: str, status: int = 400) -> web.Response:
    return json_error(status, message, error_type=ERROR_TYPES.get(status, "invalid_request"))


def check_image_pixels(path: Path, *, max_edge: int, max_pixels: int) -> tuple[int, int] | None:
    """(width, height) read from the header, refusing oversize images; None when it is not an image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            width, height = image.size
            frames = 1 if image.format == "MPO" else int(getattr(image, "n_frames", 1) or 1)
    except Image.DecompressionBombError as exc:
        raise PixelLimitError(str(exc)) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        return None
    if frames > MAX_FRAMES:
        raise PixelLimitError(f"image of {frames} frames is over the limit of {MAX_FRAMES} frames")
    if width > max_edge or height > max_edge or width * height * frames > max_pixels:
        shown = f"{frames} frames of {width}x{height}" if frames > 1 else f"{width}x{height}"
        raise PixelLimitError(f"image of {shown} pixels is over the limit ({max_edge} per edge, "
                              f"{max_pixels // 1_000_000} MP over all frames)")
    return width, height


def open_capped_image(path: Path, *, max_edge: int, max_pixels: int):
    """Open and decode an image after checking its size from the header."""
    from PIL import Image

    if check_image_pixels(path, max_edge=max_edge, max_pixels=max_pixels) is None:
        raise ValueError(f"{path.name!r} is not an image")
    image = Image.open(path)
    image.load()
    return image


def quoted_name(name: str) -> str:
    """`name` made safe inside a quoted Content-Disposition filename (no quote, backslash or line break)."""
    return name.replace("\\", "_").replace('"', "_").replace("\r", "_").replace("\n", "_")


def content_headers(name: str) -> tuple[str, dict[str, str]]:
    """(content type, headers): inline for display-only types, attachment otherwise."""
    guessed = mimetypes.guess_type(name)[0] or "application/octet-stream"
    quoted = quoted_name(name)
    if guessed in INLINE_TYPES:
        return guessed, {"Content-Disposition": f'inline; filename="{quoted}"'}
    return "application/octet-stream", {"Content-Disposition": f'attachment; filename="{quoted}"'}


def serve_file(path: Path, *, name: str | None = None, cache: str = "no-cache") -> web.FileResponse:
    """A file response with a safe content type, disposition and caching."""
    content_type, headers = content_headers(name or path.name)
    headers["Content-Type"] = content_type
    headers["Cache-Control"] = cache
    headers["X-Content-Type-Options"] = "nosniff"
    return web.FileResponse(path, headers=headers)


# ---------------------------------------------------------------------- /view
def _render_view(path: Path, preview: str | None, channel: str, max_edge: int, max_pixels: int) -> tuple[bytes, str]:
    """The image re-encoded for `preview=format;quality` and reduced to `channel` (rgb, or a as an RGBA mask)."""
    from PIL import Image

    image = open_capped_image(path, max_edge=max_edge, max_pixels=max_pixels)
    if channel == "a":
        alpha = image.getchannel("A") if "A" in image.getbands() else Image.new("L", image.size, 255)
        out = Image.new("RGBA", image.size, (0, 0, 0, 0))
        out.putalpha(alpha)
        image = out
    elif channel == "rgb":
        image = image.convert("RGB")
    fmt, quality = "png", 90
    if preview:
        name, _, q = preview.partition(";")
        fmt = name.strip().lower() or "webp"
        if fmt == "jpg":
            fmt = "jpeg"
        if fmt not in ("webp", "jpeg", "png"):
            raise ValueError(f"preview format {name[:20]!r} is not webp, jpeg or png")
        if q.strip():
            if not q.strip().isdigit() or not 1 <= int(q) <= 100:
                raise ValueError(f"preview quality {q[:10]!r} is not a number from 1 to 100")
            quality = int(q)
    if fmt == "jpeg" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format=fmt.upper(), quality=quality)
    return buffer.getvalue(), f"image/{fmt}"


@refuses_os_errors
async def get_view(request: web.Request) -> web.StreamResponse:
    """Serve an input/output/temp file, optionally re-encoded (`preview=`) or reduced to a channel."""
    state = state_of(request)
    query = request.query
    filename = query.get("filename")
    if not filename:
        return _bad("'filename' is required")
    root = state.paths.folder(query.get("type", "output") or "output")
    path = confine(root, filename, subfolder=query.get("subfolder", ""))
    shown_name = path.name
    if not path.is_file():
        # A running job's output keeps its staging name until the job's record is written; the editor
        # shows it as soon as the node reports it.
        staged = find_staged(path)
        if staged is None:
            return _bad(f"file {filename[:200]!r} not found", 404)
        path = staged
    preview = query.get("preview")
    channel = query.get("channel", "rgba") or "rgba"
    if channel not in ("rgba", "rgb", "a"):
        return _bad(f"channel must be rgba, rgb or a, got {channel[:20]!r}")
    if preview or channel != "rgba":
        config = state.config
        try:
            body, content_type = await asyncio.get_running_loop().run_in_executor(
                None, _render_view, path, preview, channel, config.max_edge, config.max_pixels)
        except PixelLimitError as exc:
            return _bad(str(exc), 413)
        except (ValueError, OSError) as exc:
            return _bad(str(exc)[:300])
        return web.Response(body=body, content_type=content_type,
                            headers={"Content-Disposition": f'inline; filename="{quoted_name(Path(shown_name).stem)}.{content_type[6:]}"',
                                     "Cache-Control": "no-cache"})
    return serve_file(path, name=shown_name)


# ---------------------------------------------------------------------- uploads
UPLOAD_SPOOL = ".uploads"  # under temp/: uploads being received (swept at start-up)


class _BodyBudget:
    """Counts every byte of a request body as the multipart reader takes it, however the body is framed."""

    def __init__(self, request: web.Request, limit: int) -> None:
        self.content = request.content
        self.limit = limit

    def check(self) -> None:
        received = self.content.total_bytes
        if received > self.limit:
            raise web.HTTPRequestEntityTooLarge(max_size=self.limit, actual_size=received)


async def _read_small(part, budget: _BodyBudget) -> str:
    data = bytearray()
    while True:
        chunk = await part.read_chunk(8192)
        budget.check()
        if not chunk:
            break
        data += chunk
        if len(data) > UPLOAD_FIELD_LIMIT:
            raise web.HTTPRequestEntityTooLarge(max_size=UPLOAD_FIELD_LIMIT, actual_size=len(data))
    return data.decode("utf-8", "replace")


async def _skip_part(part, budget: _BodyBudget) -> None:
    while await part.read_chunk(CHUNK):
        budget.check()
    budget.check()


def sweep_upload_spool(state: ServerState) -> int:
    """Remove uploads a stopped server left half received; returns how many."""
    spool = Path(state.paths.temp) / UPLOAD_SPOOL
    removed = 0
    if spool.is_dir():
        for path in spool.iterdir():
            if path.is_file():
                path.unlink(missing_ok=True)
                removed += 1
    return removed


async def _read_upload(request: web.Request, file_fields: tuple[str, ...]) -> tuple[dict[str, str], dict[str, tuple[str, Path]]]:
    """Stream a multipart form: small fields as text, files into temporary files under temp/.

    The size limit counts every byte of the body (fields, headers, parts skipped); whatever goes
    wrong (a limit, a malformed or nested part, the client leaving), no temporary file stays."""
    from aiohttp import BodyPartReader

    state = state_of(request)
    budget = _BodyBudget(request, state.config.security.max_body_bytes)
    if not request.content_type.startswith("multipart/"):
        raise web.HTTPBadRequest(text="expected a multipart/form-data body")
    spool = Path(state.paths.temp) / UPLOAD_SPOOL
    spool.mkdir(parents=True, exist_ok=True)
    fields: dict[str, str] = {}
    files: dict[str, tuple[str, Path]] = {}
    try:
        reader = await request.multipart()
        while True:
            part = await reader.next()
            budget.check()
            if part is None:
                break
            if not isinstance(part, BodyPartReader):
                raise web.HTTPBadRequest(text="a form part may not itself be multipart")
            if part.name in file_fields and part.filename is not None and part.name not in files:
                check_name_characters(part.filename, "uploaded file name")
                temp = spool / f"{uuid.uuid4().hex}.part"
                files[part.name] = (part.filename, temp)
                with open(temp, "wb") as handle:
                    while True:
                        chunk = await part.read_chunk(CHUNK)
                        budget.check()
                        if not chunk:
                            break
                        handle.write(chunk)
            elif part.name:
                fields[part.name] = await _read_small(part, budget)
            else:
                await _skip_part(part, budget)
    except BaseException as exc:
        for _, temp in files.values():
            temp.unlink(missing_ok=True)
        if isinstance(exc, UnsafePathError):
            raise web.HTTPBadRequest(text=str(exc)[:300]) from None
        if isinstance(exc, (ValueError, AssertionError, RuntimeError, HttpProcessingError)):  # a malformed body
            raise web.HTTPBadRequest(text=f"malformed multipart body: {exc}"[:300]) from None
        raise
    return fields, files


def _free_name(folder: Path, name: str) -> str:
    """`name`, or `stem (n).ext` with the first n not taken."""
    if not (folder / name).exists():
        return name
    stem, ext = os.path.splitext(name)
    n = 1
    while (folder / f"{stem} ({n}){ext}").exists():
        n += 1
    return f"{stem} ({n}){ext}"


def _place(temp: Path, root: Path, subfolder: str, filename: str, overwrite: bool) -> tuple[str, Path]:
    """Move an uploaded temporary file to its confined final name; returns (name, path)."""
    target = confine(root, filename, subfolder=subfolder)
    if target == Path(root).resolve() or target.is_dir():
        raise UnsafePathError(f"file name {filename!r} names a folder")
    folder = target.parent
    if not overwrite:
        target = confine(root, _free_name(folder, target.name), subfolder=subfolder)
    folder.mkdir(parents=True, exist_ok=True)
    confine(root, target.name, subfolder=subfolder)  # the folder created may not be a link out
    try:
        os.replace(temp, target)
    except OSError:  # temp/ on another file system: copy beside the target, then rename
        part = target.with_name(f".{target.name}.part")
        shutil.copyfile(temp, part)
        os.replace(part, target)
        temp.unlink(missing_ok=True)
    return target.name, target


def _upload_type(fields: dict[str, str]) -> str:
    kind = fields.get("type", "input") or "input"
    if kind not in ("input", "output", "temp"):
        raise UnsafePathError(f"upload type must be input, output or temp, got {kind[:20]!r}")
    return kind


async def _uploaded_image(request: web.Request):
    """The start both upload routes share: (state, form fields, file name, temp path), or an error response."""
    fields, files = await _read_upload(request, ("image",))
    if "image" not in files:
        return _bad("the form needs a file field 'image'")
    filename, temp = files["image"]
    return state_of(request), fields, filename, temp


@refuses_os_errors
async def post_upload_image(request: web.Request) -> web.Response:
    """Store an uploaded file (streamed, size- and pixel-capped) under a confined name."""
    upload = await _uploaded_image(request)
    if isinstance(upload, web.Response):
        return upload
    state, fields, filename, temp = upload
    config = state.config
    try:
        kind = _upload_type(fields)
        subfolder = fields.get("subfolder", "")
        overwrite = fields.get("overwrite", "").lower() in ("true", "1")

        def finish():
            check_image_pixels(temp, max_edge=config.max_edge, max_pixels=config.max_pixels)
            return _place(temp, state.paths.folder(kind), subfolder, filename, overwrite)

        name, _ = await asyncio.get_running_loop().run_in_executor(None, finish)
    except PixelLimitError as exc:
        return _bad(str(exc), 413)
    except (UnsafePathError, OSError) as exc:
        return _bad(str(exc)[:300])
    finally:
        temp.unlink(missing_ok=True)
    return web.json_response({"name": name, "subfolder": subfolder, "type": kind})


@refuses_os_errors
async def post_upload_mask(request: web.Request) -> web.Response:
    """Put the uploaded mask's alpha into a copy of the original image (`original_ref`), saved as PNG."""
    upload = await _uploaded_image(request)
    if isinstance(upload, web.Response):
        return upload
    state, fields, filename, temp = upload
    config = state.config
    try:
        try:
            ref = loads_bounded(fields.get("original_ref", ""))
        except JsonTooDeep as exc:
            return _bad(f"'original_ref' is {exc}")
        except ValueError:
            return _bad("'original_ref' must be JSON {filename, subfolder, type}")
        if not isinstance(ref, dict) or not isinstance(ref.get("filename"), str):
            return _bad("'original_ref' must be JSON {filename, subfolder, type}")
        kind = _upload_type(fields)
        subfolder = fields.get("subfolder", "")
        overwrite = fields.get("overwrite", "").lower() in ("true", "1")

        def finish():
            original_root = state.paths.folder(str(ref.get("type") or "input"))
            original = confine(original_root, ref["filename"], subfolder=str(ref.get("subfolder") or ""))
            if not original.is_file():
                raise FileNotFoundError(f"original image {ref['filename'][:200]!r} not found")
            mask = open_capped_image(temp, max_edge=config.max_edge, max_pixels=config.max_pixels).convert("RGBA")
            image = open_capped_image(original, max_edge=config.max_edge, max_pixels=config.max_pixels)
            if image.size != mask.size:
                raise ValueError(f"mask is {mask.size[0]}x{mask.size[1]} but the original is "
                                 f"{image.size[0]}x{image.size[1]}")
            image = image.convert("RGBA")
            image.putalpha(mask.getchannel("A"))
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            with open(temp, "wb") as handle:
                handle.write(buffer.getvalue())
            return _place(temp, state.paths.folder(kind), subfolder, filename, overwrite)

        name, _ = await asyncio.get_running_loop().run_in_executor(None, finish)
    except PixelLimitError as exc:
        return _bad(str(exc), 413)
    except FileNotFoundError as exc:
        return _bad(str(exc)[:300], 404)
    except (UnsafePathError, OSError, ValueError) as exc:
        return _bad(str(exc)[:300])
    finally:
        temp.unlink(missing_ok=True)
    return web.json_response({"name": name, "subfolder": subfolder, "type": kind})


# ---------------------------------------------------------------------- users, settings, user data
def ensure_user_folder(state: ServerState) -> None:
    """First start: the user folder, its workflows folder, and settings that open the default graph."""
    state.user_root.mkdir(parents=True, exist_ok=True)
    for folder in ("workflows", "subgraphs"):  # the editor lists both when it starts
        (state.user_root / folder).mkdir(exist_ok=True)
    templates = state.user_root / "comfy.templates.json"  # the editor's saved node templates: none yet
    if not templates.exists():
        atomic_write_bytes(templates, b"[]")
    settings = state.user_root / SETTINGS_FILE
    if not settings.exists():
        atomic_write_bytes(settings, json.dumps(FIRST_START_SETTINGS, indent=2).encode())


def _read_settings(state: ServerState) -> dict:
    path = state.user_root / SETTINGS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError:
        logger.warning("%s is not valid JSON; starting from empty settings", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write_settings(state: ServerState, settings: dict) -> None:
    atomic_write_bytes(state.user_root / SETTINGS_FILE, json.dumps(settings, indent=2).encode())


async def get_users(request: web.Request) -> web.Response:
    """Single-user storage on the server."""
    return web.json_response({"storage": "server", "migrated": True})


async def post_users(request: web.Request) -> web.Response:
    """Refused: this server has one user."""
    return _bad("this server has a single user; creating users is not supported")


async def get_settings(request: web.Request) -> web.Response:
    """All settings as a flat `{id: value}` object."""
    return web.json_response(_read_settings(state_of(request)))


async def get_setting(request: web.Request) -> web.Response:
    """One setting (null when unset)."""
    return web.json_response(_read_settings(state_of(request)).get(request.match_info["setting_id"]))


async def post_settings(request: web.Request) -> web.Response:
    """Merge several settings."""
    from web.routes import read_json

    state = state_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        return _bad("expected an object of settings {id: value}")
    async with request.app[SETTINGS_LOCK]:
        settings = _read_settings(state)
        settings.update(body)
        _write_settings(state, settings)
    return web.json_response({})


async def post_setting(request: web.Request) -> web.Response:
    """Set one setting to the JSON body."""
    from web.routes import read_json

    state = state_of(request)
    value = await read_json(request)
    async with request.app[SETTINGS_LOCK]:
        settings = _read_settings(state)
        settings[request.match_info["setting_id"]] = value
        _write_settings(state, settings)
    return web.json_response({})


def _user_path(state: ServerState, name: str) -> Path:
    path = confine(state.user_root, name)
    if path == state.user_root.resolve():
        raise UnsafePathError("a user data file name is required")
    return path


def _write_options(request: web.Request) -> tuple[bool, bool]:
    """`overwrite` (default true) and `full_info` (default false) of a user data write or move."""
    overwrite = request.query.get("overwrite", "true").lower() != "false"
    full_info = request.query.get("full_info", "").lower() in ("true", "1")
    return overwrite, full_info


def _written(state: ServerState, path: Path, full_info: bool) -> web.Response:
    """The reply to a user data write or move: the file's path in the user folder, or its info."""
    root = state.user_root.resolve()
    if full_info:
        return web.json_response(_file_info(path, root))
    return web.json_response(path.relative_to(root).as_posix())


def _file_info(path: Path, root: Path) -> dict:
    stat = path.stat()
    return {"path": path.relative_to(root).as_posix(), "size": stat.st_size, "modified": int(stat.st_mtime * 1000)}


@refuses_os_errors
async def list_userdata(request: web.Request) -> web.Response:
    """Files in a user data folder (`recurse`, `split`, `full_info`)."""
    state = state_of(request)
    directory = request.query.get("dir", "")
    if not directory:
        return _bad("'dir' is required")
    folder = confine(state.user_root, directory)
    if not folder.is_dir():
        return _bad(f"no user data folder {directory[:200]!r}", 404)
    recurse = request.query.get("recurse", "").lower() in ("true", "1")
    full_info = request.query.get("full_info", "").lower() in ("true", "1")
    split = request.query.get("split", "").lower() in ("true", "1")
    user_root = state.user_root.resolve()
    found = []
    for path in sorted(folder.rglob("*") if recurse else folder.glob("*")):
        if not path.is_file() or path.name.startswith(".") and path.name.endswith(".part"):
            continue
        try:
            confine(user_root, path.relative_to(folder).as_posix(), subfolder=folder.relative_to(user_root).as_posix())
        except (UnsafePathError, ValueError):
            continue  # a link out of the user folder is not listed
        relative = path.relative_to(folder).as_posix()
        if full_info:
            info = _file_info(path, folder)
            found.append(info)
        elif split:
            found.append([relative, *relative.split("/")])
        else:
            found.append(relative)
    return web.json_response(found)


@refuses_os_errors
async def list_userdata_v2(request: web.Request) -> web.Response:
    """`[{name, path, type, size?, modified}]` for one folder of the user data."""
    state = state_of(request)
    relative = request.query.get("path", "")
    folder = confine(state.user_root, relative) if relative else state.user_root.resolve()
    if not folder.is_dir():
        return _bad(f"no user data folder {relative[:200]!r}", 404)
    entries = []
    root = state.user_root.resolve()
    for path in sorted(folder.iterdir()):
        try:
            confine(root, path.relative_to(root).as_posix())
        except UnsafePathError:
            continue
        stat = path.stat()
        entry = {"name": path.name, "path": path.relative_to(root).as_posix(),
                 "type": "directory" if path.is_dir() else "file", "modified": stat.st_mtime}
        if path.is_file():
            entry["size"] = stat.st_size
        entries.append(entry)
    return web.json_response(entries)


@refuses_os_errors
async def get_userdata(request: web.Request) -> web.StreamResponse:
    """One user data file (an empty stylesheet for the editor's optional user.css)."""
    state = state_of(request)
    name = request.match_info["file"]
    path = _user_path(state, name)
    if not path.is_file():
        if name == "user.css":  # the editor always links the user's optional stylesheet
            return web.Response(text="/* no user.css in the user folder */\n", content_type="text/css")
        return _bad(f"no user data file {name[:200]!r}", 404)
    if path.suffix.lower() == ".css":
        return web.FileResponse(path, headers={"Content-Type": "text/css", "Cache-Control": "no-cache"})
    return serve_file(path)


@refuses_os_errors
async def post_userdata(request: web.Request) -> web.Response:
    """Write a user data file atomically (`overwrite=false` refuses to replace)."""
    state = state_of(request)
    name = request.match_info["file"]
    overwrite, full_info = _write_options(request)
    path = _user_path(state, name)
    if path.exists() and not overwrite:
        return json_error(409, f"user data file {name[:200]!r} already exists", error_type="conflict")
    if path.is_dir():
        return _bad(f"{name[:200]!r} is a folder")
    body = await request.read()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        _user_path(state, name)  # the folders just created may not lead out
        await asyncio.get_running_loop().run_in_executor(None, atomic_write_bytes, path, body)
    except (UnsafePathError, OSError) as exc:
        return _bad(str(exc)[:300])
    return _written(state, path, full_info)


@refuses_os_errors
async def delete_userdata(request: web.Request) -> web.Response:
    """Delete a user data file."""
    state = state_of(request)
    name = request.match_info["file"]
    path = _user_path(state, name)
    if not path.is_file():
        return _bad(f"no user data file {name[:200]!r}", 404)
    path.unlink()
    return web.Response(status=204)


@refuses_os_errors
async def move_userdata(request: web.Request) -> web.Response:
    """Rename a user data file (`overwrite=false` refuses to replace)."""
    state = state_of(request)
    source_name, dest_name = request.match_info["file"], request.match_info["dest"]
    overwrite, full_info = _write_options(request)
    source, dest = _user_path(state, source_name), _user_path(state, dest_name)
    if not source.is_file():
        return _bad(f"no user data file {source_name[:200]!r}", 404)
    if dest.exists() and not overwrite:
        return json_error(409, f"user data file {dest_name[:200]!r} already exists", error_type="conflict")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        _user_path(state, dest_name)
        os.replace(source, dest)
    except (UnsafePathError, OSError) as exc:
        return _bad(str(exc)[:300])
    return _written(state, dest, full_info)


# ---------------------------------------------------------------------- templates
def _template_names(state: ServerState) -> list[str]:
    folder = state.config.workflows_dir
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.json") if p.is_file())


def _describe_workflow(data: dict) -> str:
    types = [n.get("type", "?") for n in data.get("nodes", []) if isinstance(n, dict)]
    extra = data.get("extra") if isinstance(data.get("extra"), dict) else {}
    if isinstance(extra.get("description"), str):
        return extra["description"]
    return f"{len(types)} nodes: " + ", ".join(types[:8]) + ("..." if len(types) > 8 else "")


async def get_template_index(request: web.Request) -> web.Response:
    """The editor's template index: the workflows folder as one "Weft" category, then the official
    templates grouped as the official index groups them (execution/templates.py). Every thumbnail is a
    diagram Weft draws of the workflow (`name-1.png`): the official package ships none."""
    from execution import templates as official

    state = state_of(request)
    local = []
    for name in _template_names(state):
        try:
            data = json.loads((state.config.workflows_dir / f"{name}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        local.append({"name": name, "title": name.replace("_", " ").replace("-", " ").capitalize(),
                      "description": _describe_workflow(data), "mediaType": "image", "mediaSubtype": "png"})
    groups = [{"moduleName": "default", "title": "Weft", "type": "image", "category": "Weft", "templates": local}]
    shadowed = set(_template_names(state))  # a local workflow of the same name wins, as run-by-name does
    for category in await asyncio.get_running_loop().run_in_executor(None, official.official_categories):
        entries = [{**entry, "mediaType": "image", "mediaSubtype": "png", "thumbnailVariant": None}
                   for entry in category.entries if entry["name"] not in shadowed]
        if entries:
            groups.append({"moduleName": "default", "title": category.title, "type": category.kind,
                           "category": "Official templates", "templates": entries})
    return web.json_response(groups)


def render_thumbnail(data: dict, size: tuple[int, int] = (400, 300)) -> bytes:
    """A diagram of a workflow: its nodes where the editor places them, titled, with their links."""
    from PIL import Image, ImageDraw

    nodes = [n for n in data.get("nodes", []) if isinstance(n, dict) and isinstance(n.get("pos"), (list, dict))]
    image = Image.new("RGB", size, (32, 32, 36))
    draw = ImageDraw.Draw(image)

    def box(node):
        pos, extent = node["pos"], node.get("size") or [200, 100]
        x, y = (pos["0"], pos["1"]) if isinstance(pos, dict) else pos[:2]
        w, h = (extent["0"], extent["1"]) if isinstance(extent, dict) else extent[:2]
        return float(x), float(y), float(w), float(h)

    boxes = {}
    for node in nodes:
        try:
            boxes[node.get("id")] = box(node)
        except (TypeError, ValueError, KeyError, IndexError):
            continue
    if boxes:
        left = min(b[0] for b in boxes.values())
        top = min(b[1] for b in boxes.values())
        right = max(b[0] + b[2] for b in boxes.values())
        bottom = max(b[1] + b[3] for b in boxes.values())
        scale = min((size[0] - 20) / max(right - left, 1), (size[1] - 20) / max(bottom - top, 1))

        def to_px(x, y):
            return 10 + (x - left) * scale, 10 + (y - top) * scale

        for link in data.get("links", []):
            ends = (link[1], link[3]) if isinstance(link, list) and len(link) >= 4 else \
                (link.get("origin_id"), link.get("target_id")) if isinstance(link, dict) else (None, None)
            if ends[0] in boxes and ends[1] in boxes:
                a, b = boxes[ends[0]], boxes[ends[1]]
                draw.line([to_px(a[0] + a[2], a[1] + 15), to_px(b[0], b[1] + 15)], fill=(140, 170, 220), width=2)
        types = {n.get("id"): str(n.get("type", "")) for n in nodes}
        for node_id, (x, y, w, h) in boxes.items():
            x0, y0 = to_px(x, y)
            x1, y1 = to_px(x + w, y + h)
            draw.rectangle([x0, y0, x1, y1], fill=(53, 53, 60), outline=(110, 110, 120))
            draw.rectangle([x0, y0, x1, min(y1, y0 + 14)], fill=(70, 70, 82))
            draw.text((x0 + 3, y0 + 2), types.get(node_id, "")[:24], fill=(230, 230, 230))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@refuses_os_errors
async def get_template_file(request: web.Request) -> web.StreamResponse:
    """A template workflow (`name.json`) or its thumbnail (`name-1.png`): from the workflows folder, else
    an official template."""
    from execution import templates as official

    state = state_of(request)
    name = request.match_info["name"]
    folder = state.config.workflows_dir
    try:
        if name.endswith(".json"):
            path = confine(folder, name)
            if path.is_file():
                return web.FileResponse(path, headers={"Content-Type": "application/json", "Cache-Control": "no-cache"})
            text = official.official_text(name)
            if text is None:
                return _bad(f"no template {name[:200]!r}", 404)
            return web.Response(text=text, content_type="application/json", headers={"Cache-Control": "no-cache"})
        stem, dash, rest = name.rpartition("-")
        if dash and rest in ("1.png", "2.png"):
            path = confine(folder, f"{stem}.json")
            if path.is_file():
                key = (str(path), path.stat().st_mtime_ns)
                read = lambda: path.read_text(encoding="utf-8")  # noqa: E731
            else:
                text = official.official_text(stem)
                if text is None:
                    return _bad(f"no template {stem[:200]!r}", 404)
                key, read = ("official", stem), lambda: text
            cache = request.app[THUMBNAILS]
            if key not in cache:
                data = json.loads(read())
                cache[key] = await asyncio.get_running_loop().run_in_executor(None, render_thumbnail, data)
            return web.Response(body=cache[key], content_type="image/png", headers={"Cache-Control": "no-cache"})
    except UnsafePathError as exc:
        return _bad(str(exc)[:300])
    except ValueError as exc:
        return _bad(f"template {name[:200]!r} is not valid JSON: {exc}"[:300])
    return _bad(f"no template file {name[:200]!r}", 404)


# ---------------------------------------------------------------------- extensions and the editor
def _js_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    root = folder.resolve()
    out = []
    for path in sorted(root.rglob("*.js")):
        try:
            confine(root, path.relative_to(root).as_posix())
        except UnsafePathError:
            continue
        out.append(path.relative_to(root).as_posix())
    return out


def extension_urls(state: ServerState) -> list[str]:
    """JS modules the editor imports: the editor's own core ones (it skips those), ours, and plugins'."""
    from urllib.parse import quote

    urls = []
    if state.front_end_root is not None:
        urls += [f"/extensions/{p}" for p in _js_files(state.front_end_root / "extensions")]
    urls += [f"/extensions/weft/{quote(p)}" for p in _js_files(state.config.extensions_dir)]
    for name, folder in sorted(state.plugin_web_dirs.items()):
        urls += [f"/extensions/{quote(name)}/{quote(p)}" for p in _js_files(folder)]
    return urls


async def get_extensions(request: web.Request) -> web.Response:
    """URLs of the JS modules the editor loads."""
    return web.json_response(extension_urls(state_of(request)))


def _static_response(root: Path, tail: str, *, cache: str) -> web.StreamResponse | None:
    try:
        path = confine(root, tail)
    except UnsafePathError:
        return None
    if not path.is_file():
        return None
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if path.suffix in (".js", ".mjs"):
        content_type = "text/javascript"
    return web.FileResponse(path, headers={"Content-Type": content_type, "Cache-Control": cache})


@refuses_os_errors
async def get_static(request: web.Request) -> web.StreamResponse:
    """The editor's files (`/` is index.html), our extensions at /extensions/weft/, plugins' at /extensions/<name>/."""
    state = state_of(request)
    tail = request.match_info.get("tail", "")
    if tail.startswith("api/"):
        return _bad(f"no route {request.path[:200]!r}", 404)
    if tail.startswith("extensions/"):
        _, name, rest = (tail.split("/", 2) + ["", ""])[:3]
        folder = state.config.extensions_dir if name == "weft" else state.plugin_web_dirs.get(name)
        if folder is not None:
            response = _static_response(folder, rest, cache="no-cache") if rest else None
            return response or _bad(f"no extension file {tail[:200]!r}", 404)
    if state.front_end_root is None:
        return web.Response(status=503, text="the editor is not installed: pip install comfyui-frontend-package "
                                             "(or start with --front-end-root FOLDER)")
    if tail in ("", "index.html"):
        return web.FileResponse(state.front_end_root / "index.html",
                                headers={"Content-Type": "text/html", "Cache-Control": "no-cache"})
    if tail == "user.css":  # the editor's page links the user's optional stylesheet at the root too
        path = state.user_root / "user.css"
        if path.is_file():
            return web.FileResponse(path, headers={"Content-Type": "text/css", "Cache-Control": "no-cache"})
        return web.Response(text="/* no user.css in the user folder */\n", content_type="text/css")
    # Hashed build assets never change under their name; everything else is revalidated.
    cache = "public, max-age=31536000, immutable" if tail.startswith("assets/") else "no-cache"
    response = _static_response(state.front_end_root, tail, cache=cache)
    return response or _bad(f"no file {request.path[:200]!r}", 404)


SETTINGS_LOCK = web.AppKey("weft_settings_lock", asyncio.Lock)
THUMBNAILS = web.AppKey("weft_thumbnails", dict)


def add_routes(table: list[tuple[str, str, Any]]) -> None:
    """Append the API file routes (registered bare and under /api)."""
    table.extend([
        ("POST", "/upload/image", post_upload_image), ("POST", "/upload/mask", post_upload_mask),
        ("GET", "/view", get_view),
        ("GET", "/users", get_users), ("POST", "/users", post_users),
        ("GET", "/settings", get_settings), ("POST", "/settings", post_settings),
        ("GET", "/settings/{setting_id}", get_setting), ("POST", "/settings/{setting_id}", post_setting),
        ("GET", "/userdata", list_userdata), ("GET", "/v2/userdata", list_userdata_v2),
        ("GET", "/userdata/{file}", get_userdata), ("POST", "/userdata/{file}", post_userdata),
        ("DELETE", "/userdata/{file}", delete_userdata), ("POST", "/userdata/{file}/move/{dest}", move_userdata),
        ("GET", "/extensions", get_extensions),
        ("GET", "/internal/files/{kind}", get_internal_files),
    ])


async def get_template_logos(request: web.Request) -> web.Response:
    """The template browser's logo index ({provider: image path}); Weft's templates show no logos."""
    return web.json_response({})


async def get_template_index_localized(request: web.Request) -> web.StreamResponse:
    """`index.<locale>.json`: Weft's template titles are not translated, so every locale gets the one index."""
    return await get_template_index(request)


async def get_internal_files(request: web.Request) -> web.Response:
    """The assets panel's file list of one folder (input, output or temp): relative names, newest first."""
    state = state_of(request)
    kind = request.match_info["kind"]
    try:
        root = state.paths.folder(kind)
    except UnsafePathError as exc:
        return _bad(str(exc)[:300])

    def newest_first() -> list[str]:
        names = state.paths.list_files(kind)
        stamps = {}
        for name in names:
            try:
                stamps[name] = (root / name).stat().st_mtime_ns
            except OSError:
                stamps[name] = 0
        return sorted(names, key=lambda name: (-stamps[name], name))

    return web.json_response(await asyncio.get_running_loop().run_in_executor(None, newest_first))


def add_template_routes(app: web.Application) -> None:
    """The workflow templates' routes (without an /api twin, as ComfyUI serves them)."""
    app.router.add_get("/templates/index.json", get_template_index)
    app.router.add_get("/templates/index_logo.json", get_template_logos)
    app.router.add_get(r"/templates/index.{locale:[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?}.json",
                       get_template_index_localized)
    app.router.add_get("/templates/{name}", get_template_file)


def add_editor_route(app: web.Application) -> None:
    """The editor's static files and extension folders: registered last, as it matches every path."""
    app.router.add_get("/{tail:.*}", get_static)


def init_app_keys(app: web.Application) -> None:
    """Per-application state of these routes (settings lock, thumbnail cache)."""
    app[SETTINGS_LOCK] = asyncio.Lock()
    app[THUMBNAILS] = {}
