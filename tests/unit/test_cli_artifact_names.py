"""``gpufleet artifacts J --download DIR`` against a real HTTP server (the CLI's stdlib
transport, not a mock) whose answers carry raw non-ASCII header bytes, as an older server
sent for a Latin-1 file name: every file is still fetched, named by its manifest path, and
no header ever ends the command in a traceback."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.unit.test_cli_client import cli

FILES = {"sub/ü.txt": b"umlaut", "日本.txt": b"nihon", "z.txt": b"last"}
HEADERS = {  # what each download answers in Content-Disposition, as raw bytes
    "sub/ü.txt": 'attachment; filename="ü.txt"'.encode("latin-1"),
    "日本.txt": b'attachment; filename="\xe6\x97\xa5\xe6\x9c\xac.txt"',  # UTF-8, unannounced
    "z.txt": b'attachment; filename="other-name.bin"',  # never the name used
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        prefix = "/v1/jobs/j-1/artifacts"
        path = unquote(self.path)
        if path == prefix:
            items = [
                {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                for p, b in FILES.items()
            ]
            self._answer(json.dumps({"job_id": "j-1", "run_id": "r-1", "items": items}).encode())
            return
        name = path.removeprefix(prefix + "/")
        if name not in FILES:
            self.send_error(404)
            return
        body = FILES[name]
        self.wfile.write(  # written raw: send_header would encode the value as Latin-1
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + f"X-Gpufleet-Sha256: {hashlib.sha256(body).hexdigest()}\r\n".encode()
            + b"Content-Disposition: "
            + HEADERS[name]
            + b"\r\n\r\n"
            + body
        )

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    monkeypatch.setenv("GPUFLEET_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("GPUFLEET_TOKEN", "t0ken")
    monkeypatch.setenv("GPUFLEET_URL", url)
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    try:
        yield url
    finally:
        srv.shutdown()
        srv.server_close()


def test_raw_header_bytes_never_stop_a_download(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli("artifacts", "j-1", "--download", str(out))  # asserts: no traceback
    assert result.exit_code == 0, result.output
    for path, body in FILES.items():
        assert (out / path).read_bytes() == body  # the manifest's path, not the header's
    assert not (out / "other-name.bin").exists()
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["z.txt", "ü.txt", "日本.txt"]
