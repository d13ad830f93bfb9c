"""Fleet PKI and gRPC credentials: certificates in, credentials out.

One module the controller, the agent and the CLI share (``cryptography`` makes the keys and
certificates, ``grpcio`` does TLS). ``cryptography`` (~12 MB of a process's memory) is imported
by the functions that use it, never by importing this module: the node agent's long-running
process does its certificate work in a short-lived child (``gpufleet.agent.pkichild``) and
uses only what here needs no ``cryptography`` (credentials for gRPC, :class:`RoleInterceptor`,
:func:`fingerprint` of PEM bytes, :func:`fetch_ca_by_fingerprint`, join tokens). The shapes:

* **Fleet CA** (``{pki_dir}/ca.key`` mode 0600, ``ca.crt``): a self-signed EC P-256 CA. Whoever
  holds ``ca.key`` can mint any identity, so it lives only where controllers run.
* **Controller certificate**: subject ``O=gpufleet, OU=controller``, SAN ``controller.gpufleet``
  (the name agents verify, whatever address they dial), loopback addresses and the configured
  host names; EKU server + client auth (it serves agents and calls them). Issued by the
  controller from the CA at every start.
* **Node certificate**: subject ``O=gpufleet, OU=node, CN=<node id>``, SAN
  ``<node id>.node.gpufleet`` (the name the controller verifies when it calls that node's
  agent); EKU server + client auth. The key is made on the node; the controller signs its CSR
  after a join token or, for renewal, the node's current certificate.

The role is the subject's OU and is only ever set by the CA, never taken from a CSR.
A node SAN always ends in ``.node.gpufleet``, so no node certificate can carry the
controller's name.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import os
import re
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

ORG = "gpufleet"
ROLE_CONTROLLER = "controller"
ROLE_NODE = "node"
CONTROLLER_NAME = "controller.gpufleet"
NODE_SUFFIX = ".node.gpufleet"
CA_TTL_S = 10 * 365 * 86400
CONTROLLER_CERT_TTL_S = 365 * 86400
CLOCK_SKEW_S = 300
"""Certificates start this long before their issue time (clocks of two hosts differ)."""

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""Node ids that can be put in a certificate (a DNS-name-like string, at most 63 chars)."""

CA_KEY, CA_CERT = "ca.key", "ca.crt"


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


def check_node_id(node_id: str) -> None:
    """Raises ValueError unless ``node_id`` fits a certificate (1-63 of A-Z a-z 0-9 _ . -)."""
    if not NODE_ID.match(node_id):
        raise ValueError(
            f"node id {node_id!r}: use 1-63 of A-Z a-z 0-9 _ . - starting with a letter or digit"
        )


def node_target_name(node_id: str) -> str:
    """The SAN of ``node_id``'s certificate, verified by the controller when it calls it."""
    return f"{node_id}{NODE_SUFFIX}"


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
            f"no fleet CA certificate at {path}: run `gpufleet admin ca init`"
        ) from None


# ---------------------------------------------------------------- CSRs and node credentials


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


# ---------------------------------------------------------------- peers


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


_PARSED: dict[bytes, Identity | None] = {}
_PARSED_LOCK = threading.Lock()


def peer_identity(context: grpc.ServicerContext) -> Identity | None:
    """The identity of the TLS client that made this call, from the certificate gRPC has
    already verified against the fleet CA; None on a plaintext call or without a client cert.
    Parsed certificates are cached (one peer makes many calls)."""
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert")
    if not pems:
        return None
    from cryptography import x509

    pem = pems[0]
    with _PARSED_LOCK:
        if pem in _PARSED:
            return _PARSED[pem]
    try:
        ident = identity_of(x509.load_pem_x509_certificate(pem))
    except ValueError:
        ident = None
    with _PARSED_LOCK:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        _PARSED[pem] = ident
    return ident


def peer_name(context: grpc.ServicerContext) -> str:
    """A short description of the caller for log lines."""
    ident = peer_identity(context)
    who = f"{ident.role} {ident.name!r} serial {ident.serial}" if ident else "no certificate"
    return f"{context.peer()} ({who})"


def peer_subject(context: grpc.ServicerContext) -> dict[str, str] | None:
    """The attributes of the subject of the client certificate gRPC verified for this call,
    as gRPC reports it (``x509_subject``, RFC 2253: ``CN=n1,OU=node,O=gpufleet`` ->
    ``{"CN": "n1", "OU": "node", "O": "gpufleet"}``), read without ``cryptography``.

    None on a plaintext call, without a client certificate, or for a subject that cannot be
    read unambiguously (an escaped character, a multi-valued RDN, a repeated attribute):
    the fleet CA issues none of those (node ids are ``NODE_ID``), so such a peer is refused.
    """
    subjects = context.auth_context().get("x509_subject")
    if not subjects:
        return None
    text = subjects[0].decode("utf-8", "replace")
    if "\\" in text or "+" in text or '"' in text:
        return None
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key in out:
            return None
        out[key] = value
    return out


def peer_role(context: grpc.ServicerContext) -> str | None:
    """The role (``controller`` / ``node``) of this call's verified client certificate, from
    :func:`peer_subject` (no ``cryptography``); None when it names none or another org, on a
    plaintext call, or without a certificate. Agrees with ``peer_identity(context).role``."""
    subject = peer_subject(context)
    if subject is None or subject.get("O") != ORG or not subject.get("CN"):
        return None
    return subject.get("OU") or None


class RoleInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Refuses every call whose client certificate does not carry ``role``
    (PERMISSION_DENIED), except ``exempt`` methods (full names). Logs one line per refusal.
    Every kind of handler (unary or streaming) is guarded. The role is read from gRPC's
    view of the verified certificate (:func:`peer_role`), so a process using it needs no
    ``cryptography``."""

    def __init__(self, role: str, logger: Any, exempt: frozenset[str] = frozenset()) -> None:
        self.role, self.log, self.exempt = role, logger, exempt

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method in self.exempt:
            return handler

        def guard(inner: Any) -> Any:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                if peer_role(context) != self.role:
                    subject = context.auth_context().get("x509_subject")
                    self.log.warning(
                        "refused %s from %s (%s): needs a %s certificate",
                        method.rsplit("/", 1)[-1],
                        context.peer(),
                        subject[0].decode("utf-8", "replace") if subject else "no certificate",
                        self.role,
                    )
                    context.abort(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"this call needs a {self.role} certificate",
                    )
                return inner(request, context)

            return checked

        for kind, make in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            inner = getattr(handler, kind)
            if inner is not None:
                return make(
                    guard(inner),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


# ---------------------------------------------------------------- gRPC credentials


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
    IP ``address`` uses."""
    return grpc.secure_channel(
        address,
        creds,
        options=[
            ("grpc.ssl_target_name_override", server_name),
            ("grpc.default_authority", server_name),
        ],
    )


# ---------------------------------------------------------------- join tokens


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
