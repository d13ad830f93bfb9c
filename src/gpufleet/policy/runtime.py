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

import heapq
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

    @classmethod
    def kept(cls, by_node: dict[str, list[tuple[float, RunningJob]]]) -> RunningIndex:
        """An index over ``by_node`` as a ``RunningKeeper`` keeps it (no per-attempt work)."""
        index = cls.__new__(cls)
        index.by_node = by_node
        index._by_end = None
        return index


class RunningKeeper:
    """A ``RunningIndex`` kept by a driver across passes (``ClusterSnapshot.running_keeper``):
    a node's attempts are ordered again only when one of them changed or one's end depends
    on the time of the pass.

    An attempt's end (``estimated_end_s``) is the same number on every pass while that
    number is not before the pass's ``now_s``: only a stopping attempt and an estimate that
    already passed depend on ``now_s``. So the keeper holds each attempt's estimate at
    ``now_s = -inf`` (its own estimate, or +inf), watches the earliest of them in a heap,
    and once one passed (time only moves on) counts the attempt's node as *volatile*:
    re-keyed on every pass from then on, with the nodes whose attempts were added, replaced
    or removed. Every other node keeps its sorted list. ``index(now_s)`` is then equal to
    ``RunningIndex(the attempts, now_s, config)`` (the same ``by_node`` lists; the dict's
    order may differ, which no reader depends on: they look nodes up or sort).

    ``config`` must be the pass's (``default_runtime_estimate_s``); the attempts handed to a
    pass (``ClusterSnapshot.running``) must be exactly those added and not removed.
    """

    def __init__(self, config: PolicyConfig) -> None:
        self._cfg = config
        self._runs: dict[str, dict[str, RunningJob]] = {}  # node -> run id -> attempt
        self._node_of: dict[str, str] = {}  # run id -> node
        self._by_node: dict[str, list[tuple[float, RunningJob]]] = {}
        self._dirty: set[str] = set()
        self._volatile: dict[str, int] = {}  # node -> attempts whose end depends on now
        self._now_dependent: set[str] = set()  # run ids counted in ``_volatile``
        # (own estimate, serial, run id, attempt): the serial keeps two entries of one run id
        # from comparing their attempts
        self._heap: list[tuple[float, int, str, RunningJob]] = []
        self._serial = 0
        self._now = -math.inf

    def add(self, run: RunningJob) -> None:
        """Add ``run``, or replace the attempt of its run id (run ids are unique among the
        attempts: one per member of a gang, as the store keeps them)."""
        self.remove(run.run_id)
        node = run.node_id
        self._runs.setdefault(node, {})[run.run_id] = run
        self._node_of[run.run_id] = node
        self._dirty.add(node)
        own = estimated_end_s(run, -math.inf, self._cfg)  # (its own estimate, or +inf)
        if run.stopping:
            self._mark(run.run_id, node)
        elif own != math.inf:  # (one already passed is marked by the next ``index``)
            self._serial += 1
            heapq.heappush(self._heap, (own, self._serial, run.run_id, run))

    def remove(self, run_id: str) -> None:
        node = self._node_of.pop(run_id, None)
        if node is None:
            return
        runs = self._runs[node]
        del runs[run_id]
        if not runs:
            del self._runs[node]
        self._dirty.add(node)
        if run_id in self._now_dependent:
            self._now_dependent.discard(run_id)
            left = self._volatile[node] - 1
            if left:
                self._volatile[node] = left
            else:
                del self._volatile[node]
        # (its heap entry, if any, is dropped when it surfaces: the attempt is not current)

    def _mark(self, run_id: str, node: str) -> None:
        if run_id in self._now_dependent:
            return  # (the same attempt added again: one heap entry each time)
        self._now_dependent.add(run_id)
        self._volatile[node] = self._volatile.get(node, 0) + 1

    def index(self, now_s: float) -> RunningIndex:
        """The running index of the kept attempts at ``now_s`` (a fresh ``RunningIndex``
        object over a copy of the kept dict: the pass reads it, the keeper changes its own)."""
        if now_s < self._now:  # (the clock went back: every node is keyed again)
            every = [r for by_id in self._runs.values() for r in by_id.values()]
            self._runs, self._node_of, self._by_node = {}, {}, {}
            self._volatile, self._now_dependent, self._heap = {}, set(), []
            for r in every:
                self.add(r)
        self._now = now_s
        heap = self._heap
        while heap and heap[0][0] < now_s:
            _, _, run_id, run = heapq.heappop(heap)
            node = self._node_of.get(run_id)
            if node is not None and self._runs[node][run_id] is run:
                self._mark(run_id, node)
        cfg, by_node = self._cfg, self._by_node
        for node in self._dirty.union(self._volatile):
            runs = self._runs.get(node)
            if runs is None:
                by_node.pop(node, None)
                continue
            keyed = [(estimated_end_s(r, now_s, cfg), r) for r in runs.values()]
            if len(keyed) > 1:
                keyed.sort(key=_end_key)
            by_node[node] = keyed
        self._dirty.clear()
        return RunningIndex.kept(dict(by_node))
