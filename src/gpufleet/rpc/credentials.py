"""gRPC TLS credentials from PEM bytes: the servers' (reloadable for renewal) and channels'.

The controller's main port and each agent's port require a client certificate from the
fleet CA; :class:`ReloadableServerCredentials` lets a renewed key pair take over new
handshakes while serving. :func:`secure_channel` verifies the server's certificate names the
expected fleet name (``controller.gpufleet`` or ``<node>.node.gpufleet``), whatever address is
dialled. No ``cryptography``: gRPC does the TLS.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from gpufleet.rpc.channel_options import CLIENT_OPTIONS


def server_credentials(
    key_pem: bytes, chain_pem: bytes, ca_pem: bytes, *, require_client_auth: bool
) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(key_pem, chain_pem)], root_certificates=ca_pem, require_client_auth=require_client_auth
    )


class ReloadableServerCredentials:
    """Server credentials whose key pair can be replaced while serving (certificate renewal):
    new handshakes use the newest pair; open connections keep theirs."""

    def __init__(self, key_pem: bytes, chain_pem: bytes, ca_pem: bytes) -> None:
        self._lock = threading.Lock()
        self._next: Any = None
        self.credentials = grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)], ca_pem),
            self._fetch,
            require_client_authentication=True,
        )

    def replace(self, key_pem: bytes, chain_pem: bytes, ca_pem: bytes) -> None:
        with self._lock:
            self._next = grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)], ca_pem)

    def _fetch(self) -> Any:
        with self._lock:
            nxt, self._next = self._next, None
        return nxt


def channel_credentials(
    ca_pem: bytes, key_pem: bytes | None = None, chain_pem: bytes | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=ca_pem, private_key=key_pem, certificate_chain=chain_pem
    )


def secure_channel(address: str, creds: grpc.ChannelCredentials, server_name: str) -> grpc.Channel:
    """A TLS channel to ``address`` that verifies the server's certificate names
    ``server_name`` (``controller.gpufleet`` or ``<node>.node.gpufleet``), whatever host or
    IP ``address`` uses; reconnects fast (``rpc.channel_options.CLIENT_OPTIONS``)."""
    return grpc.secure_channel(
        address,
        creds,
        options=[
            ("grpc.ssl_target_name_override", server_name),
            ("grpc.default_authority", server_name),
            *CLIENT_OPTIONS,
        ],
    )
