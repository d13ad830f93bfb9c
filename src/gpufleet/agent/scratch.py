"""A filesystem of its own for each attempt's scratch: one job filling it fills nothing else.

The job-visible directory of an attempt (``{jobs_dir}/{run_id}/``: ``work``, ``checkpoints``,
``artifacts``, ``resume`` and the private ``tmp`` bound on the job's ``/tmp``) is the root of
an ext4 filesystem in a sparse image file, ``{state_dir}/scratch/{run_id}.img`` (the agent's
0700 state dir), loop-mounted ``nosuid,nodev,noatime``. Its size is the job's ``disk_mb``, or
the node's default (``gpufleet agent --job-disk-mb``). A job that writes past it gets
``ENOSPC`` in its own filesystem; the node's disk, its state dir and every other attempt's
scratch are untouched, so the node stays HEALTHY. The attempt's end is then reported with
reason :data:`DISK_FULL` when its command failed with its filesystem full.

Why a loop-mounted image and not the alternatives:

* an XFS project quota needs the node's scratch to be XFS mounted with ``prjquota``, which an
  agent cannot arrange; ext4 in an image works on any filesystem that holds sparse files;
* a ``tmpfs`` with ``size=`` bounds the disk but spends memory, and checkpoints of GPU jobs
  are often larger than a node's RAM;
* the image is sparse (it takes on the host only what the job wrote, plus ~1 MiB), and
  making and mounting one costs ~50-75 ms here; but the sizes promised to every live attempt,
  less what their images already hold, must fit in the host's free space above the node's
  disk reserve, so no promise can run the host out of space: on a short disk the node's
  default size shrinks to half the room left (:func:`default_fit_mb`), a job's own
  ``disk_mb`` that does not fit fails the start.

Lifecycle: made and mounted before the job's directories (:meth:`ScratchDisks.create`), kept
while the attempt runs and while its outputs are uploaded (a restarted agent finds the mount
in place: it is kernel state, not the agent's), unmounted and deleted in the attempt's
cleanup (:meth:`ScratchDisks.remove`). At agent start, mounts and images of attempts the
agent no longer knows, or already cleaned, are removed (:meth:`ScratchDisks.prune`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.agent.workdir import StartError

logger = logging.getLogger("gpufleet.agent")

DISK_FULL = "DISK_FULL"
"""``ExitInfo.reason`` when an attempt failed with its scratch filesystem full."""
FULL_BELOW_BYTES = 1024 * 1024
"""A scratch filesystem with less than this free for its user counts as full."""
MIN_SCRATCH_MB = 16
IMAGE_OVERHEAD_MB = 2
"""Host space an image takes beyond what its files hold (ext4 metadata), MiB."""
TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MKFS_OPTIONS = ("-q", "-F", "-m", "0", "-O", "^has_journal", "-E")
"""No reserved blocks, no journal (a scratch filesystem is dropped whole after the attempt,
and it is never checked after a crash)."""
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime"


def _tool(name: str) -> str:
    return shutil.which(name, path=TOOL_PATH) or ""


@dataclass
class ScratchDisks:
    """The scratch filesystems of this agent's attempts (see module doc).

    Attributes:
        images_dir: where the image files are (inside the 0700 state dir).
        default_mb: size given to an attempt whose job set no ``disk_mb``; 0 = no bound.
        reserve_mb: host free space (MiB) no promise may eat into (the node's disk reserve).
        problem: why attempts get no scratch filesystem here ("" when they do).
    """

    images_dir: Path
    default_mb: int = 0
    reserve_mb: int = 0
    problem: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def enabled(self) -> bool:
        return not self.problem

    @classmethod
    def detect(
        cls, images_dir: Path, *, default_mb: int, reserve_mb: int, per_attempt_dirs: bool
    ) -> ScratchDisks:
        """Whether this node can give attempts a filesystem of their own: root, ``mkfs.ext4``,
        ``mount`` and a loop device (one image made and mounted as a probe). Never raises.

        Args:
            per_attempt_dirs: job-visible dirs are apart from the agent's files (jobs run as
                job users); without that, no attempt gets a scratch filesystem.
        """
        problem = ""
        if default_mb <= 0:
            problem = "--job-disk-mb 0"
        elif not per_attempt_dirs:
            problem = "jobs run as the agent's user (their dirs are in the state dir)"
        elif os.geteuid() != 0:
            problem = "the agent is not root (it cannot mount)"
        elif not (_tool("mkfs.ext4") and _tool("mount") and _tool("umount")):
            problem = "mkfs.ext4, mount or umount is not installed"
        elif not Path("/dev/loop-control").exists():
            problem = "no loop devices (/dev/loop-control)"
        disks = cls(images_dir, default_mb, reserve_mb, problem)
        if not problem:
            disks.problem = disks._probe()
        return disks

    def _probe(self) -> str:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.images_dir, 0o700)
        image = self.images_dir / f".probe-{os.getpid()}.img"
        target = Path(tempfile.mkdtemp(prefix=".probe-", dir=self.images_dir))
        try:
            _make_image(image, MIN_SCRATCH_MB, 0, 0)
            _run([_tool("mount"), "-o", MOUNT_OPTIONS, str(image), str(target)])
            _run([_tool("umount"), str(target)])
            return ""
        except (OSError, subprocess.SubprocessError) as exc:
            return f"cannot loop-mount an ext4 image: {exc}"
        finally:
            with contextlib.suppress(OSError):
                image.unlink()
            with contextlib.suppress(OSError):
                target.rmdir()

    def image(self, run_id: str) -> Path:
        return self.images_dir / f"{run_id}.img"

    def size_mb(self, disk_mb: int) -> int:
        """The size an attempt gets: its job's ``disk_mb`` (MiB), else the node's default."""
        return max(disk_mb, MIN_SCRATCH_MB) if disk_mb > 0 else self.default_mb

    def create(
        self,
        run_id: str,
        mount_point: Path,
        size_mb: int,
        uid: int,
        gid: int,
        *,
        shrink_to_fit: bool = False,
    ) -> int:
        """Make the image, its filesystem (root owned by ``uid:gid``, mode 0700) and mount it
        on ``mount_point`` (an existing, empty directory). Returns the size made, MiB.

        Args:
            shrink_to_fit: the size is the node's default, not the job's ``disk_mb``: when
                the host has less room, make it as large as the room allows (at least
                ``MIN_SCRATCH_MB``; said in the log) instead of refusing the start.

        Raises:
            StartError: the host cannot hold the size promised (node's fault, or the job's
                when ``size_mb`` is more than the whole host filesystem), or mkfs/mount
                failed (node's fault). Nothing is left behind.
        """
        image = self.image(run_id)
        try:
            with self._lock:  # promises are checked and made one at a time
                room = self._room_mb(size_mb)
                fit = default_fit_mb(size_mb, room)
                if shrink_to_fit and MIN_SCRATCH_MB <= fit < size_mb:
                    logger.warning(
                        "run %s: scratch filesystem of %d MiB instead of the default %d MiB "
                        "(half of the host's %d MiB free above the reserve and the other "
                        "attempts' promises)",
                        run_id,
                        fit,
                        size_mb,
                        room,
                    )
                    size_mb = fit
                self._check_room(size_mb)
                _make_image(image, size_mb, uid, gid)
            _run([_tool("mount"), "-o", MOUNT_OPTIONS, str(image), str(mount_point)])
            with contextlib.suppress(OSError):
                (mount_point / "lost+found").rmdir()
            os.chown(mount_point, uid, gid)
            os.chmod(mount_point, 0o700)
        except StartError:
            self.remove(run_id, mount_point)
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            self.remove(run_id, mount_point)
            raise StartError(
                f"cannot make the attempt's scratch filesystem ({size_mb} MiB): {exc}",
                node_fault=True,
            ) from exc
        return size_mb

    def _room_mb(self, size_mb: int) -> int:
        """MiB an image may still be promised (free space less the live images' promises
        and the reserve, less the image overhead); ``size_mb`` when that cannot be read."""
        try:
            free, promised = self._free_and_promised()
        except OSError:
            return size_mb
        mib = 1024 * 1024
        return (free - promised) // mib - self.reserve_mb - IMAGE_OVERHEAD_MB

    def _free_and_promised(self) -> tuple[int, int]:
        """(free bytes of the images' filesystem, bytes the live images may still take)."""
        self.images_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.images_dir).free
        promised = 0
        for other in self.images_dir.glob("*.img"):
            with contextlib.suppress(OSError):
                st = other.stat()
                promised += max(0, st.st_size - st.st_blocks * 512)
        return free, promised

    def size_of(self, run_id: str) -> int:
        """The size (MiB) of the attempt's image; 0 when it has none."""
        try:
            return self.image(run_id).stat().st_size // (1024 * 1024)
        except OSError:
            return 0

    def _check_room(self, size_mb: int) -> None:
        self.images_dir.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.images_dir)
        mib = 1024 * 1024
        if (size_mb + IMAGE_OVERHEAD_MB) * mib > usage.total:
            raise StartError(
                f"disk_mb={size_mb} is more than this node's scratch filesystem holds "
                f"({usage.total // mib} MiB)"
            )
        _, promised = self._free_and_promised()  # bytes the live images may still take
        room = usage.free - promised - self.reserve_mb * mib
        if (size_mb + IMAGE_OVERHEAD_MB) * mib > room:
            raise StartError(
                f"no room for a {size_mb} MiB scratch filesystem: {usage.free // mib} MiB free "
                f"in {self.images_dir}, {promised // mib} MiB promised to running attempts, "
                f"{self.reserve_mb} MiB reserve",
                node_fault=True,
            )

    def remove(self, run_id: str, mount_point: Path | None) -> None:
        """Unmount (lazily if it is busy) and delete the attempt's image. Idempotent; never
        raises (a failure is logged and retried by the next agent start's prune)."""
        if mount_point is not None and os.path.ismount(mount_point):
            try:
                _run([_tool("umount"), str(mount_point)])
            except (OSError, subprocess.SubprocessError):
                try:
                    _run([_tool("umount"), "--lazy", str(mount_point)])
                except (OSError, subprocess.SubprocessError) as exc:
                    logger.error("run %s: cannot unmount %s: %s", run_id, mount_point, exc)
                    return
        with contextlib.suppress(FileNotFoundError):
            self.image(run_id).unlink()

    def prune(self, jobs_dir: Path, keep: set[str]) -> list[str]:
        """Remove the scratch filesystems of attempts not in ``keep`` (ended and cleaned, or
        unknown here): their mounts under ``jobs_dir`` and their images. Returns their
        run_ids. Called at agent start, before any attempt starts."""
        gone: set[str] = set()
        for point in _mounts_under(jobs_dir, self.images_dir):
            if point.name not in keep:
                self.remove(point.name, point)
                gone.add(point.name)
        with contextlib.suppress(OSError):
            for image in self.images_dir.glob("*.img"):
                run_id = image.name.removesuffix(".img")
                if run_id not in keep:
                    with contextlib.suppress(OSError):
                        image.unlink()
                        gone.add(run_id)
        return sorted(gone)


def default_fit_mb(default_mb: int, room_mb: int) -> int:
    """The size (MiB) an attempt whose job set no ``disk_mb`` gets when ``room_mb`` MiB may
    still be promised: the node's default while the room holds two of it, else half the room
    (so the next attempt on a short disk still finds room, rather than the first one taking
    it all and every later start failing), never less than ``MIN_SCRATCH_MB`` unless the room
    itself is smaller (the start then fails as the node's fault)."""
    if room_mb >= 2 * default_mb:
        return default_mb
    return min(default_mb, max(MIN_SCRATCH_MB, room_mb // 2), room_mb)


def is_full(path: Path) -> bool:
    """Whether the filesystem holding ``path`` has (almost) no space or inodes left for an
    unprivileged user; False when it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES or (st.f_files > 0 and st.f_favail == 0)


def _make_image(image: Path, size_mb: int, uid: int, gid: int) -> None:
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size_mb * 1024 * 1024)  # sparse: no block is taken yet
    finally:
        os.close(fd)
    options = f"root_owner={uid}:{gid},nodiscard"
    _run([_tool("mkfs.ext4"), *MKFS_OPTIONS, options, str(image)])


def _run(argv: list[str]) -> None:
    if not argv[0]:
        raise OSError(f"{argv[1:2]}: tool not installed")
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env={"PATH": TOOL_PATH}, check=False
    )
    if done.returncode != 0:
        raise subprocess.SubprocessError(
            f"{os.path.basename(argv[0])} failed: {done.stderr.strip() or done.returncode}"
        )


def _mounts_under(parent: Path, images_dir: Path) -> list[Path]:
    """Mount points directly below ``parent`` whose filesystem is a loop device backed by an
    image in ``images_dir`` (from ``/proc/self/mountinfo`` and ``/sys/block/loopN``): never
    another mount an operator keeps there."""
    found = []
    real, images = os.path.realpath(parent), os.path.realpath(images_dir)
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            if os.path.dirname(point) != real or " - " not in line:
                continue
            source = line.split(" - ", 1)[1].split()[1]
            if not source.startswith("/dev/loop"):
                continue
            try:
                backing = Path(f"/sys/block/{os.path.basename(source)}/loop/backing_file")
                image = backing.read_text().strip().removesuffix(" (deleted)")
            except OSError:
                continue
            if os.path.dirname(image) == images:
                found.append(Path(point))
    return found
