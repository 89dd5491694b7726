"""Who may call the server, and what it reads: an ASGI middleware in front of the app.

Binding to 127.0.0.1 keeps other machines out, but not the user's own browser: any web page it opens may send
requests to a local port. The rules, in the order a request meets them:

* **Host** (DNS rebinding: a page on ``attacker.example`` whose name later resolves to 127.0.0.1 can read the answers,
  since the browser then treats the server as that page's origin): the ``Host`` header must name the address the
  server listens on, ``localhost`` when it listens on a loopback or wildcard address, any IP address when it listens
  on a wildcard address, or a name given with ``--allow-host`` (``*``: any). Else 403.
* **Origin** (a page's request carries its origin): a request with an ``Origin`` header is refused (403) unless that
  origin was given with ``--cors`` (``*``: any); those get CORS answers, preflights included. Without ``--cors`` the
  server sends no CORS headers, so no page can read an answer.
* **API key** (``--api-key`` or ``$SPARSESPEC_API_KEY``): every endpoint but ``/health`` needs
  ``Authorization: Bearer <key>``; else 401, as OpenAI answers.
* **Bodies**: a ``POST`` body must be ``application/json`` (else 415: a page may send ``text/plain`` across sites
  without asking the server first, JSON it may not) and at most ``max_body_bytes`` long (else 413, before it is
  read).
* **Unexpected errors** are answered as an OpenAI-style JSON 500, logged and counted, never as a bare traceback.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("sparsespec.serve")

API_KEY_ENV = "SPARSESPEC_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # answered without an API key: load balancers and scripts poll it
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: two million tokens of text, past every fixture's context
UNEXPECTED = "The server hit an unexpected error; its log has the details."


@dataclass(frozen=True)
class Access:
    """The server's rules for callers (see the module's docstring)."""

    listen_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # --allow-host; "*" accepts any Host
    cors_origins: tuple[str, ...] = ()  # --cors; "*" accepts any origin
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request's ``Host`` header names this server (see the module's docstring)."""
        if "*" in self.allowed_hosts:
            return True
        if not host_header:
            return False
        name = _host_name(host_header)
        listen = self.listen_host.lower().strip("[]")
        if name == listen or name in (h.lower() for h in self.allowed_hosts):
            return True
        wildcard = listen in ("0.0.0.0", "::", "")
        if name == "localhost":
            return wildcard or listen == "localhost" or _is_loopback(listen)
        if wildcard:
            return _is_ip(name)
        if listen == "localhost":  # what "localhost" resolves to
            return _is_loopback(name)
        return False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin in self.cors_origins


def access_from_environment(listen_host: str, allowed_hosts=(), cors_origins=(), api_key: str | None = None,
                            max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Access:
    """:class:`Access` from the flags, the API key falling back to ``$SPARSESPEC_API_KEY``."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    return Access(listen_host, tuple(allowed_hosts), tuple(cors_origins), key, max_body_bytes)


def _host_name(host_header: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8080`` → ``::1``, ``a.b:80`` → ``a.b``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """An OpenAI error object (every error the server answers is one)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BodyTooLarge(Exception):
    """A request body grew past the limit while it was read (a chunked body, which declares no length)."""

    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than this server's limit of {limit} bytes (--max-body-bytes).")


@dataclass
class Guard:
    """The ASGI middleware enforcing :class:`Access` around ``app``; ``on_server_error`` counts each 500."""

    app: Callable
    access: Access
    on_server_error: Callable[[], None] = field(default=lambda: None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _send_json(send, *refusal)
            return
        origin = headers.get("origin")
        cors = {}
        if origin is not None:
            cors = {"access-control-allow-origin": origin, "vary": "Origin"}
            if scope["method"] == "OPTIONS":  # a preflight of an allowed origin
                await _send_json(send, 204, None, {
                    **cors, "access-control-allow-methods": "GET, POST, OPTIONS",
                    "access-control-allow-headers": headers.get("access-control-request-headers", "*"),
                    "access-control-max-age": "600"})
                return
        started = False
        limit, read = self.access.max_body_bytes, 0

        async def limited_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if cors:
                    message = dict(message, headers=[*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in cors.items())])
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge as exc:  # the app answers it (server.py); this is for apps that do not
            if not started:
                await _send_json(send, 413, error_body(str(exc)))
        except Exception:  # a bug: answered (by the app's handler, else here) and counted; its traceback logged once
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            self.on_server_error()
            if not started:
                await _send_json(send, 500, error_body(UNEXPECTED, "server_error"))

    def _refusal(self, scope, headers: dict[str, str]) -> tuple[int, dict, dict] | None:
        """``(status, body, headers)`` of a request refused before the app sees it, or None."""
        access = self.access
        host = headers.get("host")
        if not access.host_allowed(host):
            return 403, error_body(f"The Host header {host!r} does not name this server; start it with "
                                   "--allow-host NAME to accept that name.", code="host_not_allowed"), {}
        origin = headers.get("origin")
        if origin is not None and not access.origin_allowed(origin):
            return 403, error_body(f"Requests from web pages at {origin} are refused; start the server with "
                                   f"--cors {origin} to allow them.", code="origin_not_allowed"), {}
        if scope["method"] == "OPTIONS" and origin is not None:
            return None  # an allowed preflight: it carries no credentials
        if access.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), access.api_key.encode()):
                return 401, error_body("Incorrect or missing API key; send it as 'Authorization: Bearer <key>'.",
                                       code="invalid_api_key"), {"www-authenticate": "Bearer"}
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return 415, error_body(f"The request body must be JSON sent as 'Content-Type: application/json' "
                                       f"(got {media or 'no content type'!r})."), {}
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > access.max_body_bytes):
                return 413, error_body(str(BodyTooLarge(access.max_body_bytes))), {}
        return None


async def _send_json(send, status: int, body: dict | None, headers: dict[str, str] | None = None) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    raw_headers = [(b"content-length", str(len(payload)).encode())]
    if body is not None:
        raw_headers.append((b"content-type", b"application/json"))
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
