"""When running work is expected to end: the shared input of backfill and preemption.

Per node, the running attempts with their estimated end, built once per pass and only when a
reservation or a victim search needs it.

End estimate of a running attempt (``estimated_end_s``):
  * ``expected_duration_s`` (the user's) is the estimate, else ``predicted_duration_s`` (the
    platform's, ``policy.predictor``); either is capped by ``max_runtime_s`` (the hard bound
    the agent enforces);
  * only a hard bound: the hard bound;
  * neither: ``PolicyConfig.default_runtime_estimate_s`` if set, else +inf (never ends: its
    GPUs are never counted on by a reservation);
  * a user's estimate already passed: the hard bound if there is one, else ``now_s`` (it
    should end any moment; the reservation's start is recomputed on every pass, so the error
    heals itself);
  * a prediction already passed: ``now_s`` plus the time it has run so far, capped by the
    hard bound. Run times are heavy-tailed: an attempt that outlived the prediction for its
    kind is likely a long one, and "any moment" would draw every reservation to the nodes
    running such stragglers (the earliest start) and hold them there.
  * a stopping (PREEMPTING) attempt: ``now_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import itemgetter

from gpufleet.policy.config import PolicyConfig
from gpufleet.policy.snapshot import RunningJob


def estimated_end_s(run: RunningJob, now_s: float, config: PolicyConfig) -> float:
    if run.stopping:
        return now_s
    hard = run.started_at_s + run.max_runtime_s if run.max_runtime_s is not None else None
    guess = run.expected_duration_s
    predicted = guess is None and run.predicted_duration_s is not None
    if guess is None:
        guess = run.predicted_duration_s
    if guess is not None:
        est = run.started_at_s + guess
        if hard is not None:
            est = min(est, hard)
    elif hard is not None:
        est = hard
    elif config.default_runtime_estimate_s is not None:
        est = run.started_at_s + config.default_runtime_estimate_s
    else:
        return math.inf
    if est < now_s:
        if predicted:
            late = now_s + (now_s - run.started_at_s)
            return min(late, max(now_s, hard)) if hard is not None else late
        return max(now_s, hard) if hard is not None else now_s
    return est


def _end_key(e: tuple[float, RunningJob]) -> tuple[float, str]:
    return (e[0], e[1].run_id)


class RunningIndex:
    """Running attempts grouped by node, each group sorted by estimated end."""

    def __init__(self, running: Iterable[RunningJob], now_s: float, config: PolicyConfig):
        by_node: dict[str, list[tuple[float, RunningJob]]] = {}
        self.by_node = by_node
        end_of = estimated_end_s
        for r in running:
            e = (end_of(r, now_s, config), r)
            runs = by_node.get(r.node_id)
            if runs is None:
                by_node[r.node_id] = [e]
            else:
                runs.append(e)
        for runs in by_node.values():
            n = len(runs)
            if n == 2:  # (most nodes run one or two attempts: no sort call for two)
                a, b = runs
                if a[0] > b[0] or (a[0] == b[0] and a[1].run_id > b[1].run_id):
                    runs.reverse()
            elif n > 2:
                runs.sort(key=_end_key)
        self._by_end: list[tuple[float, RunningJob]] | None = None
        self._drained: list[tuple[float, str, int]] | None = None

    @property
    def by_end(self) -> list[tuple[float, RunningJob]]:
        """Every attempt with a known end as its ``by_node`` entry ``(estimated end,
        attempt)`` (the same tuples: no copy per attempt), sorted by end (attempts ending at
        the same instant in no particular order: the one reader,
        ``backfill.find_reservation``, takes every attempt of an instant together): the
        fleet-wide order in which GPUs free up (built on first use, once per pass)."""
        if self._by_end is None:
            inf = math.inf
            ends = [e for runs in self.by_node.values() for e in runs if e[0] != inf]
            ends.sort(key=itemgetter(0))
            self._by_end = ends
        return self._by_end

    @property
    def drained(self) -> list[tuple[float, str, int]]:
        """``(last estimated end, node_id, GPUs its attempts hold)`` of every node whose
        attempts all have a known end, sorted by end then node id: when each node is
        expected to run nothing (built on first use, once per pass; the reader is
        ``backfill.find_gang_reservation``'s whole-node members)."""
        if self._drained is None:
            inf = math.inf
            self._drained = sorted(
                (runs[-1][0], node_id, sum(r.gpu_count for _, r in runs))
                for node_id, runs in self.by_node.items()
                if runs[-1][0] != inf
            )
        return self._drained
