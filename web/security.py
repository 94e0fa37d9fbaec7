"""The server's outer wall: who may talk to it at all, from where, and how much they may send.

Checks, in order, for every request (websocket included):
1. the body cap: a declared `Content-Length` over `--max-upload-size` is answered 413 before any of
   the body is read (a chunked body is cut off at the same cap while it is read);
2. the `Host` header must name a loopback address or a configured host (DNS rebinding);
3. cross-site requests are refused: `Sec-Fetch-Site: cross-site` (except a plain top-level navigation
   that only displays a page), and an `Origin` that does not match the `Host` (`Origin: null` included);
4. when the server listens beyond loopback, a token is required (bearer header, basic-auth password,
   `?token=` or the cookie set after a `?token=` visit), compared in constant time;
5. only then is a compressed body (`Content-Encoding: gzip` or `deflate`) inflated: aiohttp's own
   decompression is off (`start_server` passes `auto_decompress=False`), so nothing is inflated for a
   request that the checks above refuse. Inflating runs off the event loop, a bounded piece at a time,
   and stops with 413 as soon as the inflated bytes pass `--max-upload-size`.
Every response carries `X-Content-Type-Options: nosniff`.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import zlib
from base64 import b64decode
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aiohttp import streams, web

logger = logging.getLogger(__name__)

TOKEN_COOKIE = "weft_token"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass
class SecurityConfig:
    """What the middleware enforces."""

    max_body_bytes: int = 100 * 2**20  # --max-upload-size, in bytes
    token: str | None = None  # None: no token needed (loopback or --insecure-no-auth)
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)  # host names beside loopback (lower case)
    allow_any_host: bool = False  # only with --insecure-no-auth on a wildcard address and no --allowed-hosts


def is_loopback_host(host: str) -> bool:
    """`localhost`, 127.0.0.0/8 or ::1 (brackets allowed)."""
    name = host.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """('host', port) from a Host header value such as `example:8188` or `[::1]:8188`."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value, None
        host, rest = value[1:end], value[end + 1:]
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    if port and not port.isdigit():
        return host, -1
    return host, int(port) if port else None


def _refuse(status: int, message: str) -> web.Response:
    error_type = {403: "forbidden", 413: "too_large"}.get(status, "refused")
    return web.json_response({"error": {"type": error_type, "message": message,
                                         "details": "", "extra_info": {}}, "node_errors": {}}, status=status,
                             headers={"X-Content-Type-Options": "nosniff"})


def host_allowed(config: SecurityConfig, host_header: str) -> bool:
    """Is the Host header loopback or a configured host name?"""
    host, port = split_host(host_header)
    if port == -1 or not host:
        return False
    if is_loopback_host(host):
        return True
    if config.allow_any_host:
        return True
    return host in config.allowed_hosts


def origin_matches(origin: str, host_header: str, scheme: str) -> bool:
    """Does the Origin header name this very server (scheme, host and port)?"""
    if origin.strip().lower() == "null":
        return False
    try:
        parts = urlsplit(origin.strip())
        origin_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.scheme != scheme:
        return False
    default = {"http": 80, "https": 443}
    host, port = split_host(host_header)
    if port == -1:
        return False
    origin_port = origin_port or default[parts.scheme]
    port = port or default.get(scheme, 80)
    return parts.hostname.lower() == host.strip("[]") and origin_port == port


def _presented_token(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    if auth.lower().startswith("basic "):  # clients that only know basic auth: the password is the token
        try:
            return b64decode(auth[6:].strip()).decode("utf-8", "replace").partition(":")[2]
        except ValueError:
            return None
    if "token" in request.query:
        return request.query["token"]
    return request.cookies.get(TOKEN_COOKIE)


def token_ok(expected: str, presented: str | None) -> bool:
    """Constant-time comparison (on bytes, so the length of a wrong guess leaks nothing useful)."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8", "replace"))


def is_safe_navigation(request: web.Request) -> bool:
    """A top-level GET that only displays a page: following a link to the editor from elsewhere."""
    return (request.method in ("GET", "HEAD") and request.headers.get("Sec-Fetch-Mode") == "navigate"
            and request.headers.get("Sec-Fetch-Dest", "document") == "document"
            and request.headers.get("Upgrade", "").lower() != "websocket")


def _add_page_headers(headers) -> None:
    headers.setdefault("X-Content-Type-Options", "nosniff")
    # Only this server's own pages may frame the editor (older browsers send no Sec-Fetch-* headers).
    headers.setdefault("X-Frame-Options", "SAMEORIGIN")
    csp = headers.get("Content-Security-Policy")
    if csp is None:
        headers["Content-Security-Policy"] = "frame-ancestors 'self'"
    elif "frame-ancestors" not in csp:
        headers["Content-Security-Policy"] = csp.rstrip("; ") + "; frame-ancestors 'self'"


def security_middleware(config: SecurityConfig):
    """The aiohttp middleware enforcing `config`."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        length = request.headers.get("Content-Length")
        if length is not None:
            if not length.strip().isdigit():
                return _refuse(400, "Content-Length is not a number")
            if int(length) > config.max_body_bytes:
                return _refuse(413, f"request body of {int(length)} bytes is over the limit of "
                                    f"{config.max_body_bytes} bytes (--max-upload-size)")
        host_header = request.headers.get("Host")
        if host_header is not None and not host_allowed(config, host_header):
            return _refuse(403, f"host {host_header!r} is not this server's (allowed: loopback"
                                f"{', ' + ', '.join(sorted(config.allowed_hosts)) if config.allowed_hosts else ''})")
        fetch_site = request.headers.get("Sec-Fetch-Site", "").lower()
        if fetch_site == "cross-site" and not is_safe_navigation(request):
            return _refuse(403, "cross-site requests are refused")
        origin = request.headers.get("Origin")
        if origin is not None:
            if host_header is None or not origin_matches(origin, host_header, request.scheme):
                return _refuse(403, f"origin {origin!r} does not match this server")
        if config.token is not None:
            presented = _presented_token(request)
            if not token_ok(config.token, presented):
                return _refuse(401, "this server needs its access token (Authorization: Bearer TOKEN, "
                                    "or open the editor once with ?token=TOKEN)")
        if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
            try:
                request = await inflated_request(request, config.max_body_bytes)
            except BodyRefused as refused:
                return _refuse(refused.status, str(refused))
        try:
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:  # aiohttp's own body cap: the same JSON as ours
            response = _refuse(413, f"request body is over the limit of {config.max_body_bytes} bytes "
                                    f"(--max-upload-size)")
        except web.HTTPException as exc:
            # An error raised as an exception (405, a handler's 400) carries the same headers as any
            # other response.
            _add_page_headers(exc.headers)
            raise
        _add_page_headers(response.headers)
        if config.token is not None and "token" in request.query and request.cookies.get(TOKEN_COOKIE) != config.token:
            response.set_cookie(TOKEN_COOKIE, config.token, httponly=True, samesite="Strict", path="/")
        return response

    return middleware


# ---------------------------------------------------------------------- compressed request bodies
# zlib's wbits: 16 + 15 reads a gzip stream, 15 a zlib stream, -15 a raw deflate stream (some clients
# send raw deflate under "deflate").
_INFLATE_WBITS = {"gzip": 16 + 15, "x-gzip": 16 + 15, "deflate": 15}
INFLATE_STEP_BYTES = 4 * 2**20  # the most one executor call inflates: bounds a step's time and memory


class BodyRefused(ValueError):
    """A request body the server will not take; `status` is the HTTP status that says so."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Inflater:
    """Inflates one body, counting what it produced; each call produces at most INFLATE_STEP_BYTES."""

    def __init__(self, encoding: str, limit_bytes: int) -> None:
        self.encoding = encoding
        self.limit_bytes = limit_bytes
        self.produced_bytes = 0
        self.first = True
        self.decompressor = zlib.decompressobj(_INFLATE_WBITS[encoding])

    def _over(self) -> BodyRefused:
        return BodyRefused(413, f"request body inflates to more than {self.limit_bytes} bytes, the limit "
                                f"(--max-upload-size)")

    def step(self, data: bytes) -> tuple[bytes, bytes]:
        """Inflate from `data`: (inflated bytes, input not consumed yet). Runs in a worker thread."""
        if self.first and self.encoding == "deflate" and data and data[0] & 0x0F != 8:
            self.decompressor = zlib.decompressobj(-15)  # raw deflate, no zlib header
        self.first = False
        # One byte past the limit is enough to know the body is over it.
        room = min(INFLATE_STEP_BYTES, self.limit_bytes - self.produced_bytes + 1)
        try:
            out = self.decompressor.decompress(data, room)
        except zlib.error as exc:
            raise BodyRefused(400, f"request body is not valid {self.encoding}: {exc}") from None
        self.produced_bytes += len(out)
        if self.produced_bytes > self.limit_bytes:
            raise self._over()
        return out, self.decompressor.unconsumed_tail

    def finish(self) -> None:
        if not self.decompressor.eof:
            raise BodyRefused(400, f"request body ends before its {self.encoding} stream does")


async def inflated_request(request: web.Request, limit_bytes: int) -> web.Request:
    """`request` with its compressed body replaced by the inflated one, inflated off the event loop.

    Refuses (BodyRefused) an unknown or stacked encoding (415), a body that is not what it claims (400)
    and one whose compressed or inflated size passes `limit_bytes` (413), stopping at once."""
    encoding = request.headers["Content-Encoding"].strip().lower()
    if encoding not in _INFLATE_WBITS:
        raise BodyRefused(415, f"Content-Encoding {encoding!r} is not accepted for request bodies "
                               f"(gzip and deflate are)")
    inflater = _Inflater(encoding, limit_bytes)
    loop = asyncio.get_running_loop()
    pieces: list[bytes] = []
    received_bytes = 0
    async for chunk in request.content.iter_any():
        received_bytes += len(chunk)
        if received_bytes > limit_bytes:  # a chunked body declares no length: count what arrives
            raise BodyRefused(413, f"request body is over the limit of {limit_bytes} bytes (--max-upload-size)")
        pending = chunk
        while pending:
            out, pending = await loop.run_in_executor(None, inflater.step, pending)
            pieces.append(out)
    if received_bytes:
        inflater.finish()
    # A limit above the body's size: the reader never asks the (finished) connection to pause.
    body = streams.StreamReader(request.protocol, max(inflater.produced_bytes, 2**16), loop=loop)
    for piece in pieces:
        if piece:
            body.feed_data(piece)
    body.feed_eof()
    headers = request.headers.copy()
    del headers["Content-Encoding"]
    headers.popall("Content-Length", None)
    inflated = request.clone(headers=headers)
    # aiohttp's Request takes its body only at construction; the clone is handed the inflated one.
    inflated._payload = body
    return inflated


MAX_JSON_DEPTH = 64  # nesting of JSON a request field or a model header may have


class JsonTooDeep(ValueError):
    """JSON nested more deeply than the server accepts."""


def check_json_depth(value: Any, *, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """`value`, or JsonTooDeep when its lists and objects nest more than `max_depth` levels (measured
    without recursion, so measuring a hostile value cannot itself overflow the stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
        for child in children:
            if isinstance(child, (dict, list, tuple)):
                if depth + 1 > max_depth:
                    raise JsonTooDeep(f"{what} nested more than {max_depth} levels deep")
                stack.append((child, depth + 1))
    return value


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """json.loads, refusing (JsonTooDeep) a value nested more than `max_depth` levels deep."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"{what} nested more than {max_depth} levels deep") from None
    return check_json_depth(value, max_depth=max_depth, what=what)


def json_error(status: int, message: str, *, error_type: str = "invalid_request", details: str = "") -> web.Response:
    """An error body in ComfyUI's `{error, node_errors}` shape."""
    body = {"error": {"type": error_type, "message": message, "details": details, "extra_info": {}}, "node_errors": {}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")
