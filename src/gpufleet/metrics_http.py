"""The controller's and the agent's Prometheus ports: bound where the operator says
(``GPUFLEET_METRICS_HOST``, default loopback), optionally behind HTTP basic auth
(``GPUFLEET_METRICS_BASIC_AUTH``) and TLS (``GPUFLEET_METRICS_TLS_CERT`` / ``_KEY``).

The metrics name teams (queue depth and allocation per team), GPU types and node paths, so
they are not for everyone who can reach the host. ``prometheus_client`` serves them (its
WSGI app and threading server); this module adds the check of the ``Authorization``
header: a scrape without valid credentials gets 401 and no metric. Standard library and
``prometheus_client`` only (the agent imports it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_METRICS_HOST = "127.0.0.1"

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class BasicAuth:
    """One user and the sha256 (hex) of its password."""

    user: str
    password_sha256: str

    def allows(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value carries this user and password
        (constant-time comparisons)."""
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip()).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        if not sep:
            return False
        digest = hashlib.sha256(password.encode()).hexdigest()
        user_ok = hmac.compare_digest(user.encode(), self.user.encode())
        return hmac.compare_digest(digest, self.password_sha256) and user_ok


def parse_basic_auth(value: str) -> BasicAuth:
    """``USER:sha256:HEX`` (the password's sha256, lowercase hex: nothing secret in the
    setting), ``USER:file:PATH`` (the password is the first line of the file, the same file
    Prometheus's ``password_file`` reads) or ``USER:PASSWORD``.

    Raises:
        ValueError: no user, an empty password, a malformed sha256, an unreadable file.
    """
    user, sep, rest = value.strip().partition(":")
    if not user or not sep or not rest:
        raise ValueError(
            "metrics basic auth: expected USER:sha256:HEX, USER:file:PATH or USER:PASSWORD"
        )
    kind, sep2, arg = rest.partition(":")
    if sep2 and kind == "sha256":
        if not _SHA256.fullmatch(arg):
            raise ValueError("metrics basic auth: sha256 must be 64 lowercase hex digits")
        return BasicAuth(user, arg)
    if sep2 and kind == "file":
        try:
            lines = Path(arg).expanduser().read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"metrics basic auth: password file {arg}: {exc}") from None
        password = lines[0] if lines else ""
        if not password:
            raise ValueError(f"metrics basic auth: password file {arg} is empty")
        return BasicAuth(user, hashlib.sha256(password.encode()).hexdigest())
    return BasicAuth(user, hashlib.sha256(rest.encode()).hexdigest())


def guarded(app: Callable[..., Iterable[bytes]], auth: BasicAuth | None) -> Any:
    """The WSGI ``app`` behind ``auth`` (None: unchanged): 401 with ``WWW-Authenticate``
    for a request without the right credentials."""
    if auth is None:
        return app

    def checked(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if auth.allows(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("WWW-Authenticate", 'Basic realm="gpufleet metrics", charset="UTF-8"'),
                ("Content-Type", "text/plain; charset=utf-8"),
            ],
        )
        return [b"401 Unauthorized: gpufleet metrics need basic auth credentials\n"]

    return checked


def serve(
    port: int,
    addr: str,
    registry: Any,
    *,
    auth: BasicAuth | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> tuple[Any, threading.Thread]:
    """Serve ``registry`` on ``http(s)://addr:port/metrics`` from a daemon thread (returns
    the server and the thread; ``server.server_address[1]`` is the bound port when
    ``port`` is 0). ``certfile``/``keyfile``: serve HTTPS with this PEM pair.

    Raises:
        OSError: the address cannot be bound.
        ValueError: only one of ``certfile`` and ``keyfile``.
    """
    from wsgiref.simple_server import make_server

    from prometheus_client import exposition, make_wsgi_app

    if bool(certfile) != bool(keyfile):
        raise ValueError("metrics TLS needs both a certificate and a key file")

    family, _ = exposition._get_best_family(addr, port)  # type: ignore[no-untyped-call]

    class Server(exposition.ThreadingWSGIServer):
        address_family = family

    app = guarded(make_wsgi_app(registry), auth)
    httpd = make_server(addr, port, app, Server, handler_class=exposition._SilentHandler)
    if certfile and keyfile:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(certfile, keyfile)
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread
