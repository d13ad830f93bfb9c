"""A node's own credentials: its key's CSR, the saved key and certificate, renewal timing.

The node makes its key and CSR (:func:`make_csr`); the controller signs it after a join
token or, for renewal, the node's current certificate. :class:`NodeCredentials` saves and
loads ``node.key``, ``node.crt`` and ``ca.crt`` and says why they cannot be used
(:meth:`NodeCredentials.problem`). :class:`CertFacts` and :func:`renew_at` are plain values
and arithmetic: what the long-running agent keeps for its renewal timer, without
``cryptography`` (its certificate work runs in ``gpufleet.agent.pkichild``).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpufleet.rpc.pki import (
    CLOCK_SKEW_S,
    ROLE_NODE,
    _name,
    _now,
    identity_of,
    serial_hex,
    write_private,
)

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec


def make_csr(key: ec.EllipticCurvePrivateKey, node_id: str) -> bytes:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(ROLE_NODE, node_id))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def renew_at(not_before: dt.datetime, not_after: dt.datetime) -> dt.datetime:
    """When to renew a certificate valid ``[not_before, not_after]`` (UTC): at 2/3 of its
    lifetime, counted from the issue time (``not_before`` is backdated by ``CLOCK_SKEW_S``)."""
    issued = min(not_before + dt.timedelta(seconds=CLOCK_SKEW_S), not_after)
    return issued + (not_after - issued) * 2 / 3


@dataclass(frozen=True, slots=True)
class CertFacts:
    """What a node process needs to know of its own certificate, as plain values (no
    ``cryptography`` object): hex serial, validity bounds (UTC)."""

    serial: str
    not_before: dt.datetime
    not_after: dt.datetime

    def renew_at(self) -> dt.datetime:
        """See :func:`renew_at`."""
        return renew_at(self.not_before, self.not_after)

    def to_json(self) -> dict[str, str]:
        return {
            "serial": self.serial,
            "not_before": self.not_before.isoformat(),
            "not_after": self.not_after.isoformat(),
        }

    @classmethod
    def from_json(cls, data: dict[str, str]) -> CertFacts:
        """Inverse of :meth:`to_json`. Raises KeyError/ValueError on a malformed dict."""
        return cls(
            str(data["serial"]),
            dt.datetime.fromisoformat(data["not_before"]),
            dt.datetime.fromisoformat(data["not_after"]),
        )


@dataclass(frozen=True)
class NodeCredentials:
    """A node's key, certificate chain and CA certificate (all PEM)."""

    key_pem: bytes
    chain_pem: bytes
    ca_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        from cryptography import x509

        return x509.load_pem_x509_certificate(self.chain_pem)

    @property
    def not_before(self) -> dt.datetime:
        return self.cert.not_valid_before_utc

    @property
    def not_after(self) -> dt.datetime:
        return self.cert.not_valid_after_utc

    def facts(self) -> CertFacts:
        """Serial and validity of the certificate. Raises ValueError when unreadable."""
        cert = self.cert
        return CertFacts(serial_hex(cert), cert.not_valid_before_utc, cert.not_valid_after_utc)

    def renew_at(self) -> dt.datetime:
        """See :func:`renew_at`."""
        return renew_at(self.not_before, self.not_after)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        write_private(directory / "node.key", self.key_pem)
        write_private(directory / "node.crt", self.chain_pem)
        write_private(directory / "ca.crt", self.ca_pem)

    @classmethod
    def load(cls, directory: Path) -> NodeCredentials | None:
        """The credentials saved in ``directory``, or None when any file is missing."""
        try:
            return cls(
                (directory / "node.key").read_bytes(),
                (directory / "node.crt").read_bytes(),
                (directory / "ca.crt").read_bytes(),
            )
        except FileNotFoundError:
            return None

    def problem(self, node_id: str) -> str | None:
        """Why these credentials cannot be used for ``node_id`` now, or None when they can."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            cert = self.cert
            ca = x509.load_pem_x509_certificate(self.ca_pem)
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except ValueError as exc:
            return f"unreadable: {exc}"
        ident = identity_of(cert)
        if ident is None or ident.role != ROLE_NODE or ident.name != node_id:
            return f"the certificate is not a node certificate for {node_id!r}"
        if cert.public_key() != key.public_key():
            return "the key does not match the certificate"
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, Exception):  # InvalidSignature is not a ValueError
            return "the certificate is not signed by the saved CA"
        if cert.not_valid_after_utc <= _now():
            return f"the certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S}Z"
        return None
