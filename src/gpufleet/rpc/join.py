"""Join tokens: ``gfj1.<CA sha256>.<secret>``, and fetching the CA the token pins.

A new node presents the secret once (the controller keeps only its sha256,
:func:`hash_secret`) and first verifies the controller by the CA fingerprint in the token
(kubeadm's discovery hash): :func:`fetch_ca_by_fingerprint` takes the CA from the chain the
join port presents, with the standard library's ``ssl`` only.
"""

from __future__ import annotations

import hashlib
import re
import socket
import ssl

from gpufleet.rpc.pki import CONTROLLER_NAME, PkiError

JOIN_PREFIX = "gfj1"


def format_join_token(ca_fingerprint: str, secret: str) -> str:
    """``gfj1.<ca sha256 hex>.<secret>``: the secret authorises one join; the CA fingerprint
    lets the agent verify the controller before sending it (kubeadm's discovery hash)."""
    return f"{JOIN_PREFIX}.{ca_fingerprint}.{secret}"


def parse_join_token(token: str) -> tuple[str, str]:
    """(CA fingerprint, secret). Raises ValueError naming what is wrong."""
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != JOIN_PREFIX:
        raise ValueError("join token: expected gfj1.<ca-sha256>.<secret>")
    if not re.fullmatch(r"[0-9a-f]{64}", parts[1]):
        raise ValueError("join token: the CA fingerprint must be 64 hex digits")
    if not parts[2]:
        raise ValueError("join token: empty secret")
    return parts[1], parts[2]


def fetch_ca_by_fingerprint(address: str, ca_fingerprint: str, timeout_s: float = 5.0) -> bytes:
    """The fleet CA certificate, taken from the chain the controller's join port presents and
    accepted only if its sha256 is ``ca_fingerprint`` (so the channel built on it afterwards
    verifies the real controller). Raises OSError (unreachable) or PkiError (no match)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # nothing is trusted from this handshake but the pinned CA
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=timeout_s) as raw,
        ctx.wrap_socket(raw, server_hostname=CONTROLLER_NAME) as tls,
    ):
        chain = _unverified_chain(tls)
    for der in chain:
        if hashlib.sha256(der).hexdigest() == ca_fingerprint:
            return ssl.DER_cert_to_PEM_cert(der).encode()
    raise PkiError(
        f"the controller at {address} does not present the CA {ca_fingerprint[:16]}... named "
        "by the join token"
    )


def _unverified_chain(tls: ssl.SSLSocket) -> list[bytes]:
    public = getattr(tls, "get_unverified_chain", None)  # Python >= 3.13
    if public is not None:
        return [bytes(c) for c in public()]
    certs = tls._sslobj.get_unverified_chain() or []  # type: ignore[attr-defined]  # 3.10-3.12
    return [c.public_bytes(ssl._ssl.ENCODING_DER) for c in certs]  # type: ignore[attr-defined]


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
