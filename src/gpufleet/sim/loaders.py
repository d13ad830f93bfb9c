"""Workloads and fleets: the public traces in ../shared/traces and a synthetic generator.

Philly 2017 (Jeon et al., ATC'19; CC BY 4.0; the Pollux job table): one row per job,
``timestamp, duration, num_gpus, gpu_time, cluster``; the VC (``cluster``) is the team.
Alibaba openb 2023 (Weng et al., ATC'23): node inventory with GPU model per node.
Trace files are read where they lie; nothing is copied into the repository.
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from gpufleet.domain.types import PriorityClass
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

_DATE = "%Y-%m-%d %H:%M:%S"


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _epoch(text: str) -> float:
    return datetime.strptime(text.strip(), _DATE).replace(tzinfo=UTC).timestamp()


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What a loader kept and dropped (reported, never silent)."""

    rows: int
    kept: int
    dropped_outside_window: int = 0
    dropped_unknown_team: int = 0
    clipped_oversize: int = 0
    dropped_oversize: int = 0
    gangs: int = 0
    """Jobs above one node kept whole, as multi-node gangs (``oversize="gang"``)."""


def philly_vc_sizes(path: Path) -> dict[str, int]:
    """``philly_vc_node_count.csv``: VC -> number of nodes.

    Raises:
        ValueError: a VC listed twice, naming both lines."""
    sizes: dict[str, int] = {}
    first: dict[str, int] = {}
    with _open_text(path) as f:
        for row, r in enumerate(csv.DictReader(f), start=2):
            vc = r["vc"].strip()
            if vc in first:
                raise ValueError(f"VC {vc!r} is listed twice (lines {first[vc]} and {row})")
            first[vc] = row
            sizes[vc] = int(r["node num"])
    return sizes


def load_philly(
    path: Path,
    *,
    start: str = "2017-10-01 00:00:00",
    end: str = "2017-12-01 00:00:00",
    teams: set[str] | None = None,
    max_gpus_per_job: int = 8,
    oversize: str = "gang",
    estimate: str = "exact",
    estimate_noise: float = 0.0,
    gpu_type: str = "",
    arrival_speedup: float = 1.0,
    checkpoint_s: float | None = None,
) -> tuple[list[SimJob], LoadStats]:
    """Jobs of the Philly table submitted in ``[start, end)``, times relative to ``start``.

    Args:
        teams: keep only these VCs (e.g. the 11 with known sizes); None keeps all.
        max_gpus_per_job: the largest node. Bigger jobs (12-32 GPUs, gangs across nodes in
            Philly) are, by ``oversize``: ``gang`` (default) kept whole, as multi-node jobs
            the policy places on whole nodes, as the real cluster ran them (12 and 24 GPUs,
            not a multiple of 8, may use one partial node: ``allow_partial_nodes``);
            ``clip``ped to one node with their GPU-time kept (duration scaled up; what the
            simulator did before gangs existed); or ``drop``ped.
        estimate: ``exact`` tells the scheduler the true duration as expected_duration_s,
            ``none`` tells it nothing.
        estimate_noise: with ``exact``, each estimate is the duration times
            ``exp(N(0, estimate_noise))`` (log-normal noise, seed 0, drawn in file order), so
            the oracle's advantage can be measured at noise levels; 0 (default) = exact.
        arrival_speedup: divide inter-arrival times by this (load x k, durations kept):
            the table's offered load is low (section 1.1 of the traces README), and the
            published Philly figures were measured under far more contention.
        checkpoint_s: every job checkpoints this often (seconds), so a preempted attempt
            keeps its work up to the last checkpoint; None (default): it keeps nothing.
            The preemptive SRTF baseline of Helios/Tiresias assumes work is kept.
    """
    if checkpoint_s is not None and not checkpoint_s > 0:
        raise ValueError(f"checkpoint_s must be > 0 or absent, not {checkpoint_s}")
    t0, t1 = _epoch(start), _epoch(end)
    jobs: list[tuple[float, int, SimJob]] = []
    rows = outside = unknown = clipped = dropped = gangs = 0
    if oversize not in ("gang", "clip", "drop"):
        raise ValueError(f"oversize must be gang, clip or drop, not {oversize!r}")
    noise_rng = random.Random(0)
    with _open_text(path) as f:
        for i, r in enumerate(csv.DictReader(f)):
            rows += 1
            factor = math.exp(noise_rng.gauss(0.0, estimate_noise)) if estimate_noise else 1.0
            ts = _epoch(r["timestamp"])
            if not t0 <= ts < t1:
                outside += 1
                continue
            vc = r["cluster"].strip()
            if teams is not None and vc not in teams:
                unknown += 1
                continue
            gpus = int(float(r["num_gpus"]))
            duration = max(1.0, float(r["duration"]))
            partial = False
            if gpus > max_gpus_per_job and oversize == "gang":
                gangs += 1
                partial = gpus % max_gpus_per_job != 0
            elif gpus > max_gpus_per_job:
                if oversize == "drop":
                    dropped += 1
                    continue
                duration = duration * gpus / max_gpus_per_job
                gpus = max_gpus_per_job
                clipped += 1
            gpus = max(1, gpus)
            job = SimJob(
                job_id=f"p{i:06d}",
                team_id=vc,
                submit_s=(ts - t0) / arrival_speedup,
                gpus=gpus,
                duration_s=duration,
                gpu_types=(gpu_type,) if gpu_type else (),
                expected_duration_s=duration * factor if estimate == "exact" else None,
                allow_partial_nodes=partial,
                checkpoint_s=checkpoint_s,
            )
            jobs.append((ts, i, job))
    jobs.sort(key=lambda e: (e[0], e[1]))
    out = [j for _, _, j in jobs]
    return out, LoadStats(rows, len(out), outside, unknown, clipped, dropped, gangs)


_OPENB_GPU_MEMORY_MB = {
    "V100M16": 16_384,
    "V100M32": 32_768,
    "P100": 16_384,
    "T4": 16_384,
    "A10": 24_576,
}


def load_openb_fleet(path: Path) -> list[NodeGroup]:
    """``openb_node_list_gpu_node.csv`` (or ``_all_node``): one group per GPU node; CPU-only
    nodes are skipped. GPU memory per model where public (G1-G3 are undisclosed: 0).

    Raises:
        ValueError: a node (``sn``) listed twice, naming both lines."""
    groups: list[NodeGroup] = []
    seen: dict[str, int] = {}  # sn -> its first row
    with _open_text(path) as f:
        for row, r in enumerate(csv.DictReader(f), start=2):
            gpus = int(r["gpu"])
            model = (r.get("model") or "").strip()
            if gpus <= 0 or not model:
                continue
            sn = r["sn"].strip()
            first = seen.setdefault(sn, row)
            if first != row:
                raise ValueError(f"node {sn!r} is listed twice (lines {first} and {row})")
            groups.append(
                NodeGroup(
                    name=sn,
                    count=1,
                    gpus_per_node=gpus,
                    gpu_type=model,
                    gpu_memory_mb=_OPENB_GPU_MEMORY_MB.get(model, 0),
                    cpu=int(r["cpu_milli"]) / 1000.0,
                    memory_mb=int(r["memory_mib"]),
                )
            )
    return groups


def load_openb_pods(
    path: Path,
    team_by_qos: bool = True,
    arrival_speedup: float = 1.0,
    lifetime: str = "trace",
    inflate_to_gpus: int | None = None,
    seed: int = 0,
) -> tuple[list[SimJob], LoadStats]:
    """openb pods as jobs: GPU pods only; a fractional GPU counts as one whole GPU (gpufleet
    allocates whole GPUs); the QoS class is the team and LS/Guaranteed map to HIGH, BE to LOW.

    ``lifetime="trace"``: arrival = creation time (divided by ``arrival_speedup``), duration =
    deletion - scheduled (pods without both are dropped). ``lifetime="forever"``: the FGD
    protocol (Weng et al., ATC'23): pods arrive one per second in creation order and never
    leave; with ``inflate_to_gpus`` the pods are then sampled again (seeded) until the
    requested GPUs reach that number (e.g. 1.3 x the fleet).
    """
    prio = {
        "LS": PriorityClass.HIGH,
        "Guaranteed": PriorityClass.HIGH,
        "Burstable": PriorityClass.NORMAL,
        "BE": PriorityClass.LOW,
    }
    forever = lifetime == "forever"
    pods: list[SimJob] = []
    rows = 0
    with _open_text(path) as f:
        for i, r in enumerate(csv.DictReader(f)):
            rows += 1
            gpus = int(r["num_gpu"] or 0)
            if gpus <= 0:
                continue
            if forever:
                start, duration = float(i), math.inf
            else:
                if not r["scheduled_time"] or not r["deletion_time"]:
                    continue
                start = float(r["creation_time"])
                duration = float(r["deletion_time"]) - float(r["scheduled_time"])
                if duration <= 0:
                    continue
            spec = tuple(s for s in (r.get("gpu_spec") or "").split("|") if s)
            qos = r["qos"].strip()
            pods.append(
                SimJob(
                    job_id=f"o{i:05d}",
                    team_id=qos if team_by_qos else "openb",
                    submit_s=start,
                    gpus=gpus,
                    duration_s=duration,
                    priority=prio.get(qos, PriorityClass.NORMAL),
                    gpu_types=spec,
                    cpu=int(r["cpu_milli"]) / 1000.0,
                    memory_mb=int(r["memory_mib"]),
                    expected_duration_s=None if forever else duration,
                )
            )
    if forever:
        pods.sort(key=lambda j: j.submit_s)
        jobs = [replace(j, submit_s=float(k)) for k, j in enumerate(pods)]
        if inflate_to_gpus is not None and pods:
            rng = random.Random(seed)
            demand = sum(j.gpus for j in jobs)
            k = len(jobs)
            while demand < inflate_to_gpus:
                j = pods[rng.randrange(len(pods))]
                jobs.append(replace(j, job_id=f"{j.job_id}-x{k}", submit_s=float(k)))
                demand += j.gpus
                k += 1
        return jobs, LoadStats(rows, len(jobs))
    t0 = min((j.submit_s for j in pods), default=0.0)
    jobs = sorted(
        (replace(j, submit_s=(j.submit_s - t0) / arrival_speedup) for j in pods),
        key=lambda j: (j.submit_s, j.job_id),
    )
    return jobs, LoadStats(rows, len(jobs))


@dataclass(frozen=True, slots=True)
class SyntheticTeam:
    team_id: str
    jobs_per_hour: float
    sizes: tuple[tuple[int, float], ...] = ((1, 0.7), (2, 0.1), (4, 0.1), (8, 0.1))
    priorities: tuple[tuple[PriorityClass, float], ...] = ((PriorityClass.NORMAL, 1.0),)
    median_duration_s: float = 1800.0
    sigma: float = 1.0
    fail_prob: float = 0.0
    checkpoint_s: float | None = 600.0
    bounded: bool = False
    estimate: str = "exact"
    """As Philly's ``estimate``: ``exact`` tells the scheduler the true duration as
    ``expected_duration_s`` (an oracle), ``none`` tells it nothing."""


_T = TypeVar("_T")


def _pick(rng: random.Random, choices: tuple[tuple[_T, float], ...]) -> _T:
    x = rng.random() * sum(w for _, w in choices)
    for value, w in choices:
        x -= w
        if x <= 0:
            return value
    return choices[-1][0]


def synthetic(teams: list[SyntheticTeam], horizon_s: float, seed: int) -> Iterator[SimJob]:
    """Poisson arrivals per team, job sizes and priorities from weighted choices, log-normal
    durations; deterministic for a seed (one ``random.Random(seed)``).

    Raises ValueError for a rate that is not a finite number > 0 (the arrivals would never
    reach the horizon) or a horizon that is not finite."""
    if not math.isfinite(horizon_s):
        raise ValueError(f"horizon_s must be finite, not {horizon_s}")
    for t in teams:
        if not (math.isfinite(t.jobs_per_hour) and t.jobs_per_hour > 0):
            rate = t.jobs_per_hour
            raise ValueError(f"team {t.team_id}: jobs_per_hour must be finite and > 0, not {rate}")
    rng = random.Random(seed)
    out: list[SimJob] = []
    for t in teams:
        now = 0.0
        k = 0
        while True:
            now += rng.expovariate(t.jobs_per_hour / 3600.0)
            if now >= horizon_s:
                break
            dur = max(10.0, t.median_duration_s * math.exp(rng.gauss(0.0, t.sigma)))
            fails = 0
            while fails < 3 and rng.random() < t.fail_prob:
                fails += 1
            out.append(
                SimJob(
                    job_id=f"{t.team_id}-{k:06d}",
                    team_id=t.team_id,
                    submit_s=round(now, 3),
                    gpus=_pick(rng, t.sizes),
                    duration_s=round(dur, 3),
                    priority=_pick(rng, t.priorities),
                    expected_duration_s=round(dur, 3) if t.estimate == "exact" else None,
                    max_runtime_s=round(dur * 1.05, 3) if t.bounded else None,
                    failures=fails,
                    checkpoint_s=t.checkpoint_s,
                )
            )
            k += 1
    yield from sorted(out, key=lambda j: (j.submit_s, j.job_id))


def philly_teams(vc_nodes: dict[str, int], gpus_per_node: int, gpu_type: str) -> list[TeamSpec]:
    """One team per VC, guarantee = its VC size in GPUs, weight proportional to it."""
    return [
        TeamSpec(
            vc, weight=float(n * gpus_per_node), guaranteed_gpus={gpu_type: n * gpus_per_node}
        )
        for vc, n in sorted(vc_nodes.items())
    ]
