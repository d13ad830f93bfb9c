"""Limits of the API's HTTP connections, enforced below the ASGI app (before any routing or
authentication): the request head's size and header count, the time a head may take to
arrive, and connections per client address.

uvicorn's httptools protocol has no head limit of its own (its h11 protocol has
``h11_max_incomplete_event_size``): a client could stream a 100 MB header and the parser would
keep concatenating it on the event loop. :func:`guarded_httptools` returns a subclass of
uvicorn's ``HttpToolsProtocol`` that

- counts the bytes fed to the parser from the end of one request (or the connection's start)
  until the next head is complete and, past ``max_head_bytes``, answers ``431`` and closes the
  connection (at most one socket read over the limit is ever parsed; pipelined heads count
  too);
- answers ``431`` to a head with more than ``max_headers`` header fields;
- arms a timer when a connection opens and after each answer, cancelled when a head is
  complete: a client that sends nothing or trickles a head (slowloris) is answered ``408``
  and closed after ``head_timeout_s``; idle keep-alive connections are closed by uvicorn's
  ``timeout_keep_alive``;
- counts open connections per client address and closes at once (with a ``503``) any past
  ``max_per_ip``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("gpufleet.api")


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The HTTP connection limits of one API server.

    Attributes:
        max_head_bytes: request line + headers, bytes.
        max_headers: header fields per request.
        head_timeout_s: seconds a head may take to arrive (from the connection's start or
            the previous answer).
        max_per_ip: open connections per client address; 0 = no cap.
    """

    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    head_timeout_s: float = 10.0
    max_per_ip: int = 256


def _answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with the API's error document, closing the connection."""
    code = reason.lower().replace(" ", "_")
    body = json.dumps({"error": code, "message": message, "field": "headers"}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


def guarded_httptools(limits: EdgeLimits) -> type[asyncio.Protocol]:
    """A uvicorn ``http`` protocol class enforcing ``limits`` (one class per server: the
    per-address counts live on it)."""

    per_ip: dict[str, int] = {}

    class GuardedHttpTools(HttpToolsProtocol):
        _limits = limits

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._head_done = False
            self._header_count = 0
            self._refused = False
            self._ip: str | None = None
            self._head_timer: asyncio.TimerHandle | None = None

        # -- connection ----------------------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            ip = self.client[0] if self.client else None
            if ip is not None and limits.max_per_ip:
                if per_ip.get(ip, 0) >= limits.max_per_ip:
                    self._refuse(
                        503,
                        "Service Unavailable",
                        f"over {limits.max_per_ip} open connections from this address",
                    )
                    return
                per_ip[ip] = per_ip.get(ip, 0) + 1
                self._ip = ip
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            if self._ip is not None:
                left = per_ip.get(self._ip, 1) - 1
                if left > 0:
                    per_ip[self._ip] = left
                else:
                    per_ip.pop(self._ip, None)
                self._ip = None
            super().connection_lost(exc)

        # -- the head ------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if not self._head_done:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._refused:
                return
            if not self._head_done and self._head_bytes > limits.max_head_bytes:
                self._refuse(
                    431,
                    "Request Header Fields Too Large",
                    f"request head over {limits.max_head_bytes} bytes",
                )

        def on_message_begin(self) -> None:
            self._header_count = 0
            super().on_message_begin()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count <= limits.max_headers:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_done = True
            self._cancel_head_timer()
            if self._header_count > limits.max_headers:
                self._refused = True  # answered after the parser returns (data_received)
                self.loop.call_soon(
                    self._send_refusal,
                    431,
                    "Request Header Fields Too Large",
                    f"more than {limits.max_headers} header fields",
                )
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            super().on_message_complete()
            # what the parser reads next is the next request's head (pipelined or not)
            self._head_done = False
            self._head_bytes = 0

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a pipelined request (its head already complete) is being served
            if not self._head_done:
                self._arm_head_timer()

        # -- helpers -------------------------------------------------------------------
        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(limits.head_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._head_done or self.transport.is_closing():
                return
            if self._head_bytes:  # a started head: tell the client why
                self._refuse(
                    408, "Request Timeout", f"request head not sent in {limits.head_timeout_s:g} s"
                )
            else:  # an idle connection: close it quietly (RFC 9112, 9.5)
                self._refused = True
                self.transport.close()

        def _refuse(self, status: int, reason: str, message: str) -> None:
            self._refused = True
            self._send_refusal(status, reason, message)

        def _send_refusal(self, status: int, reason: str, message: str) -> None:
            self._cancel_head_timer()
            if self.transport.is_closing():
                return
            self.transport.write(_answer(status, reason, message))
            self.transport.close()

    return GuardedHttpTools
