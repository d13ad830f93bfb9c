"""gpufleet.rpc.tls_hint: gRPC errors of failed TLS handshakes -> the operator's hint."""

from __future__ import annotations

import pytest

from gpufleet.rpc.tls_hint import hint, hint_from_text

PREFIX = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:25532: Tls"
    " handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
    "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
)
NOW = 1_796_000_000.0  # 2026-11-30 00:53:20Z


class TestHintFromText:
    @pytest.mark.parametrize(
        ("details", "want_words"),
        [
            pytest.param(
                PREFIX + "certificate is not yet valid: OK",
                ("not yet valid", "clock is probably behind", "2026-11-30 00:53:20Z"),
                id="this clock behind: the peer's certificate not yet valid",
            ),
            pytest.param(
                PREFIX + "certificate has expired: OK",
                ("has expired", "clock may be ahead", "renew"),
                id="this clock ahead or the certificate expired",
            ),
            pytest.param(
                "failed to connect to all addresses; last error: UNKNOWN: ipv4:1.2.3.4:1: Tls"
                " handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:10000415:SSL"
                " routines:OPENSSL_internal:SSLV3_ALERT_CERTIFICATE_EXPIRED",
                ("refused this machine's TLS certificate", "clocks"),
                id="the peer refused our certificate by its clock (alert)",
            ),
            pytest.param(
                PREFIX + "unable to get local issuer certificate: OK",
                ("could not be verified", "unable to get local issuer certificate", "CA"),
                id="another CA: verification failed, reason named",
            ),
        ],
    )
    def test_certificate_problems_are_named(
        self, details: str, want_words: tuple[str, ...]
    ) -> None:
        got = hint_from_text(details, NOW)
        assert got is not None
        for word in want_words:
            assert word in got, (word, got)

    @pytest.mark.parametrize(
        "details",
        [
            pytest.param(
                "failed to connect to all addresses; last error: UNAVAILABLE:"
                " ipv4:127.0.0.1:1: Connection refused",
                id="connection refused: a network problem, no hint",
            ),
            pytest.param("Deadline Exceeded", id="timeout: no hint"),
            pytest.param("", id="empty"),
        ],
    )
    def test_other_errors_get_no_hint(self, details: str) -> None:
        assert hint_from_text(details, NOW) is None


class _RpcError(Exception):
    def __init__(self, details: str | None, debug: str = "") -> None:
        self._details, self._debug = details, debug

    def details(self) -> str | None:
        return self._details

    def debug_error_string(self) -> str:
        return self._debug


def test_hint_reads_the_errors_details_or_debug_string() -> None:
    assert "not yet valid" in (hint(_RpcError(PREFIX + "certificate is not yet valid")) or "")
    # some errors carry the reason only in the debug string
    assert "has expired" in (hint(_RpcError(None, PREFIX + "certificate has expired")) or "")
    assert hint(_RpcError("Connection refused")) is None
    assert hint(ValueError("certificate is not yet valid")) is not None  # plain text too
