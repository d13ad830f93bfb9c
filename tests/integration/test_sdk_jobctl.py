"""The SDK's job-control, accounting and artifact methods (sync and async) against a real
``gpufleet server`` process on SQLite.

Before the server starts, a short history is written through the service layer (reserve,
confirm and complete attempts, backdated so they hold GPU-hours; a manifest with one
artifact): one job that succeeded and one that failed. The test leader's lease is held for
the whole module, so the server's scheduler places nothing: every job submitted here stays
PENDING, which is what hold, release, update and bulk cancel need.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from sqlalchemy import select

from gpufleet.client import (
    ArtifactMismatch,
    AsyncClient,
    Client,
    Conflict,
    Forbidden,
    NotFound,
    TransportError,
    ValidationError,
)
from gpufleet.objectstore import ObjectStore, attempt_prefix
from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.services.jobs import submit_job
from gpufleet.settings import Settings
from gpufleet.store.tables import ApiTokenRow, UsageRecordRow
from tests.factories import become_leader, create_node
from tests.integration.server_proc import ServerProcess
from tests.integration.test_usage_accounting import Sim, _spec


@dataclass
class Fleet:
    url: str
    token: str
    admin: str
    other: str
    succeeded: str
    failed: str
    store: ObjectStore
    gpu_seconds: dict[str, float]
    """From the usage records, by team."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("sdk-jobctl")
    settings = Settings(data_dir=tmp)
    db = open_database(settings)
    store = ObjectStore(settings.resolved_object_store_url())
    token = db.run_write(
        lambda s: auth.create_token(s, "vision", name="alice", create_team_if_missing=True)
    )
    other = db.run_write(lambda s: auth.create_token(s, "nlp", create_team_if_missing=True))
    admin = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    alice = db.run_write(
        lambda s: s.scalars(select(ApiTokenRow.id).where(ApiTokenRow.name == "alice")).one()
    )
    create_node(db, "n1", gpus=8, gpu_type="H100")
    # held for the whole module: the server's controller never leads, so nothing is placed
    sim = Sim(db, store, become_leader(db, lease_s=3600), seed=7)

    def job(gpus: int) -> str:
        return submit_job(
            db,
            team_id="vision",
            idempotency_key=str(uuid.uuid4()),
            spec=_spec(gpus, 0, "H100"),
            submitted_by=alice,
        ).job_id

    succeeded, failed = job(2), job(1)
    sim.exit(succeeded, "n1", sim.start(succeeded, 2, "n1"), 0)
    sim.exit(failed, "n1", sim.start(failed, 1, "n1"), 3)
    with db.read() as s:
        recs = s.scalars(select(UsageRecordRow)).all()
        secs = {"vision": sum(r.gpu_seconds for r in recs)}
    db.dispose()
    proc = ServerProcess(tmp, {"GPUFLEET_REDIS_URL": ""}).start()
    try:
        yield Fleet(proc.url, token, admin, other, succeeded, failed, store, secs)
    finally:
        proc.stop()


@pytest.fixture
def client(fleet: Fleet) -> Iterator[Client]:
    with Client(fleet.url, fleet.token) as c:
        yield c


def test_array_submit_show_list_and_cancel_by_array(client: Client) -> None:
    name = f"arr-{uuid.uuid4().hex[:6]}"
    sub = client.submit(["true"], name=name, array="0-3%2")
    assert sub.array_id and len(sub.job_ids) == 4 and sub.job_id == sub.job_ids[0]
    info = client.array(sub)
    assert [t.array_index for t in info.tasks] == [0, 1, 2, 3]
    assert [t.job_id for t in info.tasks] == list(sub.job_ids)
    assert info.counts == {"PENDING": 4} and info.max_running == 2 and not info.done
    listed = list(client.list(array_id=sub.array_id, page_size=3))  # across 2 pages
    assert sorted(j.job_id for j in listed) == sorted(sub.job_ids)
    assert {j.array_id for j in listed} == {sub.array_id}
    assert sorted(j.array_index or 0 for j in listed) == [0, 1, 2, 3]
    assert len(list(client.list(name=name))) == 4
    # bulk cancel: a dry run lists and changes nothing; then the array's tasks, then none
    preview = client.cancel_many(array_id=sub.array_id, dry_run=True)
    assert preview.dry_run and sorted(preview.job_ids) == sorted(sub.job_ids)
    assert client.array(sub.array_id or "").counts == {"PENDING": 4}
    done = client.cancel_many(array_id=sub.array_id)
    assert sorted(done.job_ids) == sorted(sub.job_ids) and not done.dry_run
    assert client.array(sub).done and client.array(sub).counts == {"CANCELLED": 4}
    again = client.cancel_many(list(sub.job_ids[:2]))
    assert again.cancelled == () and len(again.skipped) == 2
    with pytest.raises(ValueError, match="name jobs to cancel"):
        client.cancel_many()  # no job and no filter: refused before any request
    with pytest.raises(NotFound):
        client.array("a-nosuchthing")


def test_dependencies_as_jobs_and_as_slurm_text(client: Client) -> None:
    first = client.submit("true", array="0-1")
    after = client.submit("true", depends_on=first.job_ids)
    job = client.get(after)
    assert job.depends_on == tuple({"type": "afterok", "job_id": j} for j in first.job_ids)
    text = client.submit("true", depends_on=f"afterany:{first.job_id}")
    assert client.get(text).depends_on == ({"type": "afterany", "job_id": first.job_id},)
    mixed = client.submit(
        "true", depends_on=[{"type": "afternotok", "job_id": first.job_ids[1]}, after]
    )
    assert client.get(mixed).depends_on == (
        {"type": "afternotok", "job_id": first.job_ids[1]},
        {"type": "afterok", "job_id": after.job_id},
    )
    with pytest.raises((ValidationError, NotFound)) as info:
        client.submit("true", depends_on=["j-does-not-exist"])
    assert info.value.status in (404, 422)
    client.cancel_many([first.job_ids[0], first.job_ids[1], after, text, mixed])


def test_hold_release_update_requeue(client: Client, fleet: Fleet) -> None:
    sub = client.submit("true", name="to-hold")
    held = client.hold(sub)
    assert held.held and held.pending_reason is not None
    assert held.pending_reason.code == "held"
    assert client.hold(sub).held  # holding a held job changes nothing
    released = client.release(sub)
    assert not released.held and released.status == "PENDING"
    changed = client.update(sub, priority="high", name="renamed", max_runtime_s=90)
    assert (changed.priority, changed.name, changed.max_runtime_s) == ("HIGH", "renamed", 90)
    assert client.get(sub).name == "renamed"
    with pytest.raises(ValueError, match="nothing to change"):
        client.update(sub)
    with pytest.raises(ValidationError) as info:
        client.update(sub, priority="urgent")
    assert info.value.field is not None and "priority" in info.value.field
    with pytest.raises(Conflict):
        client.requeue(sub)  # PENDING: nothing to requeue
    client.cancel(sub)
    with pytest.raises(Conflict):
        client.hold(sub)  # not PENDING any more
    with pytest.raises(Conflict):
        client.update(sub, priority="LOW")  # finished: only the name may change
    again = client.requeue(sub)  # CANCELLED: PENDING again at once
    assert again.status == "PENDING"
    client.cancel(sub)
    failed = client.requeue(fleet.failed)
    assert failed.status == "PENDING" and len(failed.attempts) == 1
    client.cancel(fleet.failed)
    with pytest.raises(Conflict):
        client.requeue(fleet.succeeded)
    with pytest.raises(NotFound):
        client.hold("j-nosuchjob")


def test_usage_rows_csv_and_scoping(client: Client, fleet: Fleet) -> None:
    report = client.usage()
    assert report.by == "team" and report.team == "vision"
    assert [ln.key for ln in report.items] == ["vision"]
    line = report.items[0]
    assert abs(line.gpu_seconds - fleet.gpu_seconds["vision"]) < 0.01
    assert line.attempts == 2 and line.jobs == 2
    assert abs(report.total_gpu_hours - fleet.gpu_seconds["vision"] / 3600) < 1e-5
    assert report.hours_by_key() == {"vision": line.gpu_hours}
    by_user = client.usage(by="user")
    assert [(ln.key, ln.team) for ln in by_user.items] == [("alice", "vision")]
    by_job = client.usage(by="job")
    assert {ln.key for ln in by_job.items} == {fleet.succeeded, fleet.failed}
    assert client.usage(since="2999-01-01", until="2999-01-02").items == ()
    text = client.usage_csv(by="gpu_type")
    assert text.splitlines()[0] == "gpu_type,team,gpu_hours,gpu_seconds,attempts,jobs"
    assert text.splitlines()[1].startswith("H100,")
    with pytest.raises(Forbidden):
        client.usage(team="nlp")
    with pytest.raises(ValidationError) as info:
        client.usage(since="last tuesday")
    assert info.value.field == "since"
    with Client(fleet.url, fleet.admin) as admin:
        assert admin.usage(team="nlp").items == ()
    with Client(fleet.url, fleet.other) as nlp:
        assert nlp.usage().items == () and nlp.usage().total_gpu_seconds == 0


def test_artifacts_list_and_verified_download(
    client: Client, fleet: Fleet, tmp_path: Path
) -> None:
    listing = client.artifacts(fleet.succeeded)
    assert listing.job_id == fleet.succeeded and listing.run_id
    (art,) = listing.items
    assert (art.path, art.size) == ("model.bin", len(b"weights"))
    dest = client.download_artifact(fleet.succeeded, art, tmp_path / "sub" / "model.bin")
    assert dest.read_bytes() == b"weights" and not (tmp_path / "sub" / "model.bin.part").exists()
    # a listing that disagrees with the bytes: refused, nothing left behind
    wrong = tmp_path / "wrong.bin"
    with pytest.raises(ArtifactMismatch) as info:
        client.download_artifact(fleet.succeeded, replace(art, sha256="0" * 64), wrong)
    assert info.value.path == "model.bin"
    assert not wrong.exists() and not (tmp_path / "wrong.bin.part").exists()
    with pytest.raises(NotFound):
        client.download_artifact(fleet.succeeded, replace(art, path="other.bin"), wrong)
    assert not wrong.exists() and not (tmp_path / "wrong.bin.part").exists()
    with pytest.raises(Conflict):
        client.artifacts(fleet.failed)  # no accepted manifest of a success
    # the stored object changed under the manifest: the server cuts the answer short
    key = f"{attempt_prefix(fleet.succeeded, listing.run_id)}/artifacts/model.bin"
    assert fleet.store.get_bytes(key) == b"weights"
    fleet.store.put_bytes(key, b"WEIGHTS")
    try:
        with pytest.raises((ArtifactMismatch, TransportError)):
            client.download_artifact(fleet.succeeded, art, wrong)
        assert not wrong.exists() and not (tmp_path / "wrong.bin.part").exists()
    finally:
        fleet.store.put_bytes(key, b"weights")


def test_artifacts_by_id_prefix(client: Client, fleet: Fleet, tmp_path: Path) -> None:
    """Artifacts take any job reference, like every other job route (a short prefix too)."""
    for ref in (fleet.succeeded[:-1], fleet.succeeded.removeprefix("j-")[:-2]):
        listing = client.artifacts(ref)
        assert listing.job_id == fleet.succeeded
        (art,) = listing.items
        dest = client.download_artifact(ref, art, tmp_path / "model.bin")
        assert dest.read_bytes() == b"weights"
    with pytest.raises(NotFound):
        client.artifacts("no-such-job-name")


def test_async_client_mirrors_the_sync_methods(fleet: Fleet, tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncClient(fleet.url, fleet.token) as c:
            sub = await c.submit("true", array="0-2", name="async-arr")
            assert (await c.array(sub)).counts == {"PENDING": 3}
            assert len([j async for j in c.list(array_id=sub.array_id)]) == 3
            dep = await c.submit("true", depends_on=[sub])
            assert (await c.get(dep)).depends_on == ({"type": "afterok", "job_id": sub.job_id},)
            assert (await c.hold(dep)).held
            assert not (await c.release(dep)).held
            assert (await c.update(dep, name="async-dep")).name == "async-dep"
            with pytest.raises(Conflict):
                await c.requeue(dep)
            out = await c.cancel_many([dep], array_id=None, dry_run=True)
            assert out.job_ids == (dep.job_id,)
            out = await c.cancel_many(array_id=sub.array_id)
            assert len(out.job_ids) == 3
            await c.cancel(dep)
            report = await c.usage()
            assert abs(report.total_gpu_seconds - fleet.gpu_seconds["vision"]) < 0.01
            assert (await c.usage_csv()).startswith("team,gpu_hours,")
            (art,) = (await c.artifacts(fleet.succeeded)).items
            dest = await c.download_artifact(fleet.succeeded, art, tmp_path / "a.bin")
            assert dest.read_bytes() == b"weights"
            with pytest.raises(ArtifactMismatch):
                await c.download_artifact(
                    fleet.succeeded, replace(art, size=1), tmp_path / "b.bin"
                )
            assert not (tmp_path / "b.bin").exists()

    asyncio.run(main())
