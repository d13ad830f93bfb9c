"""How good is the duration predictor? Replays a trace in time order and prints the error.

For each job, in submit order, the history is what had *finished* by its submit (a job is
taken to end at submit + duration, as if it never waited: the trace has no start times), and
each estimator predicts a p50 and a p90 of its run time. Per estimator (a feature set) the
table gives:

  * MALE: median |log(predicted p50 / actual)| (0.69 = off by 2x), and its p90;
  * within 2x: share of jobs whose p50 is within a factor 2 of the actual;
  * cov50 / cov90: share of jobs that ended by the predicted p50 / p90 (ideal 0.5 / 0.9);
  * fallback: share of jobs the feature set had no history for (the global median answers).

Traces (``--traces-dir``, else ``$GPUFLEET_TRACES_DIR``, else ``../shared/traces``):
  * Philly 2017: features team (VC) and GPU count only; the trace has no user, job name or
    command, so "user" is the VC and the job name is approximated by a *burst* (the jobs of
    one VC and GPU count submitted less than 10 min apart, as a sweep is);
  * openb 2023: lifetime (deletion - scheduled) of pods that ended, a rough duration proxy;
    features QoS class, GPU count and the pod's shape (CPU, memory, GPU share), the
    closest the trace has to a command.
Helios and PAI 2020 have no per-job durations here (aggregates and machine lists only).

``shipped`` is ``policy.predictor.DurationPredictor`` as the scheduler uses it: ``predict``
(its 0.8 quantile) as the point estimate; ``predictor p50`` is the same predictor's
``quantiles`` (the median at the same level). Evaluation starts at ``--eval-from`` (Philly:
2017-10-01, the September jobs are history only).

    .venv/bin/python benchmarks/predictor_error.py [--traces-dir DIR] [--trace philly,openb]

About 20 CPU s for Philly, 1 s for openb.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import gzip
import heapq
import math
import os
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from gpufleet.policy.predictor import DurationPredictor, JobKey

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Job:
    submit_s: float
    duration_s: float
    team: str
    gpus: int
    name: str  # Philly: the burst; openb: the pod's shape
    evaluate: bool


Quant = tuple[float, float] | None


class Median:
    """p50/p90 of every finished duration under a key (unbounded history)."""

    def __init__(self, keyf: Callable[[Job], Hashable]) -> None:
        self.keyf = keyf
        self.h: dict[Hashable, list[float]] = defaultdict(list)

    def observe(self, j: Job) -> None:
        bisect.insort(self.h[self.keyf(j)], j.duration_s)

    def predict(self, j: Job) -> Quant:
        v = self.h.get(self.keyf(j))
        return (_q(v, 0.5), _q(v, 0.9)) if v else None


class Window:
    """p50/p90 of the last ``window`` finished durations, most specific key first."""

    def __init__(self, keyf: Callable[[Job], Sequence[Hashable]], window: int = 64) -> None:
        self.keyf = keyf
        self.h: dict[Hashable, deque[float]] = defaultdict(lambda: deque(maxlen=window))

    def observe(self, j: Job) -> None:
        for k in self.keyf(j):
            self.h[k].append(j.duration_s)

    def predict(self, j: Job) -> Quant:
        for k in self.keyf(j):
            h = self.h.get(k)
            if h is not None and len(h) >= 3:
                s = sorted(h)
                return (_q(s, 0.5), _q(s, 0.9))
        return None


class Shipped:
    """``DurationPredictor``: ``point`` = ``predict`` (0.8 quantile) or ``quantiles`` p50."""

    def __init__(self, p50: bool) -> None:
        self.p = DurationPredictor()
        self.p50 = p50

    @staticmethod
    def key(j: Job) -> JobKey:
        return JobKey(j.team, j.gpus, "", j.name)

    def observe(self, j: Job) -> None:
        self.p.observe(self.key(j), j.duration_s)

    def predict(self, j: Job) -> Quant:
        k = self.key(j)
        q = self.p.quantiles(k)
        if q is None:
            return None
        if self.p50:
            return (q.p50_s, q.p90_s)
        p = self.p.predict(k)
        assert p is not None
        return (p.seconds, q.p90_s)


def _q(s: Sequence[float], q: float) -> float:
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def replay(
    jobs: list[Job], est: dict[str, object]
) -> dict[str, list[tuple[float, float, float, bool]]]:
    """(p50, p90, actual, fell back) per evaluated job and estimator."""
    glob = Median(lambda _: ())
    allest = {**est, "_global": glob}
    out: dict[str, list[tuple[float, float, float, bool]]] = {n: [] for n in est}
    done: list[tuple[float, int]] = []
    for i, j in enumerate(jobs):
        while done and done[0][0] <= j.submit_s:
            _, k = heapq.heappop(done)
            for e in allest.values():
                e.observe(jobs[k])  # type: ignore[attr-defined]
        if j.evaluate:
            g = glob.predict(j)
            for n, e in est.items():
                p = e.predict(j)  # type: ignore[attr-defined]
                fell = p is None
                p = p or g
                if p is not None:
                    out[n].append((p[0], p[1], j.duration_s, fell))
        heapq.heappush(done, (j.submit_s + j.duration_s, i))
    return out


def table(title: str, res: dict[str, list[tuple[float, float, float, bool]]]) -> None:
    print(f"\n{title}\n")
    print("| features | jobs | MALE | p90 abs log error | within 2x | cov50 | cov90 | fallback |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in res.items():
        if not r:
            continue
        e = sorted(abs(math.log(a / b)) for a, _, b, _ in r)
        n2 = sum(x <= math.log(2) for x in e) / len(e)
        c50 = sum(b <= a for a, _, b, _ in r) / len(r)
        c90 = sum(b <= c for _, c, b, _ in r) / len(r)
        fb = sum(f for *_, f in r) / len(r)
        print(
            f"| {n} | {len(r):,} | {_q(e, 0.5):.2f} | {_q(e, 0.9):.2f} | {n2:.2f} | "
            f"{c50:.2f} | {c90:.2f} | {fb:.2f} |"
        )


def _epoch(s: str) -> float:
    return datetime.strptime(s, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()


def philly(traces: Path, eval_from: str) -> list[Job]:
    path = traces / "philly_2017" / "philly_jobs_2017-09-04_to_2017-11-30.csv.gz"
    rows = []
    with gzip.open(path, "rt") as f:
        for r in csv.DictReader(f):
            rows.append(
                (
                    _epoch(r["timestamp"]),
                    max(1.0, float(r["duration"])),
                    r["cluster"].strip(),
                    int(float(r["num_gpus"])),
                )
            )
    rows.sort()
    t0 = _epoch(eval_from)
    last: dict[tuple[str, int], tuple[float, float]] = {}
    jobs = []
    for ts, d, vc, g in rows:
        prev = last.get((vc, g))
        burst = ts if prev is None or ts - prev[0] > 600 else prev[1]
        last[(vc, g)] = (ts, burst)
        jobs.append(Job(ts, d, vc, g, f"b{burst:.0f}", ts >= t0))
    return jobs


def openb(traces: Path) -> list[Job]:
    path = traces / "alibaba_openb_2023" / "openb_pod_list_default.csv.gz"
    jobs = []
    with gzip.open(path, "rt") as f:
        for r in csv.DictReader(f):
            if not r["scheduled_time"] or not r["deletion_time"]:
                continue
            d = float(r["deletion_time"]) - float(r["scheduled_time"])
            if d <= 0:
                continue
            shape = f"{r['cpu_milli']}/{r['memory_mib']}/{r['gpu_milli']}"
            jobs.append(
                Job(float(r["creation_time"]), d, r["qos"], int(r["num_gpu"]), shape, True)
            )
    jobs.sort(key=lambda j: j.submit_s)
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces-dir", type=Path, default=None)
    ap.add_argument("--trace", default="philly,openb")
    ap.add_argument("--eval-from", default="2017-10-01 00:00:00")
    a = ap.parse_args()
    traces = a.traces_dir or Path(
        os.environ.get("GPUFLEET_TRACES_DIR") or ROOT.parent / "shared" / "traces"
    )
    if not (traces / "philly_2017").exists():
        traces = Path("/work/shared/traces")
    todo = a.trace.split(",")
    if "philly" in todo:
        est: dict[str, object] = {
            "global median (baseline)": Median(lambda _: ()),
            "user = VC median (baseline)": Median(lambda j: j.team),
            "GPU count (last 64)": Window(lambda j: [j.gpus]),
            "VC + GPU count (last 64)": Window(lambda j: [(j.team, j.gpus), j.team]),
            "burst (name proxy) > VC + GPUs": Window(
                lambda j: [(j.team, j.gpus, j.name), (j.team, j.gpus), j.team]
            ),
            "shipped: predict() (p80 point)": Shipped(p50=False),
            "predictor p50 (quantiles())": Shipped(p50=True),
        }
        # the shipped predictor keys the name as its own level: strip the burst for it
        jobs = philly(traces, a.eval_from)
        plain = [Job(j.submit_s, j.duration_s, j.team, j.gpus, "", j.evaluate) for j in jobs]
        res = replay(plain, {k: v for k, v in est.items() if not k.startswith("burst")})
        res.update(replay(jobs, {k: v for k, v in est.items() if k.startswith("burst")}))
        table(f"Philly 2017, jobs submitted from {a.eval_from} (history from Sep 4)", res)
    if "openb" in todo:
        est = {
            "global median (baseline)": Median(lambda _: ()),
            "QoS class median (baseline)": Median(lambda j: j.team),
            "GPU count (last 64)": Window(lambda j: [j.gpus]),
            "pod shape = command proxy (last 64)": Window(lambda j: [j.name]),
            "QoS + shape + GPUs (last 64)": Window(
                lambda j: [(j.team, j.name, j.gpus), (j.team, j.gpus), j.team]
            ),
            "shipped: predict() (p80 point)": Shipped(p50=False),
            "predictor p50 (quantiles())": Shipped(p50=True),
        }
        table(
            "openb 2023, pods that ended (lifetime = deletion - scheduled)",
            replay(openb(traces), est),
        )


if __name__ == "__main__":
    main()
