"""The directory and environment of one attempt.

Per-attempt directory ``{state_dir}/runs/{run_id}/``::

    work/          the command's working directory
    checkpoints/   GPUFLEET_CHECKPOINT_DIR (empty at start; uploaded at exit)
    artifacts/     GPUFLEET_ARTIFACTS_DIR (uploaded at exit)
    resume/        GPUFLEET_RESUME_FROM (objects under resume_from_uri, downloaded before start)
    output.log     stdout + stderr of the command (streamed to the object store)
    env.json       the command's environment, mode 0600, deleted by the shim once read
    shim.json      the shim's claim: pid, pgid, start_ticks, boot_id (or the agent's
                   "abandoned" mark)
    exit.json      the shim's record of the exit code
    shim.log       the shim's own stderr
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.objectstore import ObjectStore


class StartError(Exception):
    """The attempt could not be started; it is reported NEVER_STARTED with this message.

    ``node_fault``: the node caused it (its disk, the shim, the runtime), not the job's spec;
    the controller then charges the node and re-places the job without using a retry."""

    def __init__(self, message: str, *, node_fault: bool = False) -> None:
        super().__init__(message)
        self.node_fault = node_fault


@dataclass(frozen=True, slots=True)
class RunPaths:
    """The on-disk layout of one attempt (see module doc)."""

    root: Path

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def resume(self) -> Path:
        return self.root / "resume"

    @property
    def log(self) -> Path:
        return self.root / "output.log"

    @property
    def claim(self) -> Path:
        return self.root / "shim.json"

    @property
    def exit_file(self) -> Path:
        return self.root / "exit.json"

    @property
    def env_file(self) -> Path:
        return self.root / "env.json"

    @property
    def shim_log(self) -> Path:
        return self.root / "shim.log"


def build_env(
    rec: RunRecord, paths: RunPaths, resume_dir: Path | None, base: dict[str, str]
) -> dict[str, str]:
    """The command's environment.

    ``base`` (the agent's environment) without its ``GPUFLEET_*`` variables (agent
    configuration, possibly secret), then the job's env, then the platform's variables, which
    a job cannot override: ``CUDA_VISIBLE_DEVICES`` (the reservation's GPU indexes, comma
    list; empty = no GPU), ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so CUDA's numbering matches
    NVML's), ``GPUFLEET_JOB_ID``, ``GPUFLEET_RUN_ID``, ``GPUFLEET_ATTEMPT``,
    ``GPUFLEET_FENCING_TOKEN``, ``GPUFLEET_CHECKPOINT_DIR``, ``GPUFLEET_ARTIFACTS_DIR`` and
    ``GPUFLEET_RESUME_FROM`` (a
    directory holding the previous attempt's checkpoints, or empty when there are none).
    """
    env = {k: v for k, v in base.items() if not k.startswith("GPUFLEET_")}
    env.update(rec.env)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in rec.gpu_ids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUFLEET_JOB_ID": rec.job_id,
            "GPUFLEET_RUN_ID": rec.run_id,
            "GPUFLEET_ATTEMPT": str(rec.attempt),
            "GPUFLEET_FENCING_TOKEN": str(rec.token),
            "GPUFLEET_CHECKPOINT_DIR": str(paths.checkpoints),
            "GPUFLEET_ARTIFACTS_DIR": str(paths.artifacts),
            "GPUFLEET_RESUME_FROM": str(resume_dir) if resume_dir is not None else "",
        }
    )
    return env


def download_prefix(store: ObjectStore, uri_or_key: str, dest: Path) -> int:
    """Download every object under a prefix (a URI in ``store`` or a bare key) into ``dest``,
    keeping relative paths. Returns the number of files.

    Raises:
        StartError: the URI is outside the store, or a download failed.
    """
    try:
        prefix = store.key_of(uri_or_key) if "://" in uri_or_key else uri_or_key
        prefix = prefix.strip("/")
        count = 0
        for key in store.list(prefix):
            rel = key[len(prefix) :].lstrip("/")
            target = (dest / rel).resolve()
            if not rel or not target.is_relative_to(dest.resolve()):
                continue  # "..": never write outside the resume directory
            store.get_file(key, target)
            count += 1
        return count
    except (OSError, ValueError) as exc:
        raise StartError(f"cannot download resume_from_uri {uri_or_key!r}: {exc}") from exc
