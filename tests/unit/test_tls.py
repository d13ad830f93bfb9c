"""The fleet PKI (``rpc/tls.py``): what a signed certificate may say, and what the agent
accepts as its own credentials. Pure cryptography, no network."""

from __future__ import annotations

import stat
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from gpufleet.rpc import tls


@pytest.fixture
def ca(tmp_path: Path) -> tls.FleetCA:
    return tls.init_ca(tmp_path / "pki")


def _node_creds(ca: tls.FleetCA, node_id: str, ttl_s: float = 3600) -> tls.NodeCredentials:
    key = tls.new_key()
    cert = ca.sign_node_csr(tls.make_csr(key, node_id), node_id, ttl_s)
    return tls.NodeCredentials(tls.key_pem(key), tls.cert_pem(cert) + ca.cert_pem, ca.cert_pem)


def test_ca_init_writes_the_key_0600_and_never_replaces_a_ca(tmp_path: Path) -> None:
    ca = tls.init_ca(tmp_path / "pki")
    key_path, crt_path = tls.ca_paths(tmp_path / "pki")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "pki").stat().st_mode) == 0o700
    with pytest.raises(tls.PkiError, match="exists already"):
        tls.init_ca(tmp_path / "pki")
    assert tls.init_ca(tmp_path / "pki", exist_ok=True).fingerprint == ca.fingerprint
    assert tls.load_ca(tmp_path / "pki").fingerprint == tls.fingerprint(crt_path.read_bytes())


def test_missing_ca_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(tls.PkiError, match="gpufleet admin ca init"):
        tls.load_ca(tmp_path / "nothing")


def test_node_certificate_takes_only_the_key_from_the_csr(ca: tls.FleetCA) -> None:
    """A CSR asking for the controller role and name gets a plain node certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    greedy = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gpufleet"),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "controller"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet-controller"),
                ]
            )
        )
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(tls.CONTROLLER_NAME)]), critical=False
        )
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    cert = ca.sign_node_csr(greedy, "n1", 600)
    ident = tls.identity_of(cert)
    assert ident is not None
    assert (ident.role, ident.name) == ("node", "n1")
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["n1.node.gpufleet"]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


@pytest.mark.parametrize(
    "node_id", ["", "-lead", "a" * 64, "a/b", "x y", "n\x00", "é", "controller.gpufleet/"]
)
def test_node_ids_that_cannot_be_certified_are_refused(ca: tls.FleetCA, node_id: str) -> None:
    with pytest.raises(ValueError, match="node id"):
        ca.sign_node_csr(tls.make_csr(tls.new_key(), "x"), node_id, 600)


def test_csr_must_be_valid_and_ec_p256(ca: tls.FleetCA) -> None:
    with pytest.raises(ValueError, match="csr"):
        ca.sign_node_csr(b"not a csr", "n1", 600)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n1")]))
        .sign(rsa_key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    with pytest.raises(ValueError, match="EC P-256"):
        ca.sign_node_csr(rsa_csr, "n1", 600)


def test_controller_certificate_names_and_role(ca: tls.FleetCA) -> None:
    _key, chain = ca.issue_controller(["10.1.2.3", "ctl.example.com"])
    cert = x509.load_pem_x509_certificate(chain)
    ident = tls.identity_of(cert)
    assert ident is not None and ident.role == "controller"
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {tls.CONTROLLER_NAME, "localhost", "ctl.example.com"} <= set(
        sans.get_values_for_type(x509.DNSName)
    )
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} >= {
        "127.0.0.1",
        "::1",
        "10.1.2.3",
    }
    cert.verify_directly_issued_by(ca.cert)


def test_saved_credentials_round_trip_with_mode_0600(ca: tls.FleetCA, tmp_path: Path) -> None:
    creds = _node_creds(ca, "n1")
    creds.save(tmp_path / "tls")
    for name in ("node.key", "node.crt", "ca.crt"):
        assert stat.S_IMODE((tmp_path / "tls" / name).stat().st_mode) == 0o600
    loaded = tls.NodeCredentials.load(tmp_path / "tls")
    assert loaded == creds
    assert loaded.problem("n1") is None
    assert tls.NodeCredentials.load(tmp_path / "none") is None


def test_credentials_for_another_node_or_ca_or_key_are_unusable(
    ca: tls.FleetCA, tmp_path: Path
) -> None:
    creds = _node_creds(ca, "n1")
    assert "not a node certificate for 'n2'" in (creds.problem("n2") or "")
    other_ca = tls.init_ca(tmp_path / "other")
    foreign = tls.NodeCredentials(creds.key_pem, creds.chain_pem, other_ca.cert_pem)
    assert "not signed by the saved CA" in (foreign.problem("n1") or "")
    wrong_key = tls.NodeCredentials(tls.key_pem(tls.new_key()), creds.chain_pem, creds.ca_pem)
    assert "does not match" in (wrong_key.problem("n1") or "")


def test_renewal_is_due_at_two_thirds_of_the_lifetime(ca: tls.FleetCA) -> None:
    creds = _node_creds(ca, "n1", ttl_s=3000)
    issued = creds.not_before + timedelta(seconds=tls.CLOCK_SKEW_S)
    assert (creds.not_after - issued).total_seconds() == pytest.approx(3000, abs=2)
    assert (creds.renew_at() - issued).total_seconds() == pytest.approx(2000, abs=2)


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("", "expected"),
        ("gfj1.abc.secret", "64 hex"),
        ("gfj2." + "a" * 64 + ".s", "expected"),
        ("gfj1." + "a" * 64 + ".", "empty secret"),
        ("gfj1." + "A" * 64 + ".s", "64 hex"),
    ],
)
def test_malformed_join_tokens_are_refused(token: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        tls.parse_join_token(token)


def test_join_token_round_trip() -> None:
    fp = "0123456789abcdef" * 4
    assert tls.parse_join_token(tls.format_join_token(fp, "s3cr-t_")) == (fp, "s3cr-t_")


def test_the_agents_certificate_child_agrees_with_the_in_process_checks(
    ca: tls.FleetCA,
) -> None:
    """The agent makes keys and CSRs and checks certificates in a child process (no
    ``cryptography`` in its own memory): the child's answers are the in-process ones."""
    from gpufleet.agent import identity

    key_pem, csr_pem = identity.new_csr("n-child", child=True)
    cert = ca.sign_node_csr(csr_pem, "n-child", 3600)
    creds = tls.NodeCredentials(key_pem, tls.cert_pem(cert) + ca.cert_pem, ca.cert_pem)
    problem, facts = identity.inspect(creds, "n-child", child=True)
    assert problem is None and facts == creds.facts()
    assert facts.serial == tls.serial_hex(cert) and facts.renew_at() == creds.renew_at()
    assert identity.inspect(creds, "n-other", child=True)[0] == creds.problem("n-other")
    broken = tls.NodeCredentials(key_pem, b"garbage", ca.cert_pem)
    problem, facts = identity.inspect(broken, "n-child", child=True)
    assert problem is not None and problem.startswith("unreadable") and facts is None


def test_fingerprint_of_pem_bytes_needs_no_certificate_parser(ca: tls.FleetCA) -> None:
    assert tls.fingerprint(ca.cert_pem) == tls.fingerprint(ca.cert) == ca.fingerprint
    assert tls.fingerprint(b"# a chain\n" + ca.cert_pem + ca.cert_pem) == ca.fingerprint
    with pytest.raises(ValueError, match="no PEM certificate"):
        tls.fingerprint(b"not a certificate")


class _Ctx:
    def __init__(self, subject: bytes | None) -> None:
        self._auth = {} if subject is None else {"x509_subject": [subject]}

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth


@pytest.mark.parametrize(
    ("subject", "role"),
    [
        (b"CN=gpufleet-controller,OU=controller,O=gpufleet", "controller"),
        (b"CN=n1,OU=node,O=gpufleet", "node"),
        (None, None),  # plaintext, or no client certificate
        (b"CN=n1,OU=controller,O=other", None),  # another org
        (b"OU=controller,O=gpufleet", None),  # no CN
        (b"CN=n1\\,OU=controller,OU=node,O=gpufleet", None),  # an escaped comma
        (b"CN=n1+OU=controller,OU=node,O=gpufleet", None),  # a multi-valued RDN
        (b"CN=n1,OU=node,OU=controller,O=gpufleet", None),  # a repeated attribute
    ],
)
def test_peer_role_reads_the_verified_subject_unambiguously_or_not_at_all(
    subject: bytes | None, role: str | None
) -> None:
    assert tls.peer_role(_Ctx(subject)) == role  # type: ignore[arg-type]
