"""The fleet CA and what it signs: the controller's certificate and nodes' CSRs.

``{pki_dir}/ca.key`` (mode 0600) and ``ca.crt``: a self-signed EC P-256 CA, made once by
:func:`init_ca`, read by :func:`load_ca` where controllers run (whoever holds ``ca.key`` can
mint any identity). :class:`FleetCA` issues the controller's certificate at every controller
start and signs node CSRs on Join and Renew, taking only the CSR's public key: the subject,
the role (OU) and the SAN come from the CA. ``cryptography`` is imported by the functions
that use it, so importing this module costs no process (the agent included) that library.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpufleet.rpc.pki import (
    API_CERT_TTL_S,
    CA_TTL_S,
    CLOCK_SKEW_S,
    CONTROLLER_CERT_TTL_S,
    CONTROLLER_NAME,
    ORG,
    ROLE_API,
    ROLE_CONTROLLER,
    ROLE_NODE,
    PkiError,
    _name,
    _now,
    cert_pem,
    check_node_id,
    fingerprint,
    key_pem,
    new_key,
    node_target_name,
    write_private,
)

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

CA_KEY, CA_CERT = "ca.key", "ca.crt"


# ---------------------------------------------------------------- the fleet CA


@dataclass(frozen=True)
class FleetCA:
    """The CA's key and certificate; signs controller and node certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def cert_pem(self) -> bytes:
        return cert_pem(self.cert)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.cert)

    def _issue(
        self,
        public_key: Any,
        subject: x509.Name,
        sans: list[x509.GeneralName],
        ttl_s: float,
    ) -> x509.Certificate:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID

        now = _now()
        not_after = min(now + dt.timedelta(seconds=ttl_s), self.cert.not_valid_after_utc)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(seconds=CLOCK_SKEW_S))
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def issue_controller(
        self, hostnames: list[str], ttl_s: float = CONTROLLER_CERT_TTL_S
    ) -> tuple[bytes, bytes]:
        """A new controller key and certificate: (key PEM, chain PEM = cert + CA cert).

        SANs: ``controller.gpufleet``, ``localhost``, 127.0.0.1, ::1 and ``hostnames``
        (IP addresses or DNS names)."""
        from cryptography import x509

        key = new_key()
        sans: list[x509.GeneralName] = [
            x509.DNSName(CONTROLLER_NAME),
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            x509.IPAddress(ipaddress.ip_address("::1")),
        ]
        for h in hostnames:
            h = h.strip()
            if not h:
                continue
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        cert = self._issue(
            key.public_key(), _name(ROLE_CONTROLLER, "gpufleet-controller"), sans, ttl_s
        )
        return key_pem(key), cert_pem(cert) + self.cert_pem

    def issue_api(self, ttl_s: float = API_CERT_TTL_S) -> tuple[bytes, bytes]:
        """A new API-server client key and certificate (``OU=api``, ``CN=gpufleet-api``, no
        name an agent or a controller verifies as a server): (key PEM, chain PEM). Agents take
        it for ``Exec`` only."""
        from cryptography import x509

        key = new_key()
        cert = self._issue(
            key.public_key(),
            _name(ROLE_API, "gpufleet-api"),
            [x509.DNSName("api.gpufleet")],
            ttl_s,
        )
        return key_pem(key), cert_pem(cert) + self.cert_pem

    def sign_node_csr(self, csr_pem: bytes, node_id: str, ttl_s: float) -> x509.Certificate:
        """Sign a node's CSR for ``node_id``. Only the CSR's public key is used: the subject,
        the role and the SAN come from here.

        Raises:
            ValueError: malformed CSR, bad signature, a key that is not EC P-256, or a node id
                that cannot be put in a certificate.
        """
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec

        check_node_id(node_id)
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise ValueError(f"csr: not a PEM certificate request ({exc})") from None
        if not csr.is_signature_valid:
            raise ValueError("csr: the signature does not match its key")
        key = csr.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise ValueError("csr: the key must be EC P-256")
        return self._issue(
            key, _name(ROLE_NODE, node_id), [x509.DNSName(node_target_name(node_id))], ttl_s
        )


def csr_key_sha256(csr_pem: bytes) -> str:
    """sha256 (hex) of a CSR's public key (DER SubjectPublicKeyInfo); "" when the CSR cannot
    be parsed (signing it refuses it then, with the reason). Parses only: no signature is
    checked here."""
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        key = x509.load_pem_x509_csr(csr_pem).public_key()
    except ValueError:
        return ""
    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(der).hexdigest()


def ca_paths(pki_dir: Path) -> tuple[Path, Path]:
    return pki_dir / CA_KEY, pki_dir / CA_CERT


def init_ca(pki_dir: Path, *, exist_ok: bool = False) -> FleetCA:
    """Create the fleet CA in ``pki_dir`` (``ca.key`` 0600, ``ca.crt`` 0644; dir 0700).

    Raises:
        PkiError: a CA exists already (unless ``exist_ok``, which returns it).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key_path, crt_path = ca_paths(pki_dir)
    if key_path.exists() or crt_path.exists():
        if exist_ok:
            return load_ca(pki_dir)
        raise PkiError(f"a fleet CA exists already in {pki_dir}; not replacing it")
    pki_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(pki_dir, 0o700)
    key = new_key()
    now = _now()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.COMMON_NAME, f"gpufleet fleet CA {now:%Y-%m-%d}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(now + dt.timedelta(seconds=CA_TTL_S))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    write_private(key_path, key_pem(key))
    crt_path.write_bytes(cert_pem(cert))
    return FleetCA(key, cert)


def load_ca(pki_dir: Path) -> FleetCA:
    """Raises PkiError when the CA is missing or unreadable."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key_path, crt_path = ca_paths(pki_dir)
    if not key_path.exists() or not crt_path.exists():
        raise PkiError(
            f"no fleet CA in {pki_dir}: run `gpufleet admin ca init` (or pass --insecure for "
            "plaintext gRPC)"
        )
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(crt_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise PkiError(f"fleet CA in {pki_dir} unreadable: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{key_path}: not an EC key")
    return FleetCA(key, cert)


def read_ca_cert(pki_dir: Path) -> bytes:
    """The CA certificate (public). Raises PkiError when missing."""
    path = ca_paths(pki_dir)[1]
    try:
        return path.read_bytes()
    except OSError:
        raise PkiError(
            f"no fleet CA certificate at {path}: copy ca.crt (the public certificate only; "
            "never ca.key) from a controller host's pki dir into it, or set "
            "GPUFLEET_PKI_DIR; `gpufleet admin ca show` on both hosts compares them. Run "
            "`gpufleet admin ca init` only to create a new fleet's first CA"
        ) from None


def local_ca_fingerprint(pki_dir: Path) -> tuple[str | None, str]:
    """(sha256 of ``{pki_dir}/ca.crt``, or None when there is no such file; its path).

    Raises:
        PkiError: the file exists but holds no readable certificate.
    """
    path = ca_paths(pki_dir)[1]
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        return None, str(path)
    except OSError as exc:
        raise PkiError(f"{path}: unreadable ({exc})") from None
    try:
        return fingerprint(pem), str(path)
    except ValueError as exc:
        raise PkiError(f"{path}: not a certificate ({exc})") from None
