"""``gpufleet demo``: the platform on the embedded defaults, running the example training
workload for two teams to SUCCEEDED, as a user would see it (over the REST API)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import sys
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from gpufleet.domain.manifest import Manifest
from gpufleet.netports import free_port
from gpufleet.objectstore import ObjectStore
from gpufleet.settings import Settings
from gpufleet.store.queries import check_database

console = Console()
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"}
# (team, name, GPUs, steps)
WORKLOAD = [
    ("vision", "digits-1gpu", 1, 300),
    ("nlp", "digits-8gpu", 8, 200),
    ("vision", "digits-4gpu", 4, 250),
    ("nlp", "digits-2gpu", 2, 300),
    ("vision", "digits-2gpu", 2, 200),
    ("nlp", "digits-1gpu", 1, 250),
]


def example_script() -> Path:
    """examples/train_digits.py of the source tree (the demo runs from a clone)."""
    for base in (Path.cwd(), *Path(__file__).resolve().parents):
        candidate = base / "examples" / "train_digits.py"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("examples/train_digits.py not found; run the demo from the repository")


def run_demo(settings: Settings, *, keep_running: bool = False) -> int:
    """Returns the exit code: 0 when every job SUCCEEDED with a verified manifest and the
    invariant checker found nothing at any sample; 1 when it failed, or when another demo
    (or a ``gpufleet up``) runs in its data dir ``{data_dir}/demo``: the demo holds that
    dir's ``up.lock`` (:mod:`gpufleet.cli.uplock`) from before it empties the dir until it
    ends, and a second one refuses, naming the first's pid, and deletes nothing."""
    from gpufleet.cli import uplock
    from gpufleet.processes import LocalPlatform, ensure_admin_token
    from gpufleet.services import auth

    data_dir = settings.resolved_data_dir() / "demo"
    try:
        lock = uplock.claim(data_dir, by="gpufleet demo")
    except uplock.DataDirInUse as exc:
        Console(stderr=True).print(
            f"[red]error:[/] {escape(str(exc))}: nothing was deleted; wait for it to end, "
            f"or stop it (kill {exc.pid}), or use another --data-dir",
            soft_wrap=True,
        )
        return 1
    left = _stop_left_agents(data_dir)
    if left:
        lock.release()
        Console(stderr=True).print(
            f"[red]error:[/] agent pid(s) {', '.join(map(str, left))} of an earlier demo in "
            f"{data_dir} did not stop: nothing was deleted; kill them and run the demo again",
            soft_wrap=True,
        )
        return 1
    _empty_but(data_dir, keep=lock.path.name)
    logging.basicConfig(
        level=logging.INFO,
        filename=data_dir / "platform.log",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides: dict[str, Any] = {"data_dir": data_dir, "heartbeat_interval_s": 2.0}
    if "server_port" not in settings.model_fields_set:
        overrides["server_port"] = free_port()
    overrides["controller_address"] = f"127.0.0.1:{free_port()}"
    overrides["join_address"] = f"127.0.0.1:{free_port()}"
    settings = settings.model_copy(update=overrides)
    script = example_script()
    console.print(f"[bold]gpufleet demo[/]: embedded platform in {data_dir}")
    # SIGTERM (a CI timeout, say) must still run the `finally` below, or the agent would
    # outlive the demo (agents survive their parent on purpose)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from gpufleet.processes import default_job_uids

    # the demo's jobs run this Python; unprivileged job users may not be able to run it
    job_uids, note = default_job_uids()
    if note:
        console.print(f"[yellow]note:[/] {note}")
    platform = LocalPlatform(settings, gpus="8xH100-80GB", job_uids=job_uids)
    admin_token = ensure_admin_token(platform.db)
    tokens = {}
    for team in ("vision", "nlp"):
        tokens[team] = platform.db.run_write(
            partial(auth.create_token, team_id=team, create_team_if_missing=True)
        )
    platform.start()
    lock.set_url(platform.api.url)
    try:
        if not platform.wait_for_node():
            console.print(
                f"[red]the local agent did not register; see {data_dir / 'agent.log'}[/]"
            )
            return 1
        console.print(
            f"API {platform.api.url}; one agent with 8 declared H100 GPUs "
            "(no NVML on this machine: the GPUs are declared, CUDA_VISIBLE_DEVICES is pinned)"
        )
        return _drive(platform, settings, tokens, script)
    finally:
        console.print(
            f"dashboard: [bold]{platform.api.url}/ui[/]  (admin token: {admin_token})"
            + ("" if keep_running else "; gone now: `gpufleet demo --keep-running` keeps it up"),
            soft_wrap=True,
        )
        if keep_running:
            console.print(f"platform left running at {platform.api.url}; Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        platform.stop()


def _stop_left_agents(data_dir: Path, wait_s: float = 15.0) -> list[int]:
    """Stop agents still running on ``data_dir``'s state dirs: a demo killed hard (SIGKILL)
    leaves its agent behind, holding files the next demo would delete from under it. Each
    gets SIGTERM, then SIGKILL after ``wait_s`` seconds; returns the pids still alive."""
    import os
    import signal
    import time

    from gpufleet.agent.main import state_dir_holder

    pids = [
        pid
        for state in sorted((data_dir / "agents").glob("*"))
        if (pid := state_dir_holder(state)) is not None and pid > 0
    ]
    for pid in pids:
        Console(stderr=True).print(
            f"stopping agent pid {pid}, left running by an earlier demo in {data_dir}"
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.2 if alive else 0)
    return [p for p in alive if _alive(p)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie child of ours counts as gone)."""
    from gpufleet.agent.procfs import read_stat

    st = read_stat(pid)
    return st is not None and st.state not in "ZX"


def _empty_but(directory: Path, keep: str) -> None:
    """Remove everything in ``directory`` but the file ``keep`` (the held lock)."""
    for child in directory.iterdir():
        if child.name == keep:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                child.unlink()


def _drive(platform: Any, settings: Settings, tokens: dict[str, str], script: Path) -> int:
    url = platform.api.url
    jobs: list[tuple[str, str, str]] = []  # (team, name, job_id)
    with httpx.Client(base_url=url, timeout=30) as http:
        for team, name, gpus, steps in WORKLOAD:
            body = {
                "name": name,
                "gpu_count": gpus,
                "priority": "NORMAL",
                "max_retries": 1,
                "command": [
                    sys.executable,
                    str(script),
                    "--steps",
                    str(steps),
                    "--step-sleep",
                    "0.01",
                ],
                "env": {"PYTHONUNBUFFERED": "1"},
                "expected_duration_s": 10,
            }
            r = http.post(
                "/v1/jobs",
                json=body,
                headers={
                    "Authorization": f"Bearer {tokens[team]}",
                    "Idempotency-Key": str(uuid.uuid4()),
                },
            )
            r.raise_for_status()
            jobs.append((team, name, r.json()["job_id"]))
        violations: list[str] = []
        samples = 0
        states: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 300
        # a terminal gets a live table; a pipe or CI log (`make demo > log`) gets a plain
        # line per status change and a summary every 10 s, never minutes of silence
        live = Live(_table(jobs, states), console=console, refresh_per_second=4)
        plain = _PlainProgress(jobs) if not console.is_terminal else None
        with live if plain is None else contextlib.nullcontext():
            while time.monotonic() < deadline:
                for team, _, job_id in jobs:
                    states[job_id] = http.get(
                        f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {tokens[team]}"}
                    ).json()
                    if states[job_id]["status"] not in TERMINAL:
                        tail = http.get(
                            f"/v1/jobs/{job_id}/logs",
                            headers={"Authorization": f"Bearer {tokens[team]}"},
                        )
                        lines = tail.text.strip().splitlines() if tail.status_code == 200 else []
                        states[job_id]["_last"] = lines[-1] if lines else ""
                violations += [str(v) for v in check_database(platform.db)[1]]
                samples += 1
                if plain is None:
                    live.update(_table(jobs, states))
                else:
                    plain.update(states)
                if all(st.get("status") in TERMINAL for st in states.values()):
                    break
                time.sleep(0.5)
        console.print()
        store = ObjectStore(settings.resolved_object_store_url())
        ok = True
        for team, name, job_id in jobs:
            st = states[job_id]
            verdict = _verify(store, st.get("result_uri")) if st["status"] == "SUCCEEDED" else "—"
            ok &= st["status"] == "SUCCEEDED" and verdict.startswith("ok")
            console.print(f"{team:7} {name:12} {job_id}  {st['status']:9}  manifest: {verdict}")
        team, name, job_id = jobs[0]
        log = http.get(
            f"/v1/jobs/{job_id}/logs", headers={"Authorization": f"Bearer {tokens[team]}"}
        ).text
        console.print(f"\n[bold]gpufleet logs {job_id}[/] (last lines):")
        for line in log.strip().splitlines()[-4:]:
            console.print(f"  {line}")
    console.print(f"\ninvariant checks: {samples} samples, {len(violations)} violations")
    for v in violations[:10]:
        console.print(f"[red]{v}[/]")
    ok &= not violations
    console.print("[green]demo passed[/]" if ok else "[red]demo failed[/]")
    return 0 if ok else 1


class _PlainProgress:
    """Progress as plain lines: each job's status changes, and every
    :data:`SUMMARY_EVERY_S` seconds a one-line count by status."""

    SUMMARY_EVERY_S = 10.0

    def __init__(self, jobs: list[tuple[str, str, str]]) -> None:
        self.jobs = jobs
        self.seen: dict[str, str] = {}
        self.started = self.last_summary = time.monotonic()

    def update(self, states: dict[str, dict[str, Any]]) -> None:
        now = time.monotonic()
        for team, name, job_id in self.jobs:
            st = states.get(job_id, {})
            status = str(st.get("status", "?"))
            if self.seen.get(job_id) != status:
                self.seen[job_id] = status
                att = (st.get("attempts") or [{}])[-1]
                where = f" on {att['node_id']} GPUs {att.get('gpu_ids')}" if att else ""
                console.print(
                    f"{now - self.started:6.1f}s  {team:7} {name:12} {status}{where}",
                    highlight=False,
                    markup=False,
                )
        if now - self.last_summary >= self.SUMMARY_EVERY_S:
            self.last_summary = now
            counts: dict[str, int] = {}
            for status in self.seen.values():
                counts[status] = counts.get(status, 0) + 1
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            console.print(f"{now - self.started:6.1f}s  jobs: {summary}", highlight=False)


def _verify(store: ObjectStore, result_uri: str | None) -> str:
    """Re-check the accepted manifest: every file's sha256 matches the stored object."""
    if not result_uri:
        return "missing result_uri"
    manifest = Manifest.from_json(store.get_bytes(store.key_of(result_uri)))
    for f in manifest.files:
        if store.sha256(f.key) != f.sha256:
            return f"checksum mismatch on {f.path}"
    kinds = sorted({f.kind for f in manifest.files})
    return f"ok ({len(manifest.files)} files: {', '.join(kinds)}; sha256 verified)"


def _table(jobs: list[tuple[str, str, str]], states: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="jobs")
    for col in ("team", "name", "GPUs", "status", "attempt", "node/gpus", "progress"):
        t.add_column(col)
    for team, name, job_id in jobs:
        st = states.get(job_id, {})
        att = (st.get("attempts") or [{}])[-1]
        t.add_row(
            team,
            name,
            str(st.get("gpu_count", "")),
            st.get("status", "…"),
            str(att.get("attempt", "")),
            f"{att.get('node_id', '')} {att.get('gpu_ids', '')}" if att else "",
            (st.get("_last") or (st.get("pending_reason") or {}).get("message", ""))[:60],
        )
    return t
