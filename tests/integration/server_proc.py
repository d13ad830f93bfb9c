"""A real ``gpufleet server`` process for API tests that need one (memory, logs, replicas)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.ports import free_port


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB, from /proc/PID/status (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class ServerProcess:
    """``gpufleet server`` on a free loopback port, stdout+stderr to ``log_path``.

    Args:
        data_dir: GPUFLEET_DATA_DIR (SQLite file and object store unless overridden).
        env: extra environment (e.g. GPUFLEET_DATABASE_URL, GPUFLEET_REDIS_URL).
    """

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"server-{self.port}.log"
        self.env = {
            **os.environ,
            "GPUFLEET_DATA_DIR": str(data_dir),
            "GPUFLEET_SERVER_PORT": str(self.port),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> ServerProcess:
        gpufleet = Path(sys.executable).parent / "gpufleet"
        cmd = [str(gpufleet)] if gpufleet.exists() else [sys.executable, "-m", "gpufleet.cli.main"]
        self.proc = subprocess.Popen(
            [*cmd, "server", "--migrate"],
            env=self.env,
            stdout=open(self.log_path, "ab"),  # noqa: SIM115 - owned by the child
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not start: {self.log()[-3000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
