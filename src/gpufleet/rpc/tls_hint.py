"""What a failed TLS handshake means, in words an operator can act on.

A gRPC call whose TLS handshake fails answers UNAVAILABLE, the same code as a controller
that is down, and the reason is only in the error's details, e.g. ``... Tls handshake failed
(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:
CERTIFICATE_VERIFY_FAILED: certificate is not yet valid``. A node whose clock is far behind
(or ahead) fails exactly so, for ever, while its log would say "not reachable yet".
:func:`hint` reads those details and names the real problem: the clock or the certificate's
validity. It reads text only (no ``grpc`` import), so it takes any exception.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

# (substring of the details, lower case) -> what it means; the first match wins
_RULES: tuple[tuple[str, str], ...] = (
    (
        "certificate is not yet valid",
        "the TLS handshake failed because the peer's certificate is not yet valid by this"
        " machine's clock (it reads {now}): this clock is probably behind; fix the time"
        " (NTP) here, or check the certificate's validity dates",
    ),
    (
        "certificate has expired",
        "the TLS handshake failed because the peer's certificate has expired by this"
        " machine's clock (it reads {now}): this clock may be ahead, or the certificate"
        " really expired (renew it); check the time (NTP) here",
    ),
    (
        "certificate_expired",  # a TLS alert: the peer refused OUR certificate
        "the peer refused this machine's TLS certificate as expired (or not yet valid) by"
        " its own clock (this one reads {now}): one of the two clocks is wrong (check"
        " NTP on both), or the certificate really expired (renew it)",
    ),
    (
        "certificate_verify_failed",
        "the TLS handshake failed: the peer's certificate could not be verified ({detail});"
        " check that both sides use the same fleet CA and that this machine's clock"
        " ({now}) is right",
    ),
)


def hint_from_text(details: str, now_unix_s: float | None = None) -> str | None:
    """The operator's hint for gRPC error details ``details``, or None when they do not
    name a certificate problem. ``now_unix_s``: this machine's clock (default: now), shown
    in the hint so that a wrong clock is seen at once."""
    low = details.lower()
    for needle, text in _RULES:
        if needle in low:
            now = datetime.fromtimestamp(
                time.time() if now_unix_s is None else now_unix_s, UTC
            ).strftime("%Y-%m-%d %H:%M:%SZ")
            return text.format(now=now, detail=_verify_detail(details))
    return None


def hint(exc: BaseException, now_unix_s: float | None = None) -> str | None:
    """:func:`hint_from_text` of a ``grpc.RpcError``'s details (its ``details()`` and
    ``debug_error_string()``, whichever it has), or of ``str(exc)`` otherwise."""
    parts = []
    for name in ("details", "debug_error_string"):
        method = getattr(exc, name, None)
        if callable(method):
            try:
                got = method()
            except Exception:  # a partial fake of RpcError: use what there is
                continue
            if got:
                parts.append(str(got))
    return hint_from_text(" ".join(parts) or str(exc), now_unix_s)


def _verify_detail(details: str) -> str:
    """The words after ``CERTIFICATE_VERIFY_FAILED:`` (the verifier's reason), trimmed."""
    _, found, rest = details.partition("CERTIFICATE_VERIFY_FAILED")
    if not found:
        return details.strip()[:200]
    reason = rest.lstrip(": ").split(": OK")[0].strip()
    return reason[:200] or "no reason given"
