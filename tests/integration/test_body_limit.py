"""Body size is enforced on the bytes read, before authentication, against a real server
process: a 300 MB chunked POST with no token is answered 413 and barely moves its memory."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.integration.server_proc import ServerProcess, rss_kib

pytestmark = pytest.mark.slow

MB = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("body")).start()
    try:
        yield proc
    finally:
        proc.stop()


class RssSampler:
    """The largest VmRSS of a process seen while running (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kib, self._stop = pid, rss_kib(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def post_raw(port: int, head: bytes, chunks: Iterator[bytes]) -> tuple[int, bytes, int]:
    """Send ``head`` then ``chunks`` until the server stops taking them; returns
    (status, raw answer, bytes of body sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the server answered and closed (or stopped reading): read its answer
        answer = b""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
                if b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}"):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer, sent


def chunked(total: int, size: int = MB) -> Iterator[bytes]:
    block = b"x" * size
    frame = f"{size:x}\r\n".encode() + block + b"\r\n"
    for _ in range(total // size):
        yield frame
    yield b"0\r\n\r\n"


HEAD = (
    b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Idempotency-Key: k\r\n"
)


def test_a_300mb_chunked_post_without_token_is_refused_in_bounded_memory(server) -> None:
    before = rss_kib(server.pid)
    with RssSampler(server.pid) as rss:
        status, answer, sent = post_raw(
            server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked(300 * MB)
        )
    grown_mib = (rss.peak_kib - before) / 1024
    print(f"answer {status}, body sent {sent / MB:.0f} MiB, RSS grew {grown_mib:.1f} MiB")
    assert status in (413, 401), answer[:500]
    assert grown_mib < 20
    assert sent < 300 * MB  # the server stopped taking the body long before its end


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server) -> None:
    status, answer, _ = post_raw(
        server.port, HEAD + f"Content-Length: {300 * MB}\r\n\r\n".encode(), iter(())
    )
    assert status == 413 and b'"field": "body"' in answer


def test_the_server_keeps_serving_afterwards(server) -> None:
    import httpx

    for _ in range(3):
        post_raw(server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked(10 * MB))
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def test_logs_show_no_traceback(server) -> None:
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("size", [2 * MB + 1, 5 * MB])
def test_chunked_just_over_the_limit_is_413(server, size: int) -> None:
    status, _, _ = post_raw(
        server.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked(size, size)
    )
    assert status == 413
