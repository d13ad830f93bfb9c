"""A plain-http ``httpx`` transport on the standard library's ``http.client``, for CLI calls.

httpx's own transport (httpcore, h11, anyio, certifi) is imported when an ``httpx.Client`` is
made and compiles h11's grammar on import: ~20 ms of CPU in a CLI call that then sends one or
two requests. ``http.client`` is already loaded by ``import httpx`` (through
``http.cookiejar``), so this transport costs nothing to import. It serves ``http://`` URLs
only, one keep-alive connection at a time, no proxy (:func:`usable` says when it applies;
otherwise the CLI uses httpx's default transport). Responses are streamed (``read1``), so
``logs --follow`` sees bytes as they arrive; httpx still decodes content encodings.

Errors are httpx's: ``ConnectError``/``ConnectTimeout`` before the request is sent,
``ReadTimeout``/``ReadError``/``RemoteProtocolError`` after, so the SDK maps them as before.
"""

from __future__ import annotations

import http.client
import os
import socket
from collections.abc import Iterator
from typing import Any

import httpx

_PROXY_VARS = ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")
_CHUNK = 65536


def usable(url: str) -> bool:
    """Whether :class:`StdlibTransport` can serve ``url``: plain http and no proxy set."""
    return url.lower().startswith("http://") and not any(os.environ.get(v) for v in _PROXY_VARS)


def _raw_headers(resp: http.client.HTTPResponse) -> list[tuple[bytes, bytes]]:
    """The answer's headers as the bytes that came (``http.client`` decodes them as
    Latin-1): httpx would encode ``str`` values as ASCII and raise on any other byte, such as
    the raw ``0xFC`` of an older server's ``Content-Disposition: filename="ü.txt"``."""
    return [
        (k.encode("latin-1", "replace"), v.encode("latin-1", "replace"))
        for k, v in resp.getheaders()
    ]


class _Body(httpx.SyncByteStream):
    def __init__(self, resp: http.client.HTTPResponse, owner: StdlibTransport) -> None:
        self._resp, self._owner = resp, owner

    def __iter__(self) -> Iterator[bytes]:
        try:
            while chunk := self._resp.read1(_CHUNK):
                yield chunk
        except TimeoutError as exc:
            self._owner.drop()
            raise httpx.ReadTimeout(str(exc) or "read timed out") from exc
        except (OSError, http.client.HTTPException) as exc:
            self._owner.drop()
            raise httpx.ReadError(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        if not self._resp.isclosed():
            # an unread rest (a stream given up early) makes the connection unusable
            self._resp.close()
            self._owner.drop()
        elif self._resp.will_close:
            self._owner.drop()


class StdlibTransport(httpx.BaseTransport):
    """``httpx.BaseTransport`` over one ``http.client.HTTPConnection`` (kept alive between
    requests to the same host and port; replaced when the server closed it)."""

    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._key: tuple[str, int] | None = None

    def drop(self) -> None:
        """Close the kept connection; the next request opens a new one."""
        if self._conn is not None:
            self._conn.close()
        self._conn = self._key = None

    def close(self) -> None:
        self.drop()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{url.scheme}:// needs httpx's own transport")
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        target = url.raw_path.decode("ascii")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
        if chunked:
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        body: Any = request.stream if ("content-length" in request.headers or chunked) else None
        if isinstance(body, httpx.ByteStream):
            body = b"".join(body)
        for attempt in (0, 1):
            reused = self._conn is not None and self._key == key
            conn = self._connect(key, timeouts) if not reused else self._conn
            assert conn is not None
            try:
                conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders(body, encode_chunked=chunked)
                resp = conn.getresponse()
            except TimeoutError as exc:
                self.drop()
                raise httpx.ReadTimeout(str(exc) or "read timed out", request=request) from exc
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError) as exc:
                self.drop()
                if reused and attempt == 0 and not isinstance(body, httpx.SyncByteStream):
                    continue  # the server closed the kept connection: once more on a new one
                raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
            except (OSError, http.client.HTTPException) as exc:
                self.drop()
                raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__) from exc
            return httpx.Response(
                status_code=resp.status,
                headers=_raw_headers(resp),
                stream=_Body(resp, self),
                extensions={
                    "http_version": b"HTTP/1.1" if resp.version == 11 else b"HTTP/1.0",
                    "reason_phrase": resp.reason.encode("latin-1", "replace"),
                },
            )
        raise AssertionError("unreachable")

    def _connect(
        self, key: tuple[str, int], timeouts: dict[str, float | None]
    ) -> http.client.HTTPConnection:
        self.drop()
        conn = http.client.HTTPConnection(key[0], key[1], timeout=timeouts.get("connect"))
        try:
            conn.connect()
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        assert conn.sock is not None
        conn.sock.settimeout(timeouts.get("read"))
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conn, self._key = conn, key
        return conn
