"""gRPC channel and server options for fast reconnects and dead-peer detection.

gRPC's defaults back off reconnects up to 120 s and never probe an idle connection, so a
client whose server restarted keeps failing ("failed to connect to all addresses") for tens
of seconds after the server listens again, and a connection to a host that vanished is
believed alive until a call's deadline. With these options (``CLIENT_OPTIONS``):

* a reconnect is tried 0.2 s after a failure, the delay growing 1.6x to at most 1 s (gRPC
  adds +-20 % jitter): a client reconnects within ~1.2 s of the server listening again;
* one connect attempt may take up to 2 s (``grpc.min_reconnect_backoff_ms`` is also gRPC's
  minimum connect timeout), so a TLS handshake over a slow link still completes;
* HTTP/2 keepalive pings every 5 s, also without calls, answered within 3 s: a connection
  to a host that vanished is declared dead in ~8 s and its calls fail UNAVAILABLE, which
  is what makes the agent's controller failover (``agent.controllers``) move on.

``SERVER_OPTIONS`` let servers accept those pings (gRPC's default would answer a client
that pings more often than every 5 minutes with GOAWAY ``too_many_pings``).
"""

from __future__ import annotations

RECONNECT_MAX_S = 1.0
"""Longest wait between two connect attempts, seconds (before gRPC's +-20 % jitter)."""

CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000)),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
)
