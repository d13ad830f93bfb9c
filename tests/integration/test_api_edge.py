"""The API's HTTP edge against a real ``gpufleet server`` process: huge or too many headers
with no token are refused at once while another client is served, silent, slow (slowloris)
and idle keep-alive connections are closed after their timeouts, connections per client
address are capped, a team's reads are rate limited (429 naming ``read_rate_per_s``), and
the SDK and the CLI talk https to a server with a self-signed certificate."""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from tests.integration.server_proc import ServerProcess, rss_kib

pytestmark = pytest.mark.slow

MB = 1024 * 1024
HEAD_TIMEOUT_S = 2.0
EDGE_ENV = {
    "GPUFLEET_SERVER_HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S),
    "GPUFLEET_SERVER_KEEPALIVE_TIMEOUT_S": "1",
    "GPUFLEET_SERVER_MAX_CONNECTIONS_PER_IP": "300",
    "GPUFLEET_REDIS_URL": "",
}


def admin_token(data_dir: Path) -> str:
    db = open_database(Settings(data_dir=data_dir))
    token = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    db.dispose()
    return token


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("edge"), EDGE_ENV).start()
    try:
        yield proc
    finally:
        proc.stop()


def closed_or_answered(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Wait for the server's answer or close on ``sock``: (what it sent, seconds waited)."""
    t0 = time.monotonic()
    sock.settimeout(timeout_s)
    got = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got, time.monotonic() - t0


def stream_huge_header(port: int, total: int, out: list[tuple[bytes, float]]) -> None:
    """Send a request whose one header is ``total`` bytes, as fast as the server takes it;
    record (answer, seconds from the first byte to the answer or close)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        chunk = b"a" * MB
        try:
            for _ in range(total // MB):
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        got, _ = closed_or_answered(sock, 10)
    out.append((got, time.monotonic() - t0))


def test_huge_headers_are_refused_at_once_and_others_are_served(server: ServerProcess) -> None:
    before = rss_kib(server.pid)
    results: list[tuple[bytes, float]] = []
    attackers = [
        threading.Thread(target=stream_huge_header, args=(server.port, 100 * MB, results))
        for _ in range(4)
    ]
    for t in attackers:
        t.start()
    served: list[float] = []
    for _ in range(5):  # another client, no waiting behind the attackers
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        served.append(time.monotonic() - t0)
    for t in attackers:
        t.join(60)
    assert len(results) == 4
    for answer, seconds in results:
        assert answer.startswith(b"HTTP/1.1 431") or answer == b"", answer[:100]
        assert seconds < 3.0, seconds  # refused after the first 64 KiB, not after 100 MB
    assert max(served) < 1.0, served
    assert rss_kib(server.pid) - before < 64 * 1024  # KiB: nothing near 4 x 100 MB kept


def test_a_huge_pipelined_head_is_refused_too(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nX-Pad: ")
        try:
            for _ in range(20):
                sock.sendall(b"a" * MB)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        got, _ = closed_or_answered(sock, 10)
    # refused at once (the first request's answer may be lost with the connection)
    assert b"HTTP/1.1 431" in got, got[:300]
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def test_too_many_header_fields_get_431(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(500))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        got, _ = closed_or_answered(sock, 5)
    assert got.startswith(b"HTTP/1.1 431") and b"header fields" in got


def test_silent_slow_and_idle_connections_are_closed(server: ServerProcess) -> None:
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    for s in slow:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    idle = socket.create_connection(("127.0.0.1", server.port))
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    first, _ = closed_or_answered(idle, 0.5)  # the answer; the connection stays open
    assert first.startswith(b"HTTP/1.1 200")
    for s in slow:  # a byte now and then does not keep a head alive (slowloris)
        s.sendall(b"X-A: b\r\n")
    time.sleep(HEAD_TIMEOUT_S + 1.0)
    for s in slow:
        s.sendall(b"X-A: b\r\n")
    try:
        waits = []
        for s in silent + slow + [idle]:
            got, waited = closed_or_answered(s, 5)
            waits.append(waited)
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:80]
        assert max(waits) < 2.0, max(waits)  # closed by the server, not by our timeout
    finally:
        for s in silent + slow + [idle]:
            s.close()
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def test_connections_per_address_are_capped(tmp_path: Path) -> None:
    proc = ServerProcess(
        tmp_path, {**EDGE_ENV, "GPUFLEET_SERVER_MAX_CONNECTIONS_PER_IP": "20"}
    ).start()
    held = [socket.create_connection(("127.0.0.1", proc.port)) for _ in range(20)]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", proc.port))
        got, waited = closed_or_answered(extra, 5)
        extra.close()
        assert got.startswith(b"HTTP/1.1 503") and waited < 1.0, (got[:80], waited)
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(f"{proc.url}/healthz", timeout=5).status_code == 200
    proc.stop()


def test_the_cookie_is_secure_behind_a_trusted_tls_proxy_only(
    server: ServerProcess, tmp_path: Path
) -> None:
    forwarded = {"X-Forwarded-Proto": "https"}
    # the module's server trusts 127.0.0.1 (the default --forwarded-allow-ips)
    r = httpx.get(f"{server.url}/ui/login", headers=forwarded, timeout=10)
    assert "secure" in r.headers["set-cookie"].lower()
    assert r.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    directives = dict(
        d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";")
    )
    assert directives["script-src"] == "'self'"  # no inline script, no eval
    other = ServerProcess(
        tmp_path, {**EDGE_ENV, "GPUFLEET_SERVER_FORWARDED_ALLOW_IPS": "192.0.2.7"}
    ).start()
    try:
        r = httpx.get(f"{other.url}/ui/login", headers=forwarded, timeout=10)
        assert "secure" not in r.headers["set-cookie"].lower()  # an untrusted client's claim
    finally:
        other.stop()


def test_a_teams_reads_are_rate_limited(tmp_path: Path) -> None:
    token = admin_token(tmp_path)
    proc = ServerProcess(
        tmp_path,
        {**EDGE_ENV, "GPUFLEET_TEAM_READ_RATE_PER_S": "2", "GPUFLEET_TEAM_READ_BURST": "50"},
    ).start()
    try:
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {token}"}) as c:
            assert c.get("/v1/jobs", params={"limit": 500}).status_code == 200  # 25 tokens
            assert c.get("/v1/jobs", params={"limit": 500}).status_code == 200
            r = c.get("/v1/jobs", params={"limit": 500})
            assert r.status_code == 429
            assert r.json()["field"] == "read_rate_per_s"
            assert int(r.headers["Retry-After"]) >= 1
            assert c.post("/v1/admin/teams", json={"team": "x"}).status_code != 429  # writes
    finally:
        proc.stop()


def self_signed(dir_: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost and its key, as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufleet-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dir_ / "api.crt", dir_ / "api.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def test_sdk_and_cli_talk_https_with_a_ca_bundle(tmp_path: Path) -> None:
    from gpufleet.client import Client
    from gpufleet.client.errors import TransportError

    token = admin_token(tmp_path)
    cert, key = self_signed(tmp_path)
    proc = ServerProcess(
        tmp_path,
        {
            **EDGE_ENV,
            "GPUFLEET_SERVER_TLS_CERT": str(cert),
            "GPUFLEET_SERVER_TLS_KEY": str(key),
        },
    )
    proc.url = f"https://127.0.0.1:{proc.port}"
    gpufleet = Path(sys.executable).parent / "gpufleet"
    proc.proc = subprocess.Popen(
        [str(gpufleet), "server"],
        env=proc.env,
        stdout=open(proc.log_path, "ab"),  # noqa: SIM115 - owned by the child
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{proc.url}/healthz", verify=trust, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, proc.log()[-2000:]
                assert proc.proc.poll() is None, proc.log()[-2000:]
                time.sleep(0.2)
        with pytest.raises(httpx.ConnectError):  # not trusted without the bundle
            httpx.get(f"{proc.url}/healthz", timeout=5)
        with pytest.raises(TransportError):
            list(Client(url=proc.url, token=token).list())
        os.environ["GPUFLEET_CA_BUNDLE"] = str(cert)
        try:
            with Client(url=proc.url, token=token) as client:
                assert list(client.list()) == []
        finally:
            del os.environ["GPUFLEET_CA_BUNDLE"]
        env = {
            **os.environ,
            "GPUFLEET_URL": proc.url,
            "GPUFLEET_TOKEN": token,
            "GPUFLEET_CA_BUNDLE": str(cert),
            "GPUFLEET_CONFIG": str(tmp_path / "none.yaml"),
        }
        done = subprocess.run(
            [str(gpufleet), "list", "-o", "json"],
            env=env,
            text=True,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stderr
        env.pop("GPUFLEET_CA_BUNDLE")
        done = subprocess.run(
            [str(gpufleet), "list"], env=env, text=True, capture_output=True, timeout=60
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr
    finally:
        proc.stop()
