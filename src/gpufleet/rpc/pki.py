"""Fleet PKI: the names, keys and encodings every side shares (controller, agent, CLI).

What a certificate says (org ``gpufleet``, role in the OU, node id in the CN, the SANs
agents and the controller verify), :class:`PkiError`, :class:`Identity`, and keys, PEM and
fingerprints. ``cryptography`` is imported by the functions that use it, never by importing
this module (:func:`fingerprint` of PEM bytes and :func:`first_der` need only the standard
library). The CA that signs lives in :mod:`gpufleet.rpc.ca`; :mod:`gpufleet.rpc.tls` is the
overview and re-exports every public name.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

ORG = "gpufleet"
ROLE_CONTROLLER = "controller"
ROLE_NODE = "node"
ROLE_API = "api"
"""An API server's client certificate: ``Agent.Exec`` only (docs/design/security.md)."""
API_CERT_TTL_S = 365 * 86400
CONTROLLER_NAME = "controller.gpufleet"
NODE_SUFFIX = ".node.gpufleet"
CA_TTL_S = 10 * 365 * 86400
CONTROLLER_CERT_TTL_S = 365 * 86400
CLOCK_SKEW_S = 300
"""Certificates start this long before their issue time (clocks of two hosts differ)."""

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""Node ids that can be put in a certificate (a DNS-name-like string, at most 63 chars)."""


class PkiError(RuntimeError):
    """A missing or unusable CA, key or certificate; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified peer certificate names.

    role: ``controller`` or ``node``; name: the node id (CN); serial: hex serial number;
    not_after: expiry (UTC).
    """

    role: str
    name: str
    serial: str
    not_after: dt.datetime


# ---------------------------------------------------------------- keys, PEM, fingerprints


def new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


_PEM_CERT = re.compile(
    rb"-----BEGIN CERTIFICATE-----([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----"
)


def first_der(pem: bytes) -> bytes:
    """The DER bytes of the first certificate of a PEM text (a chain: its leaf), decoded with
    the standard library only (the DER is not parsed).

    Raises:
        ValueError: no PEM certificate block, or one that is not base64.
    """
    m = _PEM_CERT.search(pem)
    if m is None:
        raise ValueError("no PEM certificate")
    return base64.b64decode(b"".join(m.group(1).split()), validate=True)


def fingerprint(cert: x509.Certificate | bytes) -> str:
    """sha256 of the certificate's DER, lowercase hex (64 chars). Accepts a cert or PEM (the
    first certificate of it; read without ``cryptography``).

    Raises:
        ValueError: PEM bytes without a readable certificate block.
    """
    if isinstance(cert, bytes):
        return hashlib.sha256(first_der(cert)).hexdigest()
    from cryptography.hazmat.primitives import hashes

    return cert.fingerprint(hashes.SHA256()).hex()


def serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# ---------------------------------------------------------------- names in certificates


def _name(role: str, cn: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def check_node_id(node_id: str) -> None:
    """Raises ValueError unless ``node_id`` fits a certificate (1-63 of A-Z a-z 0-9 _ . -)."""
    if not NODE_ID.match(node_id):
        raise ValueError(
            f"node id {node_id!r}: use 1-63 of A-Z a-z 0-9 _ . - starting with a letter or digit"
        )


def node_target_name(node_id: str) -> str:
    """The SAN of ``node_id``'s certificate, verified by the controller when it calls it."""
    return f"{node_id}{NODE_SUFFIX}"


def identity_of(cert: x509.Certificate) -> Identity | None:
    """The role and name a (verified) certificate carries, or None if it has neither."""
    from cryptography.x509.oid import NameOID

    try:
        org = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        role = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError:
        return None
    if not org or org[0].value != ORG or not role or not cn:
        return None
    return Identity(
        str(role[0].value), str(cn[0].value), serial_hex(cert), cert.not_valid_after_utc
    )
