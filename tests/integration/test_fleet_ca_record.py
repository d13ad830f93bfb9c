"""One fleet CA per database: ``admin ca init`` records it, refuses a second one unless
``--force-new-ca``; ``admin ca show`` prints what to compare across hosts; a controller with
another CA refuses to start; an API host issues join tokens with only ``ca.crt``, or with no
CA file at all (the recorded fingerprint), and refuses one with another CA's ``ca.crt``.
Real CLI processes on a real SQLite database file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.controller.main import Controller
from gpufleet.processes import new_join_token
from gpufleet.queue import InProcWaker
from gpufleet.rpc import tls
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from tests.ports import free_port


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        GPUFLEET_DATA_DIR=str(tmp),
        GPUFLEET_DATABASE_URL=f"sqlite:///{tmp / 'fleet.db'}",
        COLUMNS="200",
    )
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "admin", "ca", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_ca_init_records_the_ca_and_refuses_to_fork_it(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'fleet.db'}")
    migrate(db)
    first = _cli(tmp_path, "init", "--pki-dir", str(tmp_path / "pki1"))
    assert first.returncode == 0, first.stderr
    fp = tls.fingerprint(tls.read_ca_cert(tmp_path / "pki1"))
    assert first.stdout.strip().endswith(f"sha256:{fp}")

    second = _cli(tmp_path, "init", "--pki-dir", str(tmp_path / "pki2"))
    assert second.returncode == 2
    text = " ".join(second.stderr.split())
    assert "already recorded for this database" in text and fp in text, text
    assert "--force-new-ca" in text
    assert not (tmp_path / "pki2" / "ca.key").exists()

    show = _cli(tmp_path, "show", "--pki-dir", str(tmp_path / "pki1"))
    assert show.returncode == 0, show.stderr
    assert f"sha256:      {fp}" in show.stdout and "the same CA" in show.stdout
    assert "subject:     CN=gpufleet fleet CA" in show.stdout and "not after:" in show.stdout

    # an API host: only ca.crt, or nothing at all
    api_only = tmp_path / "api-pki"
    api_only.mkdir()
    shutil.copy(tmp_path / "pki1" / "ca.crt", api_only / "ca.crt")
    for pki in (api_only, tmp_path / "empty-pki"):
        settings = Settings(data_dir=tmp_path, database_url=db.url, pki_dir=pki)
        token, _ = new_join_token(db, settings, "n1", 600)
        assert tls.parse_join_token(token)[0] == fp
    show_api = _cli(tmp_path, "show", "--pki-dir", str(api_only))
    assert show_api.returncode == 0 and "absent (not a controller host)" in show_api.stdout

    # another CA on a host: refused for join tokens, by the controller, by `ca show`
    rogue = tmp_path / "rogue"
    tls.init_ca(rogue)
    settings = Settings(
        data_dir=tmp_path,
        database_url=db.url,
        pki_dir=rogue,
        controller_address=f"127.0.0.1:{free_port()}",
    )
    with pytest.raises(tls.PkiError, match=r"copy the fleet's pki directory from a controller"):
        new_join_token(db, settings, "n1", 600)
    with pytest.raises(tls.PkiError, match=f"fleet CA of this database is sha256:{fp}"):
        Controller(settings, db, InProcWaker())
    bad = _cli(tmp_path, "show", "--pki-dir", str(rogue))
    assert bad.returncode == 1 and "ANOTHER CA" in bad.stdout

    # rotation: --force-new-ca records the new CA, with the warning
    rotated = _cli(tmp_path, "init", "--pki-dir", str(tmp_path / "pki3"), "--force-new-ca")
    assert rotated.returncode == 0, rotated.stderr
    assert "rejoin every node" in " ".join(rotated.stderr.split())
    assert _cli(tmp_path, "show", "--pki-dir", str(tmp_path / "pki1")).returncode == 1
    new_fp = tls.fingerprint(tls.read_ca_cert(tmp_path / "pki3"))
    settings = Settings(data_dir=tmp_path, database_url=db.url, pki_dir=tmp_path / "empty-pki")
    assert tls.parse_join_token(new_join_token(db, settings, None, 600)[0])[0] == new_fp


def test_missing_ca_cert_says_to_copy_it_from_a_controller_host(tmp_path: Path) -> None:
    with pytest.raises(tls.PkiError, match=r"copy ca\.crt .* from a controller host"):
        tls.read_ca_cert(tmp_path)
