"""``GET /v1/jobs/{id}/logs``: streamed in chunks from the object store (a real server process
sends a 200 MiB log with bounded memory), byte ranges (``offset``/``limit``) and the last
lines (``tail``, read backwards in blocks), on both databases."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app, log_key
from gpufleet.objectstore import ObjectStore
from gpufleet.processes import open_database
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store import allocate
from gpufleet.store.db import Database
from tests.factories import become_leader, create_node, submit
from tests.integration.server_proc import ServerProcess, rss_kib


def attempt(db: Database, team: str) -> tuple[str, str]:
    """A job of ``team`` with one (reserved) attempt: (job_id, run_id)."""
    create_node(db, "n1", gpus=8)
    epoch = become_leader(db)
    job = submit(db, team=team).job_id
    got = db.run_write(
        lambda s: allocate.reserve(
            s,
            job_id=job,
            node_id="n1",
            gpu_count=1,
            seen_fencing_epoch=0,
            leader_holder="test-leader",
            leader_epoch=epoch,
            lease_s=60,
        )
    )
    return job, got.run_id


class TestTailStart:
    @pytest.mark.parametrize(
        ("data", "lines", "want"),
        [
            pytest.param(b"a\nb\nc\n", 2, b"b\nc\n", id="final newline"),
            pytest.param(b"a\nb\nc", 2, b"b\nc", id="no final newline"),
            pytest.param(b"a\nb\nc\n", 10, b"a\nb\nc\n", id="fewer lines than asked"),
            pytest.param(b"a\nb\nc\n", 0, b"", id="zero lines"),
            pytest.param(b"", 5, b"", id="empty"),
            pytest.param(b"\n\n\n", 2, b"\n\n", id="blank lines"),
            pytest.param(b"x" * 100 + b"\n" + b"y" * 100, 1, b"y" * 100, id="long last line"),
        ],
    )
    def test_finds_where_the_last_lines_begin(self, tmp_path, data, lines, want) -> None:
        store = ObjectStore(str(tmp_path))
        store.put_bytes("k", data)
        for block in (1, 3, 1 << 16):  # lines that straddle blocks
            start = store.tail_start("k", lines, block_bytes=block)
            assert data[start:] == want

    def test_iter_range_yields_bounded_chunks(self, tmp_path) -> None:
        store = ObjectStore(str(tmp_path))
        data = bytes(range(256)) * 40
        store.put_bytes("k", data)
        chunks = list(store.iter_range("k", 10, 5000, chunk_bytes=1000))
        assert b"".join(chunks) == data[10:5000] and max(map(len, chunks)) == 1000

    @pytest.mark.parametrize("start", [10240, 10**6, 2**62, 2**63, 2**70])
    def test_a_start_past_the_end_reads_nothing(self, tmp_path, start) -> None:
        store = ObjectStore(str(tmp_path))
        store.put_bytes("k", bytes(range(256)) * 40)
        assert list(store.iter_range("k", start)) == []
        assert list(store.iter_range("k", start, start + 10)) == []
        assert store.get_bytes("k", start) == b""


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], ObjectStore]]:
    store = ObjectStore(str(tmp_path / "objects"))
    app = create_app(AppState(Settings(data_dir=tmp_path), db, InProcWaker(), store))
    tokens = {
        t: db.run_write(lambda s, t=t: auth.create_token(s, t, create_team_if_missing=True))
        for t in ("vision", "nlp")
    }
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokens, store


LOG = b"".join(f"line {i}\n".encode() for i in range(5000))


class TestLogsApi:
    def get(self, client, token, job, **params):  # type: ignore[no-untyped-def]
        return client.get(
            f"/v1/jobs/{job}/logs", params=params, headers={"Authorization": f"Bearer {token}"}
        )

    def test_ranges_and_tail(self, api, db) -> None:
        client, tokens, store = api
        job, run = attempt(db, "vision")
        store.put_bytes(log_key(job, run), LOG)
        tok = tokens["vision"]
        assert self.get(client, tok, job).content == LOG
        assert self.get(client, tok, job, offset=7, limit=9).content == LOG[7:16]
        assert self.get(client, tok, job, offset=len(LOG) - 3).content == LOG[-3:]
        assert self.get(client, tok, job, offset=len(LOG) + 100).content == b""
        assert self.get(client, tok, job, tail=2).content == b"line 4998\nline 4999\n"
        assert self.get(client, tok, job, tail=2, run_id=run).content == b"line 4998\nline 4999\n"
        assert self.get(client, tok, job, tail=1, limit=4).content == b"line"
        assert self.get(client, tok, job, tail=10**6).content == LOG
        assert self.get(client, tok, job, tail=0).content == b""
        assert self.get(client, tokens["nlp"], job, tail=2).status_code == 404

    @pytest.mark.parametrize(
        ("params", "field"),
        [
            ({"tail": -1}, "tail"),
            ({"tail": 10**7}, "tail"),
            ({"offset": -5}, "offset"),
            ({"offset": 2**63}, "offset"),
            ({"offset": 2**62 + 1}, "offset"),
            ({"limit": 2**63}, "limit"),
            ({"limit": -1}, "limit"),
            ({"tail": 5, "offset": 3}, "tail"),
            ({"follow": "true", "limit": 3}, "limit"),
        ],
    )
    def test_bad_parameters_are_422_naming_them(self, api, db, params, field) -> None:
        client, tokens, _ = api
        job, _ = attempt(db, "vision")
        r = self.get(client, tokens["vision"], job, **params)
        assert r.status_code == 422 and r.json()["field"].endswith(field), r.text

    def test_a_missing_log_is_empty(self, api, db) -> None:
        client, tokens, _ = api
        job, _ = attempt(db, "vision")
        r = self.get(client, tokens["vision"], job, tail=5)
        assert (r.status_code, r.content) == (200, b"")


@pytest.mark.slow
def test_a_200mb_log_streams_with_bounded_server_memory(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    db = open_database(settings)
    token = db.run_write(lambda s: auth.create_token(s, "vision", create_team_if_missing=True))
    job, run = attempt(db, "vision")
    db.dispose()
    store = ObjectStore(settings.resolved_object_store_url())
    path = Path(store._path(log_key(job, run)))
    path.parent.mkdir(parents=True, exist_ok=True)
    line = b"x" * 99 + b"\n"
    with open(path, "wb") as f:
        for _ in range(200):
            f.write(line * 10_486)  # ~1 MiB of 100-byte lines
    size = path.stat().st_size
    server = ServerProcess(tmp_path).start()
    try:
        before = rss_kib(server.pid)
        peak, stop = [before], threading.Event()

        def sample() -> None:
            while not stop.wait(0.01):
                peak.append(rss_kib(server.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        got = 0
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.stream(
            "GET", f"{server.url}/v1/jobs/{job}/logs", headers=headers, timeout=120
        ) as r:
            for chunk in r.iter_raw():
                got += len(chunk)
        stop.set()
        sampler.join()
        grown_mib = (max(peak) - before) / 1024
        print(f"streamed {got / 2**20:.0f} MiB; server RSS grew {grown_mib:.1f} MiB")
        assert got == size
        assert grown_mib < 30
        tail = httpx.get(
            f"{server.url}/v1/jobs/{job}/logs", params={"tail": 3}, headers=headers, timeout=30
        )
        assert tail.content == line * 3
    finally:
        server.stop()
