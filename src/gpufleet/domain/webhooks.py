"""Completion webhooks: which URLs are accepted, how a delivery is signed and how a receiver
checks it (docs/design/security.md, "Completion webhooks").

A delivery is ``POST <url>`` with the job's final record as a JSON body and the headers

- ``X-Gpufleet-Timestamp``: Unix seconds when the delivery was made (integer, as text);
- ``X-Gpufleet-Signature``: ``sha256=<hex>``, the HMAC-SHA256, keyed with the team's
  webhook secret (UTF-8), of ``<timestamp>.<body>`` (the timestamp's text, a dot, the body's
  bytes): the timestamp is signed with the body, so a captured delivery cannot be replayed
  under a fresh timestamp; a receiver refuses one whose timestamp is older than its
  tolerance (:data:`DEFAULT_TOLERANCE_S`);
- ``X-Gpufleet-Delivery``: the job id (one job, one delivery; a retry repeats it), so a
  receiver can drop a repeat it already processed.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Gpufleet-Signature"
TIMESTAMP_HEADER = "X-Gpufleet-Timestamp"
DELIVERY_HEADER = "X-Gpufleet-Delivery"
DEFAULT_TOLERANCE_S = 300.0
"""How old a delivery's timestamp a receiver should accept, seconds (5 minutes)."""
MAX_URL_LENGTH = 2048
MAX_URLS = 8
"""Most webhook URLs of one job (or one team's defaults)."""


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a webhook (None: it can): not ``http://`` or ``https://``, no
    host, credentials in it, too long. Where it points (loopback, private addresses) is
    checked at delivery, against the resolved address (``services.notify``)."""
    if len(url) > MAX_URL_LENGTH:
        return f"is longer than {MAX_URL_LENGTH} characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "has no host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (the delivery is signed instead)"
    if port == 0:
        return "has port 0"
    if any(c in url for c in " \n\r\t\x00"):
        return "must not hold whitespace or NUL"
    return None


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The ``X-Gpufleet-Signature`` value of ``body`` sent at ``timestamp`` (Unix seconds):
    ``sha256=`` and the hex HMAC-SHA256 of ``b"<timestamp>." + body`` keyed with ``secret``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(
    secret: str,
    body: bytes,
    signature: str,
    timestamp: str,
    *,
    now: float | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> bool:
    """What a receiver checks: ``signature`` is :func:`sign` of ``body`` at ``timestamp``
    (compared in constant time) and ``timestamp`` is within ``tolerance_s`` seconds of
    ``now`` (default: this machine's clock)."""
    try:
        ts = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, ts, body), signature)
